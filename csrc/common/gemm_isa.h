/* The float32 micro-kernel variants of common/gemm.c and the one choice among
 * them (internal to csrc).  A tile computes C[0..mr) x [0..nr) (+)= A * Bp
 * for packed 16-column panels from Bp on, mr <= the variant's rows, nr <= its
 * columns (16, or 32 for a variant that reads two adjacent panels).
 * The variant is chosen once per process (common/gemm_isa.c): the best one
 * the CPU runs, or the one COMERA_ISA names (docs/design.md section 5). */
#ifndef COMERA_GEMM_ISA_H
#define COMERA_GEMM_ISA_H

#include <stdint.h>

/* The x86 variants (avx512, avx2) are built with GCC or clang on x86-64,
 * unless COMERA_NO_CLONES asks for the generic one alone. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(COMERA_NO_CLONES)
#define COMERA_X86_VARIANTS 1
#endif

typedef void (*comera_tile_f32)(int64_t K, const float *A, int64_t rsa, int64_t csa,
                                const float *Bp, float *C, int64_t ldc, int mr, int nr,
                                int accumulate);

typedef void (*comera_dot_f32)(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                               const float *Bt, int64_t ldb, float *C, int64_t ldc,
                               float *Apack);

typedef struct comera_gemm_variant {
    const char *name; /* "avx512", "avx2" or "generic" */
    int mr;           /* rows of A per tile */
    int nr;           /* columns per tile: a multiple of COMERA_GEMM_NR */
    comera_tile_f32 tile;
    comera_dot_f32 dot; /* common/gemm_dot.c, or NULL: a plain loop, never chosen */
} comera_gemm_variant;

/* The AVX2 dot-product kernel (common/gemm_dot.c). */
void comera_dot_avx2_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Apack);

/* The variant in use; the first call decides, later calls return the same. */
const comera_gemm_variant *comera_gemm_variant_in_use(void);

#endif
