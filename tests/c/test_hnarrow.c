/* Tests of the 16-bit products with a narrow side, run once per
 * micro-kernel variant like the rest, against a float64 triple loop on the
 * same values:
 *  - where the variant has them (avx512bf16), the bfloat16 kernels of
 *    common/gemm_hnarrow.c: the dot product C = A Bt^T and the outer-
 *    product sum C += A^T B at sizes around their tiles (3 rows x 8
 *    columns; 12 rows x 32 columns; K in 32s; row pairs), with a float32
 *    or bfloat16 C, a float32 B, the ones column and sentinels past N that
 *    must survive; elsewhere, that the variant says it has none;
 *  - the widened dot product comera_hgemm_dot (variants without pair
 *    kernels for the type) and the variant's unpacked outer-product sum
 *    comera_hgemm_outer (avx2), for bfloat16 and float16. */
#include "reference.h"
#include "comera/dtype.h"
#include "common/gemm.h"
#include "common/gemm_half.h"
#include "common/gemm_hnarrow.h"
#include "common/gemm_isa.h"
#include "common/half.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BF COMERA_DT_BF16
#define TNAME16(h) ((h) == BF ? "bf16" : "f16")

/* n bfloat16 values, and the same as float32 */
static void bf16_fill(lcg_t *g, uint16_t *h, float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        h[i] = comera_f32_to_half(BF, (float)lcg_uniform(g));
        f[i] = comera_half_to_f32(BF, h[i]);
    }
}

/* Largest error beyond tolerance of C = A Bt^T (M x N, row stride ldc):
 * float32 sums, a 16-bit C (type c16, or 0 for float32 in Cf) rounded once
 * more; *untouched: the sentinels past N (0xfbff, 7.0f) survived. */
static double dot_error(int c16, int64_t M, int64_t N, int64_t K, const float *Af, int64_t lda,
                        const float *Bt, int64_t ldb, const uint16_t *Ch, const float *Cf,
                        int64_t ldc, int *untouched) {
    double worst = 0.0, scale = sqrt((double)K) + 1.0;
    *untouched = 1;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < ldc; j++) {
            int64_t at = i * ldc + j;
            if (j >= N) {
                *untouched &= c16 ? Ch[at] == 0xfbff : Cf[at] == 7.0f;
                continue;
            }
            double ref = 0.0;
            for (int64_t k = 0; k < K; k++) ref += (double)Af[i * lda + k] * Bt[j * ldb + k];
            double got = c16 ? comera_half_to_f32(c16, Ch[at]) : Cf[at];
            double rel = c16 == COMERA_DT_F16 ? 1e-3 : 8e-3;
            double tol = c16 ? rel * fabs(ref) + 1e-5 * scale : 1e-5 * scale;
            double e = fabs(got - ref);
            group_note_err(e / scale);
            if (!(e <= tol)) worst = e > worst || e != e ? e : worst;
        }
    return worst;
}

static void hdot_case(lcg_t *g, int64_t M, int64_t N, int64_t K, int ct, int prefetch) {
    int64_t lda = K + 5, ldb = K + 3, ldc = N + 4;
    uint16_t *A = xmalloc(2 * (size_t)(M * lda + 1)), *Bt = xmalloc(2 * (size_t)(N * ldb + 1));
    float *Af = falloc(M * lda + 1), *Bf = falloc(N * ldb + 1), *Cf = falloc(M * ldc + 1);
    uint16_t *Ch = xmalloc(2 * (size_t)(M * ldc + 1));
    bf16_fill(g, A, Af, M * lda);
    bf16_fill(g, Bt, Bf, N * ldb);
    for (int64_t i = 0; i < M * ldc; i++) Cf[i] = 7.0f, Ch[i] = 0xfbff;
    comera_hdot_bf16(M, N, K, A, lda, Bt, ldb, ct == BF ? (void *)Ch : (void *)Cf, ct, ldc,
                     prefetch ? A : NULL, 2 * lda);
    int untouched;
    double worst = dot_error(ct == BF ? BF : 0, M, N, K, Af, lda, Bf, ldb, Ch, Cf, ldc, &untouched);
    check(worst == 0.0 && untouched, "hdot %lldx%lldx%lld C %s%s: error %.3g, past N %s",
          (long long)M, (long long)N, (long long)K, ct == BF ? "bf16" : "f32",
          prefetch ? " prefetching" : "", worst, untouched ? "untouched" : "WRITTEN");
    free(A); free(Bt); free(Af); free(Bf); free(Cf); free(Ch);
}

static void houter_case(lcg_t *g, int64_t M, int64_t N, int64_t rows, int bt, int64_t ones) {
    int64_t lda = M + 2, ldb = N + 3, ldc = N + 4;
    uint16_t *A = xmalloc(2 * (size_t)(rows * lda + 1)), *Bh = xmalloc(2 * (size_t)(rows * ldb + 1));
    float *Af = falloc(rows * lda + 1), *Bf = falloc(rows * ldb + 1), *C = falloc(M * ldc + 1);
    double *R = dalloc(M * ldc + 1);
    uint32_t *Ap = xmalloc(4 * (size_t)(((rows + 1) / 2) * M + 1));
    bf16_fill(g, A, Af, rows * lda);
    bf16_fill(g, Bh, Bf, rows * ldb);
    for (int64_t i = 0; i < M * ldc; i++) C[i] = R[i] = (float)lcg_uniform(g);
    for (int64_t c = 0; c < M; c++)
        for (int64_t j = 0; j < N; j++)
            for (int64_t i = 0; i < rows; i++)
                R[c * ldc + j] += (c == ones ? 1.0 : (double)Af[i * lda + c]) * Bf[i * ldb + j];
    comera_houter_pairs(rows, M, A, lda, ones, Ap);
    comera_houter_bf16(M, N, rows, Ap, bt, bt == BF ? (const void *)Bh : (const void *)Bf, ldb, C,
                       ldc);
    double worst = 0.0, scale = sqrt((double)rows) + 1.0;
    for (int64_t i = 0; i < M * ldc; i++) {
        double e = fabs(C[i] - R[i]) / scale;
        group_note_err(e);
        if (!(e <= 1e-5)) worst = e > worst || e != e ? e : worst;
    }
    check(worst == 0.0, "houter %lldx%lld over %lld rows, B %s, ones column %lld: error %.3g",
          (long long)M, (long long)N, (long long)rows, bt == BF ? "bf16" : "f32",
          (long long)ones, worst);
    free(A); free(Bh); free(Af); free(Bf); free(C); free(R); free(Ap);
}

void test_hnarrow(void) {
    group_begin("narrow bf16 products");
    if (!comera_hnarrow_usable(BF)) {
        check(!comera_hnarrow_usable(COMERA_DT_F16), "no narrow kernels for float16");
        group_end();
        return;
    }
    check(!comera_hnarrow_usable(COMERA_DT_F16), "no narrow kernels for float16");
    lcg_t g;
    lcg_seed(&g, 4242);
    static const int64_t DM[] = {1, 2, 3, 4, 7};
    static const int64_t DN[] = {1, 2, 5, 8, 9, 11, 16, 17, 24, 30};
    static const int64_t DK[] = {1, 31, 32, 33, 100, 768};
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 10; b++)
            for (int k = 0; k < 6; k++)
                hdot_case(&g, DM[a], DN[b], DK[k], (a + b + k) % 2 ? BF : COMERA_DT_F32,
                          (a + k) % 2);
    static const int64_t OM[] = {1, 2, 5, 8, 9, 12, 13, 17, 25, 31};
    static const int64_t ON[] = {1, 15, 16, 17, 31, 32, 33, 70};
    static const int64_t OR[] = {0, 1, 2, 3, 7, 64};
    for (int a = 0; a < 10; a++)
        for (int b = 0; b < 8; b++)
            for (int r = 0; r < 6; r++)
                houter_case(&g, OM[a], ON[b], OR[r], (a + b + r) % 2 ? BF : COMERA_DT_F32,
                            (a + r) % 3 == 0 ? OM[a] - 1 : -1);
    group_end();
}

/* comera_hgemm_outer for a B of type bt (h or float32) and A float32. */
static void outer_case(lcg_t *g, int h, int bt, int64_t M, int64_t N, int64_t rows) {
    int64_t lda = M + 1, ldb = N + 3, ldc = N + 2;
    float *A = falloc(rows * lda + 1), *Bf = falloc(rows * ldb + 1), *C = falloc(M * ldc + 1);
    uint16_t *Bh = xmalloc(2 * (size_t)(rows * ldb + 1));
    double *R = dalloc(M * ldc + 1);
    for (int64_t i = 0; i < rows * lda; i++) A[i] = (float)lcg_uniform(g);
    for (int64_t i = 0; i < rows * ldb; i++) {
        Bh[i] = comera_f32_to_half(h, (float)lcg_uniform(g));
        Bf[i] = comera_half_to_f32(h, Bh[i]);
    }
    for (int64_t i = 0; i < M * ldc; i++) C[i] = R[i] = (float)lcg_uniform(g);
    for (int64_t c = 0; c < M; c++)
        for (int64_t j = 0; j < N; j++)
            for (int64_t i = 0; i < rows; i++) R[c * ldc + j] += (double)A[i * lda + c] * Bf[i * ldb + j];
    comera_hgemm_outer(bt, M, N, rows, A, lda, bt == COMERA_DT_F32 ? (const void *)Bf : Bh, ldb,
                       C, ldc);
    double worst = 0.0, scale = sqrt((double)rows) + 1.0;
    for (int64_t i = 0; i < M * ldc; i++) {
        double e = fabs(C[i] - R[i]) / scale;
        group_note_err(e);
        if (!(e <= 1e-5)) worst = e > worst || e != e ? e : worst;
    }
    check(worst == 0.0, "outer %s %lldx%lld over %lld rows, B %s: error %.3g", TNAME16(h),
          (long long)M, (long long)N, (long long)rows, bt == COMERA_DT_F32 ? "f32" : TNAME16(h),
          worst);
    free(A); free(Bf); free(C); free(Bh); free(R);
}

/* comera_hgemm_dot: A of type h widened, Bt float32, C float32 or h. */
static void widened_dot_case(lcg_t *g, int h, int64_t M, int64_t N, int64_t K, int ct) {
    int64_t lda = K + 2, ldb = K + 1, ldc = N + 3;
    uint16_t *A = xmalloc(2 * (size_t)(M * lda + 1)), *Ch = xmalloc(2 * (size_t)(M * ldc + 1));
    float *Af = falloc(M * lda + 1), *Bt = falloc(N * ldb + 1), *Cf = falloc(M * ldc + 1);
    float *scr = falloc(comera_hgemm_scratch(h, K));
    for (int64_t i = 0; i < M * lda; i++) {
        A[i] = comera_f32_to_half(h, (float)lcg_uniform(g));
        Af[i] = comera_half_to_f32(h, A[i]);
    }
    for (int64_t i = 0; i < N * ldb; i++) Bt[i] = (float)lcg_uniform(g);
    for (int64_t i = 0; i < M * ldc; i++) Cf[i] = 7.0f, Ch[i] = 0xfbff;
    comera_hgemm_dot(h, M, N, K, A, lda, Bt, ldb, ct == h ? (void *)Ch : (void *)Cf, ct, ldc, scr);
    int untouched;
    double worst = dot_error(ct == h ? h : 0, M, N, K, Af, lda, Bt, ldb, Ch, Cf, ldc, &untouched);
    check(worst == 0.0 && untouched, "widened dot %s %lldx%lldx%lld C %s: error %.3g, past N %s",
          TNAME16(h), (long long)M, (long long)N, (long long)K, ct == h ? "16-bit" : "f32", worst,
          untouched ? "untouched" : "WRITTEN");
    free(A); free(Ch); free(Af); free(Bt); free(Cf); free(scr);
}

void test_hgemm_narrow(void) {
    group_begin("16-bit widened dot and outer sums");
    lcg_t g;
    lcg_seed(&g, 5151);
    for (int h = COMERA_DT_BF16; h <= COMERA_DT_F16; h++) {
        if (!comera_hgemm_pairs(h) && comera_gemm_dot_wins_f32(8)) {
            static const int64_t WM[] = {1, 5, 6, 7, 13};
            static const int64_t WN[] = {1, 3, 8, 10};
            static const int64_t WK[] = {1, 7, 8, 9, 100};
            for (int a = 0; a < 5; a++)
                for (int b = 0; b < 4; b++)
                    for (int k = 0; k < 5; k++)
                        widened_dot_case(&g, h, WM[a], WN[b], WK[k],
                                         (a + b + k) % 2 ? h : COMERA_DT_F32);
        }
        if (comera_hgemm_outer_usable(h)) {
            static const int64_t OM[] = {1, 2, 3, 4, 5, 6, 7, 9, 13, 17};
            static const int64_t ON[] = {1, 8, 15, 16, 17, 33};
            static const int64_t OR[] = {0, 1, 2, 5, 40};
            for (int a = 0; a < 10; a++)
                for (int b = 0; b < 6; b++)
                    for (int r = 0; r < 5; r++)
                        outer_case(&g, h, (a + b + r) % 3 ? h : COMERA_DT_F32, OM[a], ON[b], OR[r]);
        } else {
            check(strcmp(comera_gemm_variant_in_use()->name, "avx2") != 0,
                  "the avx2 variant has its outer sums for %s", TNAME16(h));
        }
    }
    group_end();
}
