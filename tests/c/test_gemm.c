/* GEMM tests: comera_gemm_f32/f64 and the packed forms against a naive
 * triple loop, for strided / transposed operands, with and without
 * accumulation.  Inputs are rounded to float so both types see identical
 * values and the double reference is (nearly) exact for both. */
#include "reference.h"
#include "common/gemm.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SENTINEL 12345.0

/* Layout of a rows x cols operand: 0 row-major, 1 transposed (column-major),
 * 2 strided in both directions with gaps.  Returns the buffer length. */
static int64_t layout(int kind, int64_t rows, int64_t cols, int64_t *rs, int64_t *cs) {
    switch (kind) {
    case 0: *rs = cols; *cs = 1; break;
    case 1: *rs = 1; *cs = rows; break;
    default: *rs = 2 * cols + 3; *cs = 2; break;
    }
    if (rows == 0 || cols == 0) return 1;
    return (rows - 1) * *rs + (cols - 1) * *cs + 1;
}

static const char *LNAME[3] = {"row", "trans", "strided"};

/* One product in both types and both entry points against the reference. */
static void gemm_case(lcg_t *g, int64_t M, int64_t N, int64_t K, int la, int lb, int acc) {
    int64_t rsa, csa, rsb, csb, ldc = N + 3;
    int64_t na = layout(la, M, K, &rsa, &csa), nb = layout(lb, K, N, &rsb, &csb);
    int64_t nc = M * ldc;
    double *A = dalloc(na), *B = dalloc(nb), *C0 = dalloc(nc), *R = dalloc(nc), *absR = dalloc(nc);
    double *out = dalloc(nc);
    float *Af = falloc(na), *Bf = falloc(nb), *Cf = falloc(nc);
    fill_uniform(g, A, na, -1, 1);
    fill_uniform(g, B, nb, -1, 1);
    fill_uniform(g, C0, nc, -1, 1);
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = N; j < ldc; j++) C0[i * ldc + j] = SENTINEL;
    to_float(A, Af, na); to_double(Af, A, na);
    to_float(B, Bf, nb); to_double(Bf, B, nb);
    to_float(C0, Cf, nc); to_double(Cf, C0, nc);
    memcpy(R, C0, sizeof(double) * (size_t)nc);
    ref_gemm(M, N, K, A, rsa, csa, B, rsb, csb, R, ldc, acc, absR);

    for (int type = 0; type < 2; type++)
        for (int packed = 0; packed < 2; packed++) {
            int rc = 0;
            if (type == 0) {
                memcpy(out, C0, sizeof(double) * (size_t)nc);
                if (packed) {
                    double *Bp = dalloc(comera_gemm_packed_size(K, N));
                    comera_gemm_pack_b_f64(K, N, B, rsb, csb, Bp);
                    comera_gemm_packed_f64(M, N, K, A, rsa, csa, Bp, out, ldc, acc);
                    free(Bp);
                } else {
                    rc = comera_gemm_f64(M, N, K, A, rsa, csa, B, rsb, csb, out, ldc, acc);
                }
            } else {
                to_float(C0, Cf, nc);
                if (packed) {
                    float *Bp = falloc(comera_gemm_packed_size(K, N));
                    comera_gemm_pack_b_f32(K, N, Bf, rsb, csb, Bp);
                    comera_gemm_packed_f32(M, N, K, Af, rsa, csa, Bp, Cf, ldc, acc);
                    free(Bp);
                } else {
                    rc = comera_gemm_f32(M, N, K, Af, rsa, csa, Bf, rsb, csb, Cf, ldc, acc);
                }
                to_double(Cf, out, nc);
            }
            double eps = type == 0 ? DBL_EPSILON : FLT_EPSILON, worst = 0.0;
            int64_t bad = -1;
            for (int64_t i = 0; i < M && bad < 0; i++)
                for (int64_t j = 0; j < ldc; j++) {
                    int64_t o = i * ldc + j;
                    if (j >= N) {
                        if (out[o] != SENTINEL) { bad = o; break; }
                        continue;
                    }
                    double err = fabs(out[o] - R[o]);
                    double tol = 2.0 * (double)(K + 2) * eps * absR[o] + 1e-300;
                    if (!(err <= tol)) { bad = o; break; }
                    if (absR[o] > 0 && err / absR[o] > worst) worst = err / absR[o];
                }
            group_note_err(worst);
            check(rc == 0 && bad < 0,
                  "%s %s M=%lld N=%lld K=%lld A=%s B=%s acc=%d: rc=%d, first bad (%lld,%lld) got %.9g want %.9g",
                  type == 0 ? "f64" : "f32", packed ? "packed" : "gemm", (long long)M, (long long)N,
                  (long long)K, LNAME[la], LNAME[lb], acc, rc, bad < 0 ? -1LL : (long long)(bad / ldc),
                  bad < 0 ? -1LL : (long long)(bad % ldc), bad < 0 ? 0.0 : out[bad], bad < 0 ? 0.0 : R[bad]);
        }
    free(A); free(B); free(C0); free(R); free(absR); free(out); free(Af); free(Bf); free(Cf);
}

/* COMERA_GEMM_STREAM writes the same values as COMERA_GEMM_STORE, bit for
 * bit (same products, other stores), in 64-byte-aligned rows where the
 * streaming stores run and in unaligned ones where they cannot. */
static void stream_case(lcg_t *g, int64_t M, int64_t N, int64_t K, int64_t ldc, int offset) {
    float *A = falloc(M * K), *B = falloc(K * N), *Bp = falloc(comera_gemm_packed_size(K, N));
    float *C0 = aligned_alloc(64, (size_t)((M * ldc + offset) * 4 + 64) / 64 * 64);
    float *C1 = aligned_alloc(64, (size_t)((M * ldc + offset) * 4 + 64) / 64 * 64);
    double *t = dalloc(M * K > K * N ? M * K : K * N);
    fill_uniform(g, t, M * K, -1, 1);
    to_float(t, A, M * K);
    fill_uniform(g, t, K * N, -1, 1);
    to_float(t, B, K * N);
    for (int64_t i = 0; i < M * ldc + offset; i++) C0[i] = C1[i] = (float)SENTINEL;
    comera_gemm_pack_b_f32(K, N, B, N, 1, Bp);
    comera_gemm_packed_f32(M, N, K, A, K, 1, Bp, C0 + offset, ldc, COMERA_GEMM_STORE);
    comera_gemm_packed_f32(M, N, K, A, K, 1, Bp, C1 + offset, ldc, COMERA_GEMM_STREAM);
    check(memcmp(C0, C1, sizeof(float) * (size_t)(M * ldc + offset)) == 0,
          "stream M=%lld N=%lld K=%lld ldc=%lld offset=%d differs from store", (long long)M,
          (long long)N, (long long)K, (long long)ldc, offset);
    free(A); free(B); free(Bp); free(C0); free(C1); free(t);
}

/* comera_gemm_rows_* (B row-major, read in place; its last N % 16 columns
 * through a packed tail) against the reference: A transposed, as the TT
 * weight gradients read it, C stored or added to, sentinels after each row
 * of C and of B. */
static void rows_case(lcg_t *g, int64_t M, int64_t N, int64_t K, int acc) {
    int64_t ldb = N + 3, ldc = N + 2;
    double *A = dalloc(K * M), *B = dalloc(K * ldb), *C = dalloc(M * ldc), *R = dalloc(M * ldc);
    double *out = dalloc(M * ldc), *tail = dalloc(16 * K);
    float *Af = falloc(K * M), *Bf = falloc(K * ldb), *Cf = falloc(M * ldc), *tf = falloc(16 * K);
    fill_uniform(g, A, K * M, -1, 1);
    fill_uniform(g, B, K * ldb, -1, 1);
    fill_uniform(g, C, M * ldc, -1, 1);
    for (int64_t k = 0; k < K; k++)
        for (int64_t j = N; j < ldb; j++) B[k * ldb + j] = NAN; /* never read */
    to_float(A, Af, K * M); to_double(Af, A, K * M);
    to_float(B, Bf, K * ldb); to_double(Bf, B, K * ldb);
    to_float(C, Cf, M * ldc); to_double(Cf, C, M * ldc);
    memcpy(R, C, sizeof(double) * (size_t)(M * ldc));
    ref_gemm(M, N, K, A, 1, M, B, ldb, 1, R, ldc, acc, NULL);
    memcpy(out, C, sizeof(double) * (size_t)(M * ldc));
    comera_gemm_rows_f64(M, N, K, A, 1, M, B, ldb, out, ldc, acc, tail);
    comera_gemm_rows_f32(M, N, K, Af, 1, M, Bf, ldb, Cf, ldc, acc, tf);
    double e64 = rel_err(out, R, M * ldc), e32;
    to_double(Cf, out, M * ldc);
    e32 = rel_err(out, R, M * ldc);
    group_note_err(e64);
    group_note_err32(e32);
    check(e64 <= 1e-13 && e32 <= 1e-5, "rows M=%lld N=%lld K=%lld acc=%d: f64 %.3g f32 %.3g",
          (long long)M, (long long)N, (long long)K, acc, e64, e32);
    free(A); free(B); free(C); free(R); free(out); free(tail); free(Af); free(Bf); free(Cf);
    free(tf);
}

/* comera_gemm_dot_* (C = A Bt^T, both read along K) against the reference,
 * in strided rows (lda, ldb, ldc wider than K and N), with sentinels after
 * each row of C: every tile size (1..3 rows, 1..4 columns) and the masked
 * tail of K % 8 elements. */
static void dot_case(lcg_t *g, int64_t M, int64_t N, int64_t K) {
    int64_t lda = K + 5, ldb = K + 3, ldc = N + 2;
    int64_t na = M * lda + 1, nb = N * ldb + 1, nc = M * ldc + 1;
    double *A = dalloc(na), *Bt = dalloc(nb), *R = dalloc(nc), *absR = dalloc(nc), *out = dalloc(nc);
    float *Af = falloc(na), *Bf = falloc(nb), *Cf = falloc(nc);
    fill_uniform(g, A, na, -1, 1);
    fill_uniform(g, Bt, nb, -1, 1);
    to_float(A, Af, na); to_double(Af, A, na);
    to_float(Bt, Bf, nb); to_double(Bf, Bt, nb);
    for (int64_t i = 0; i < nc; i++) R[i] = SENTINEL;
    /* B (K x N) is Bt read with row stride 1 and column stride ldb */
    ref_gemm(M, N, K, A, lda, 1, Bt, 1, ldb, R, ldc, 0, absR);
    for (int type = 0; type < 2; type++) {
        for (int64_t i = 0; i < nc; i++) out[i] = SENTINEL;
        /* with and without packing A on the way (compared bit for bit
         * with comera_gemm_pack_b_* below) */
        int pack = (int)((M + N + K) % 2);
        int64_t np = comera_gemm_packed_size(M, K);
        int same = 1;
        if (type == 0) {
            double *P = pack ? dalloc(np) : NULL, *Q = dalloc(np);
            comera_gemm_dot_f64(M, N, K, A, lda, Bt, ldb, out, ldc, P);
            if (P) {
                comera_gemm_pack_b_f64(M, K, A, lda, 1, Q);
                same = memcmp(P, Q, sizeof(double) * (size_t)(K > 0 ? np : 0)) == 0;
            }
            free(P); free(Q);
        } else {
            float *P = pack ? falloc(np) : NULL, *Q = falloc(np);
            to_float(out, Cf, nc);
            comera_gemm_dot_f32(M, N, K, Af, lda, Bf, ldb, Cf, ldc, P);
            to_double(Cf, out, nc);
            if (P) {
                comera_gemm_pack_b_f32(M, K, Af, lda, 1, Q);
                same = memcmp(P, Q, sizeof(float) * (size_t)(K > 0 ? np : 0)) == 0;
            }
            free(P); free(Q);
        }
        check(same, "dot %s M=%lld N=%lld K=%lld: packed A differs from pack_b",
              type == 0 ? "f64" : "f32", (long long)M, (long long)N, (long long)K);
        double eps = type == 0 ? DBL_EPSILON : FLT_EPSILON;
        int64_t bad = -1;
        for (int64_t o = 0; o < nc && bad < 0; o++) {
            int64_t j = o % ldc;
            if (j >= N || o / ldc >= M) {
                if (out[o] != SENTINEL) bad = o;
                continue;
            }
            double tol = 2.0 * (double)(K + 2) * eps * absR[o] + 1e-300;
            if (!(fabs(out[o] - R[o]) <= tol)) bad = o;
        }
        check(bad < 0, "dot %s M=%lld N=%lld K=%lld: first bad (%lld,%lld) got %.9g want %.9g",
              type == 0 ? "f64" : "f32", (long long)M, (long long)N, (long long)K,
              bad < 0 ? -1LL : (long long)(bad / ldc), bad < 0 ? -1LL : (long long)(bad % ldc),
              bad < 0 ? 0.0 : out[bad], bad < 0 ? 0.0 : R[bad]);
    }
    free(A); free(Bt); free(R); free(absR); free(out); free(Af); free(Bf); free(Cf);
}

void test_gemm(void) {
    static const int64_t S[] = {0, 1, 5, 6, 7, 15, 16, 17, 33, 100};
    const int ns = (int)(sizeof S / sizeof S[0]);
    lcg_t g;
    lcg_seed(&g, 1);
    group_begin("gemm f32/f64 plain+packed vs naive");
    int combo = 0;
    for (int a = 0; a < ns; a++)
        for (int b = 0; b < ns; b++)
            for (int c = 0; c < ns; c++, combo++) {
                int64_t M = S[a], N = S[b], K = S[c];
                int small = M * N * K <= 6000;
                for (int l = 0; l < 9; l++) {
                    int la = l / 3, lb = l % 3;
                    /* big products: two rotating layouts instead of all nine */
                    if (!small && l != combo % 9 && l != (combo * 5 + 4) % 9) continue;
                    for (int acc = 0; acc < 2; acc++) gemm_case(&g, M, N, K, la, lb, acc);
                }
            }
    group_end();

    /* small products whose loop runs down the columns of A, with more rows
     * than one block of that loop (256), the last block partial */
    group_begin("gemm small products in several row blocks");
    static const int64_t TALL[][3] = {{300, 2, 5}, {513, 1, 7}, {257, 3, 4}, {600, 6, 1}};
    for (int s = 0; s < 4; s++)
        for (int l = 0; l < 9; l++)
            for (int acc = 0; acc < 2; acc++)
                gemm_case(&g, TALL[s][0], TALL[s][1], TALL[s][2], l / 3, l % 3, acc);
    group_end();

    /* B larger than the block the driver keeps in L2 (160 KB): several
     * column blocks, the last one partial and not a whole tile wide */
    group_begin("gemm packed B in several column blocks");
    static const int64_t BIG[][3] = {{13, 700, 400}, {25, 1000, 300}, {7, 97, 3000}};
    for (int s = 0; s < 3; s++)
        for (int l = 0; l < 9; l += 4)
            for (int acc = 0; acc < 2; acc++)
                gemm_case(&g, BIG[s][0], BIG[s][1], BIG[s][2], l / 3, l % 3, acc);
    group_end();

    /* every last-row count of the 6- and 12-row tiles (their 2-, 4- and
     * 8-row forms): M = rank + 1 rows in the weight-gradient products */
    group_begin("gemm short row tiles");
    static const int64_t SM[] = {2, 3, 4, 8, 9, 10, 11, 14, 20, 31}, SN[] = {16, 40};
    static const int64_t SK[] = {1, 9, 48};
    for (int a = 0; a < 10; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 3; c++)
                for (int acc = 0; acc < 2; acc++) gemm_case(&g, SM[a], SN[b], SK[c], 0, (a + c) % 3, acc);
    group_end();

    group_begin("gemm with B read in place");
    static const int64_t RM[] = {1, 7, 11, 31}, RN[] = {1, 15, 16, 17, 32, 47, 768};
    static const int64_t RK[] = {0, 1, 48, 84};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 7; b++)
            for (int c = 0; c < 4; c++) rows_case(&g, RM[a], RN[b], RK[c], (a + b + c) % 2);
    group_end();

    group_begin("gemm dot products vs naive");
    /* rows and columns around both tile shapes (AVX2 3 x 4, AVX-512 4 x 5) */
    static const int64_t DM[] = {1, 2, 3, 4, 5, 6, 7, 9, 48};
    static const int64_t DN[] = {1, 2, 3, 4, 5, 8, 9, 10, 13, 15, 20, 64};
    static const int64_t DK[] = {0, 1, 7, 8, 9, 16, 31, 48, 768};
    for (int a = 0; a < 9; a++)
        for (int b = 0; b < 12; b++)
            for (int c = 0; c < 9; c++) dot_case(&g, DM[a], DN[b], DK[c]);
    /* the rule follows the variant: those with a dot kernel (avx2, and
     * avx512bf16: AMD), where padding wastes 15% of a 16-column panel */
    const char *vn = comera_gemm_variant_name();
    int dot = strcmp(vn, "avx2") == 0 || strcmp(vn, "avx512bf16") == 0;
    check(comera_gemm_dot_wins_f32(10) == dot && comera_gemm_dot_wins_f32(20) == dot &&
              !comera_gemm_dot_wins_f32(16) && !comera_gemm_dot_wins_f32(30) &&
              !comera_gemm_dot_wins_f32(100) && !comera_gemm_dot_wins_f64(10),
          "dot_wins under %s: 10 -> %d, 16 -> %d, 30 -> %d", comera_gemm_isa(),
          comera_gemm_dot_wins_f32(10), comera_gemm_dot_wins_f32(16), comera_gemm_dot_wins_f32(30));
    group_end();

    group_begin("gemm streaming stores equal plain stores");
    static const int64_t ST[][4] = {{12, 768, 9, 768}, {25, 64, 31, 64}, {100, 50, 8, 64},
                                    {7, 32, 17, 48}, {13, 96, 5, 100}};
    for (int c = 0; c < 5; c++)
        for (int offset = 0; offset < 2; offset++)
            stream_case(&g, ST[c][0], ST[c][1], ST[c][2], ST[c][3], offset);
    group_end();

    /* comera_copy_* in each mode: the n values exactly, nothing written
     * before or after them, at every alignment (streaming stores run at
     * 16-byte aligned destinations, plain copies elsewhere) and every tail */
    group_begin("copy with streaming stores");
    {
        float src[40], *buf = aligned_alloc(64, 64 * sizeof(float));
        double dsrc[40], dbuf[48];
        for (int i = 0; i < 40; i++) src[i] = dsrc[i] = (float)(i + 1) * 0.5f;
        for (int mode = COMERA_GEMM_STORE; mode <= COMERA_GEMM_STREAM; mode++)
            for (int off = 0; off < 5; off++)
                for (int n = 0; n <= 37; n++) {
                    for (int i = 0; i < 64; i++) buf[i] = (float)SENTINEL;
                    for (int i = 0; i < 48; i++) dbuf[i] = SENTINEL;
                    comera_copy_f32(buf + off, src, n, mode);
                    comera_copy_f64(dbuf + off, dsrc, n, mode);
                    comera_gemm_store_fence();
                    int ok = 1;
                    for (int i = 0; i < 64; i++)
                        ok &= buf[i] == (i >= off && i < off + n ? src[i - off] : (float)SENTINEL);
                    for (int i = 0; i < 48; i++)
                        ok &= dbuf[i] == (i >= off && i < off + n ? dsrc[i - off] : SENTINEL);
                    check(ok, "copy mode %d offset %d n %d", mode, off, n);
                }
        free(buf);
    }
    group_end();

    /* packed_size covers every panel, and K == 0 leaves C alone (acc) or
     * zeroes it; the packed B of a K x N operand is never read past its end
     * (exact-size buffers above let ASan check that). */
    group_begin("gemm packed_size / edge cases");
    check(comera_gemm_packed_size(1, 1) >= COMERA_GEMM_NR, "packed_size(1,1)");
    check(comera_gemm_packed_size(7, 17) >= 7 * 32, "packed_size(7,17) = %lld",
          (long long)comera_gemm_packed_size(7, 17));
    check(comera_gemm_packed_size(0, 5) >= 1, "packed_size(0,5)");
    {
        float C[6] = {1, 2, 3, 4, 5, 6}, A[1] = {0}, B[1] = {0};
        int rc = comera_gemm_f32(2, 3, 0, A, 0, 1, B, 3, 1, C, 3, 1);
        check(rc == 0 && C[0] == 1 && C[5] == 6, "K=0 accumulate changed C");
        rc = comera_gemm_f32(2, 3, 0, A, 0, 1, B, 3, 1, C, 3, 0);
        int zero = 1;
        for (int i = 0; i < 6; i++) zero &= C[i] == 0.0f;
        check(rc == 0 && zero, "K=0 overwrite did not zero C");
    }
    group_end();
}
