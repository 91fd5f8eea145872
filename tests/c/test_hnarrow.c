/* Tests of the narrow bfloat16 products (common/gemm_hnarrow.c), run once
 * per micro-kernel variant like the rest: where the variant has them
 * (avx512bf16), the dot product C = A Bt^T and the outer-product sum
 * C += A^T B against a float64 triple loop on the same bfloat16 values,
 * at sizes around their tiles (3 rows x 8 columns; 12 rows x 32 columns;
 * K in 32s; row pairs), with a float32 or bfloat16 C, a float32 B, the
 * ones column and sentinels past N that must survive; elsewhere, that the
 * variant says it has none. */
#include "reference.h"
#include "comera/dtype.h"
#include "common/gemm_hnarrow.h"
#include "common/half.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BF COMERA_DT_BF16

/* n bfloat16 values, and the same as float32 */
static void bf16_fill(lcg_t *g, uint16_t *h, float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        h[i] = comera_f32_to_half(BF, (float)lcg_uniform(g));
        f[i] = comera_half_to_f32(BF, h[i]);
    }
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
    double worst = 0.0, scale = sqrt((double)K) + 1.0;
    int untouched = 1;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < ldc; j++) {
            int64_t at = i * ldc + j;
            if (j >= N) {
                untouched &= ct == BF ? Ch[at] == 0xfbff : Cf[at] == 7.0f;
                continue;
            }
            double ref = 0.0;
            for (int64_t k = 0; k < K; k++) ref += (double)Af[i * lda + k] * Bf[j * ldb + k];
            double got = ct == BF ? comera_half_to_f32(BF, Ch[at]) : Cf[at];
            /* float32 sums; a bfloat16 C rounds once more */
            double tol = ct == BF ? 8e-3 * (fabs(ref) + 1e-30) + 1e-5 * scale : 1e-5 * scale;
            double e = fabs(got - ref);
            if (e > tol) worst = e > worst ? e : worst;
            group_note_err(e / scale);
        }
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
