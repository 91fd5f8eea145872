/* comera's own small GEMM: C (+)= A * B on strided row/column operands.
 *
 * The TT kernels need skinny products (one side is a TT rank, 1..~128) where
 * general BLAS libraries lose much of their speed, and the C library links no
 * BLAS.  B is packed once into 16-column panels (reused across row blocks);
 * A is read in place through (row stride, column stride), so transposed views
 * cost nothing.  All functions here are single-threaded: callers split rows
 * across OpenMP threads.  Plain C ABI, no torch headers.
 */
#ifndef COMERA_GEMM_H
#define COMERA_GEMM_H

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The micro-kernel variant in use: "amx", "avx512bf16", "avx512", "avx2" or
 * "generic".  Chosen once per process: the best the CPU runs, or the one the
 * COMERA_ISA environment variable names (those names or auto; one the CPU
 * cannot run, or an unknown name, warns on stderr and falls back to the
 * best).  amx and avx512bf16 run the avx512 tiles for float32 and float16,
 * and bfloat16 products on AMX tiles and VDPBF16PS tiles respectively. */
const char *comera_gemm_variant_name(void);

/* The float32 micro-kernel of that variant: "avx512" (also under amx and
 * avx512bf16), "avx2" or "generic". */
const char *comera_gemm_isa(void);

/* The kernel that runs products of element type dtype (COMERA_DT_*,
 * comera/dtype.h): the variant's name for bfloat16, its float32 tile's for
 * float32 and float16 (widened to float32), "generic" for float64. */
const char *comera_gemm_isa_for(int dtype);

/* 1 when the variant `name` is built in and this CPU runs it, else 0. */
int comera_gemm_isa_available(const char *name);

/* Width of a packed B panel, in columns. */
#define COMERA_GEMM_NR 16

/* Number of elements a packed copy of a K x N operand needs. */
int64_t comera_gemm_packed_size(int64_t K, int64_t N);

/* Packs B (K x N, element (k, n) at B[k * rsb + n * csb]) into panels. */
void comera_gemm_pack_b_f32(int64_t K, int64_t N, const float *B,
                            int64_t rsb, int64_t csb, float *packed);
void comera_gemm_pack_b_f64(int64_t K, int64_t N, const double *B,
                            int64_t rsb, int64_t csb, double *packed);

/* What a product does with C: overwrite it, add to it, or overwrite it with
 * streaming stores: whole 64-byte lines written without first being read
 * into the cache, which halves the memory traffic of an output far larger
 * than the cache (the float32 packed product on AVX-512 and AVX2, where C
 * and ldc are 64-byte aligned; elsewhere STREAM is STORE). */
#define COMERA_GEMM_STORE 0
#define COMERA_GEMM_ADD 1
#define COMERA_GEMM_STREAM 2

/* STREAM for an output of at least this many bytes, else STORE: a smaller
 * one may still be in cache when the next operation reads it. */
#define COMERA_GEMM_STREAM_BYTES ((int64_t)8 << 20)
static inline int comera_gemm_store_mode(int64_t bytes) {
    return bytes >= COMERA_GEMM_STREAM_BYTES ? COMERA_GEMM_STREAM : COMERA_GEMM_STORE;
}

/* dst[0..n) = src[0..n) with a product's store mode: COMERA_GEMM_STREAM
 * writes with streaming stores where dst is 16-byte aligned (x86; a row
 * copied to a large output that no one reads back soon), anything else is
 * memcpy.  After streaming copies, comera_gemm_store_fence() before the
 * data is read elsewhere. */
void comera_copy_f32(float *dst, const float *src, int64_t n, int mode);
void comera_copy_f64(double *dst, const double *src, int64_t n, int mode);

/* Orders streaming stores (COMERA_GEMM_STREAM) before what follows. */
void comera_gemm_store_fence(void);

/* C (M x N, row stride ldc) = A * Bp, or C += A * Bp when accumulate is
 * COMERA_GEMM_ADD.
 * A is M x K with element (m, k) at A[m * rsa + k * csa]; Bp was packed by
 * comera_gemm_pack_b_* with the same K and N.  K == 0 gives C = 0 (or C
 * unchanged when accumulating). */
void comera_gemm_packed_f32(int64_t M, int64_t N, int64_t K,
                            const float *A, int64_t rsa, int64_t csa,
                            const float *Bp, float *C, int64_t ldc,
                            int accumulate);
void comera_gemm_packed_f64(int64_t M, int64_t N, int64_t K,
                            const double *A, int64_t rsa, int64_t csa,
                            const double *Bp, double *C, int64_t ldc,
                            int accumulate);

/* comera_gemm_packed_f32 with B (K x N) row-major, row stride ldb, read in
 * place: for a B used once, as a row block of x or dy in the TT weight
 * gradients, where packing it would be a pass of its own.  The last N % 16
 * columns go through tail (16 K floats). */
void comera_gemm_rows_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t rsa,
                          int64_t csa, const float *B, int64_t ldb, float *C, int64_t ldc,
                          int accumulate, float *tail);
void comera_gemm_rows_f64(int64_t M, int64_t N, int64_t K, const double *A, int64_t rsa,
                          int64_t csa, const double *B, int64_t ldb, double *C, int64_t ldc,
                          int accumulate, double *tail);

/* C (M x N, row stride ldc) = A Bt^T, each element a dot product along K:
 * A is M x K and Bt is N x K, both contiguous along K (row strides lda,
 * ldb).  For products only a few columns wide, where most of a 16-column
 * packed panel would be padding.  Apack, when not NULL, receives A packed
 * as comera_gemm_pack_b_*(M, K, A, lda, 1, Apack) would write it, for a
 * later product that takes A as its B operand (on AVX2, with K a multiple
 * of 16, as the rows go by: no second pass over A). */
void comera_gemm_dot_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Apack);
void comera_gemm_dot_f64(int64_t M, int64_t N, int64_t K, const double *A, int64_t lda,
                         const double *Bt, int64_t ldb, double *C, int64_t ldc, double *Apack);

/* 1 when comera_gemm_dot_* is the faster kernel for an output N columns
 * wide on this CPU's variant (float64: never, its packed loop is the
 * reference path). */
int comera_gemm_dot_wins_f32(int64_t N);
int comera_gemm_dot_wins_f64(int64_t N);

/* Unpacked convenience form for small or one-off products: packs B into a
 * temporary when the product is large enough to pay for it.  Returns 0, or
 * -3 when the temporary cannot be allocated. */
int comera_gemm_f32(int64_t M, int64_t N, int64_t K,
                    const float *A, int64_t rsa, int64_t csa,
                    const float *B, int64_t rsb, int64_t csb,
                    float *C, int64_t ldc, int accumulate);
int comera_gemm_f64(int64_t M, int64_t N, int64_t K,
                    const double *A, int64_t rsa, int64_t csa,
                    const double *B, int64_t rsb, int64_t csb,
                    double *C, int64_t ldc, int accumulate);

#ifdef __cplusplus
}
#endif
#endif
