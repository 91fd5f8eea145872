/* The products of the bfloat16 and float16 kernels (internal to csrc):
 * operands of a 16-bit type h (COMERA_DT_BF16 or COMERA_DT_F16), float32
 * accumulation, outputs written as h (rounded once, in registers) or as
 * float32.  Which kernel runs them is the micro-kernel variant's choice
 * (common/gemm_isa.c): bfloat16 under amx on AMX tiles, under avx512bf16 on
 * VDPBF16PS tiles (B packed as bfloat16 pairs for both), everything else on
 * the variant's float32 tile, with A widened a row group at a time and B
 * packed as float32 panels.  Callers
 * see one packed format per h; they never make a float32 copy of a 16-bit
 * input or output.  Single-threaded, like common/gemm.h. */
#ifndef COMERA_GEMM_HALF_H
#define COMERA_GEMM_HALF_H

#include <stdint.h>

#include "comera/dtype.h"

/* 1 when products of type h run on a bfloat16-pair kernel (AMX or
 * VDPBF16PS tiles) in this process, with B packed in bfloat16 pairs. */
int comera_hgemm_pairs(int h);

/* Bytes of a K x N operand packed for products of type h. */
int64_t comera_hgemm_packed_bytes(int h, int64_t K, int64_t N);

/* Packs B for products of type h: from float32 (element (k, n) at
 * B[k * rsb + n * csb]; V, U and their transposes once per call, a block
 * of a float32 x), or from type h (row-major, row stride ldb; a block of x
 * or dy). */
void comera_hgemm_pack_f32(int h, int64_t K, int64_t N, const float *B, int64_t rsb,
                           int64_t csb, void *packed);
void comera_hgemm_pack_half(int h, int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                            void *packed);

/* Floats of per-thread scratch comera_hgemm needs for products of depth K. */
int64_t comera_hgemm_scratch(int h, int64_t K);

/* C (M x N) = A Bp, or C += A Bp for a float32 C under COMERA_GEMM_ADD.
 * A is M x K of element type at (h, or COMERA_DT_F32: a float32 x under
 * autocast), row-major (row stride lda, K contiguous); Bp was packed for h
 * with the same K and N; C has element type ct (h or COMERA_DT_F32) and
 * row stride ldc; mode is a COMERA_GEMM_* store mode (common/gemm.h;
 * STREAM for a large output).  scratch holds comera_hgemm_scratch(h, K)
 * floats. */
void comera_hgemm(int h, int64_t M, int64_t N, int64_t K, const void *A, int at, int64_t lda,
                  const void *Bp, void *C, int ct, int64_t ldc, int mode, float *scratch);

/* C (M x N, element type ct: h or float32; row stride ldc) = A Bt^T as
 * dot products along K on the variant's float32 dot kernel, for products
 * only the rank wide where comera_gemm_dot_wins_f32(N) (N <= 64): A of
 * type h (row-major, row stride lda) widened in registers as the kernel
 * reads it where the variant can (avx2), else a row group at a time into
 * scratch (comera_hgemm_scratch(h, K) floats); Bt float32 (N x K, row
 * stride ldb).  For the variants without bfloat16-pair kernels. */
void comera_hgemm_dot(int h, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                      const float *Bt, int64_t ldb, void *C, int ct, int64_t ldc,
                      float *scratch);

/* 1 when products of type h have the variant's unpacked outer-product sum
 * (comera_hgemm_outer; avx2): the weight gradients then read their block
 * of x or dy as it lies, widened in registers. */
int comera_hgemm_outer_usable(int h);

/* C (M x N float32, row stride ldc) += A^T B over `rows` rows: A float32
 * (rows x M, row stride lda), B of type bt (h or float32; rows x N, row
 * stride ldb).  Only where comera_hgemm_outer_usable(h). */
void comera_hgemm_outer(int bt, int64_t M, int64_t N, int64_t rows, const float *A, int64_t lda,
                        const void *B, int64_t ldb, float *C, int64_t ldc);

#endif
