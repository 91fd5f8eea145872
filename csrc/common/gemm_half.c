/* The drivers of the 16-bit products (common/gemm_half.h): the AMX kernel
 * for bfloat16 under the amx variant (common/gemm_amx.c), else the
 * variant's float32 tile over widened rows of A and float32 panels of B. */
#include "common/gemm_half.h"
#include "common/gemm.h"
#include "common/gemm_isa.h"

int comera_hgemm_amx(int h) {
    return h == COMERA_DT_BF16 && comera_gemm_variant_in_use()->amx;
}

int64_t comera_hgemm_packed_bytes(int h, int64_t K, int64_t N) {
    if (comera_hgemm_amx(h)) return comera_amx_packed_bytes(K, N);
    return comera_gemm_packed_size(K, N) * (int64_t)sizeof(float);
}

void comera_hgemm_pack_f32(int h, int64_t K, int64_t N, const float *B, int64_t rsb,
                           int64_t csb, void *packed) {
    if (comera_hgemm_amx(h)) comera_amx_pack_f32(K, N, B, rsb, csb, packed);
    else comera_gemm_pack_b_f32(K, N, B, rsb, csb, packed);
}

void comera_hgemm_pack_half(int h, int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                            void *packed) {
    if (comera_hgemm_amx(h)) comera_amx_pack_bf16(K, N, B, ldb, packed);
    else comera_gemm_variant_in_use()->pack_half(h, K, N, B, ldb, packed);
}

int64_t comera_hgemm_scratch(int h, int64_t K) {
    if (comera_hgemm_amx(h)) return 0;
    return (int64_t)comera_gemm_variant_in_use()->mr * (K > 0 ? K : 1);
}

void comera_hgemm(int h, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                  const void *Bp, void *C, int ct, int64_t ldc, int mode, float *scratch) {
    if (comera_hgemm_amx(h)) comera_amx_gemm(M, N, K, A, lda, Bp, C, ct, ldc, mode);
    else comera_gemm_tiles(M, N, K, h, A, lda, 1, Bp, C, ct, ldc, mode, scratch);
}
