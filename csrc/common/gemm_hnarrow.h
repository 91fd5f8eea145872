/* bfloat16 products with a narrow side on VDPBF16PS (common/gemm_hnarrow.c;
 * internal to csrc).  Callers ask comera_hnarrow_usable first: the kernels
 * exist only in the avx512bf16 variant. */
#ifndef COMERA_GEMM_HNARROW_H
#define COMERA_GEMM_HNARROW_H

#include <stdint.h>

/* 1 when the kernels below run products of type h in this process. */
int comera_hnarrow_usable(int h);

/* C (M x N, float32 or bfloat16 by ct, row stride ldc) = A Bt^T: A is
 * M x K and Bt N x K, bfloat16, both contiguous along K (row strides lda,
 * ldb).  For N a few columns (the TT rank).  P, when not NULL: M rows
 * of ldp bytes each (a block of x) fetched into L2 as A's rows go by, for
 * a later product. */
void comera_hdot_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                      const uint16_t *Bt, int64_t ldb, void *C, int ct, int64_t ldc,
                      const void *P, int64_t ldp);

/* Ap for comera_houter_bf16 from A (rows x M, bfloat16, row stride lda):
 * rows paired, ((rows + 1) / 2) * M words; column `ones` (or none: -1)
 * reads as ones. */
void comera_houter_pairs(int64_t rows, int64_t M, const uint16_t *A, int64_t lda, int64_t ones,
                         uint32_t *Ap);

/* C (M x N float32, row stride ldc) += A^T B over `rows` rows, A given as
 * its pairs Ap, B rows x N of type bt (bfloat16, or float32 rounded to
 * bfloat16 as it is read), row stride ldb.  For M a few rows (the TT rank,
 * or rank + 1 with the ones column of the bias gradient). */
void comera_houter_bf16(int64_t M, int64_t N, int64_t rows, const uint32_t *Ap, int bt,
                        const void *B, int64_t ldb, float *C, int64_t ldc);

#endif
