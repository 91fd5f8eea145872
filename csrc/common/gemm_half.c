/* The drivers of the 16-bit products (common/gemm_half.h): the variant's
 * bfloat16-pair kernel for bfloat16 (AMX tiles under amx, VDPBF16PS tiles
 * under avx512bf16), else its float32 tile over widened rows of A and
 * float32 panels of B. */
#include "common/gemm_half.h"
#include "common/gemm.h"
#include "common/gemm_isa.h"
#include "common/half.h"

int comera_hgemm_pairs(int h) {
    return h == COMERA_DT_BF16 && comera_gemm_variant_in_use()->pairs != NULL;
}

int64_t comera_hgemm_packed_bytes(int h, int64_t K, int64_t N) {
    if (comera_hgemm_pairs(h)) return comera_amx_packed_bytes(K, N);
    return comera_gemm_packed_size(K, N) * (int64_t)sizeof(float);
}

void comera_hgemm_pack_f32(int h, int64_t K, int64_t N, const float *B, int64_t rsb,
                           int64_t csb, void *packed) {
    if (comera_hgemm_pairs(h)) comera_amx_pack_f32(K, N, B, rsb, csb, packed);
    else comera_gemm_pack_b_f32(K, N, B, rsb, csb, packed);
}

void comera_hgemm_pack_half(int h, int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                            void *packed) {
    if (comera_hgemm_pairs(h)) comera_amx_pack_bf16(K, N, B, ldb, packed);
    else comera_gemm_variant_in_use()->pack_half(h, K, N, B, ldb, packed);
}

/* The pair kernels: 32 rows of a float32 A rounded to bfloat16; the float32
 * tiles: a row group of A widened to float32. */
#define PAIR_ROWS 32

int64_t comera_hgemm_scratch(int h, int64_t K) {
    int64_t k = K > 0 ? K : 1;
    if (comera_hgemm_pairs(h)) return PAIR_ROWS * k / 2 + 1;
    return (int64_t)comera_gemm_variant_in_use()->mr * k;
}

void comera_hgemm(int h, int64_t M, int64_t N, int64_t K, const void *A, int at, int64_t lda,
                  const void *Bp, void *C, int ct, int64_t ldc, int mode, float *scratch) {
    if (!comera_hgemm_pairs(h)) {
        /* a float32 A is read in place, a 16-bit one widened */
        comera_gemm_tiles(M, N, K, at, A, lda, 1, Bp, COMERA_GEMM_NR,
                          (K > 0 ? K : 1) * COMERA_GEMM_NR, C, ct, ldc, mode, scratch);
        return;
    }
    comera_pairs_gemm pairs = comera_gemm_variant_in_use()->pairs;
    if (at == COMERA_DT_BF16) {
        pairs(M, N, K, A, lda, Bp, C, ct, ldc, mode);
        return;
    }
    /* a float32 A, 32 rows at a time through a bfloat16 copy */
    int64_t esize = ct == COMERA_DT_F32 ? 4 : 2;
    uint16_t *rows = (uint16_t *)scratch;
    for (int64_t i0 = 0; i0 < M; i0 += PAIR_ROWS) {
        int64_t mr = M - i0 < PAIR_ROWS ? M - i0 : PAIR_ROWS;
        for (int64_t i = 0; i < mr; i++)
            comera_amx_narrow((const float *)A + (i0 + i) * lda, rows + i * K, K);
        pairs(mr, N, K, rows, K, Bp, (char *)C + i0 * ldc * esize, ct, ldc, mode);
    }
}

void comera_hgemm_dot(int h, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                      const float *Bt, int64_t ldb, void *C, int ct, int64_t ldc,
                      float *scratch) {
    const comera_gemm_variant *v = comera_gemm_variant_in_use();
    int64_t esize = ct == COMERA_DT_F32 ? 4 : 2;
    float sums[12 * 64]; /* mr <= 12 rows of N <= 64 (comera_gemm_dot_wins_f32) */
    for (int64_t i0 = 0; i0 < M; i0 += v->mr) {
        int64_t mr = M - i0 < v->mr ? M - i0 : v->mr;
        float *out = ct == COMERA_DT_F32 ? (float *)C + i0 * ldc : sums;
        int64_t ldo = ct == COMERA_DT_F32 ? ldc : N;
        if (v->dot_half) {
            v->dot_half(h, mr, N, K, A + i0 * lda, lda, Bt, ldb, out, ldo);
        } else {
            for (int64_t i = 0; i < mr; i++) v->widen(h, A + (i0 + i) * lda, scratch + i * K, K);
            comera_gemm_dot_f32(mr, N, K, scratch, K, Bt, ldb, out, ldo, NULL);
        }
        if (ct == COMERA_DT_F32) continue;
        uint16_t *Ch = (uint16_t *)((char *)C + i0 * ldc * esize);
        for (int64_t i = 0; i < mr; i++)
            for (int64_t j = 0; j < N; j++) Ch[i * ldc + j] = comera_f32_to_half(ct, sums[i * N + j]);
    }
}

int comera_hgemm_outer_usable(int h) {
    return !comera_hgemm_pairs(h) && comera_gemm_variant_in_use()->outer != NULL;
}

void comera_hgemm_outer(int bt, int64_t M, int64_t N, int64_t rows, const float *A, int64_t lda,
                        const void *B, int64_t ldb, float *C, int64_t ldc) {
    comera_gemm_variant_in_use()->outer(bt, M, N, rows, A, lda, B, ldb, C, ldc);
}
