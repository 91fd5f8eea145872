/* The micro-kernel variants of common/gemm.c and common/gemm_half.c and
 * the one choice among them (internal to csrc).  A float32 tile computes
 * C[0..mr) x [0..nr) (+)= A * Bp for packed 16-column panels from Bp on,
 * mr <= the variant's rows, nr <= its columns (16, or 32 for a variant that
 * reads two adjacent panels), and writes C as float32 or, converted in
 * registers, as bfloat16 / float16 (ct, comera/dtype.h).
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

/* The AMX variant needs a compiler that knows the AMX and AVX512-BF16
 * instructions (GCC 12, clang 14); an older one builds the others. */
#if defined(COMERA_X86_VARIANTS) && \
    ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && __GNUC__ >= 12))
#define COMERA_AMX_VARIANT 1
#endif

/* B: element (k, j) of the tile's first 16 columns at B[k * rsb + j], of
 * the next 16 at B[psb + k * rsb + j]: packed panels (rsb 16, psb 16 K) or
 * a row-major B read in place (rsb its row stride, psb 16).  C has
 * elements of type ct (COMERA_DT_F32, _BF16 or _F16), ldc counted in them;
 * accumulate (COMERA_GEMM_ADD) only for float32. */
typedef void (*comera_tile_f32)(int64_t K, const float *A, int64_t rsa, int64_t csa,
                                const float *B, int64_t rsb, int64_t psb, void *C, int64_t ldc,
                                int mr, int nr, int accumulate, int ct);

/* dst[0..n) = src[0..n) widened from bfloat16 or float16 (dt) to float32. */
typedef void (*comera_widen_fn)(int dt, const uint16_t *src, float *dst, int64_t n);

/* B (K x N of type dt, row-major, row stride ldb) widened into float32
 * panels, the layout of comera_gemm_pack_b_f32. */
typedef void (*comera_pack_half_fn)(int dt, int64_t K, int64_t N, const uint16_t *B,
                                    int64_t ldb, float *packed);

typedef void (*comera_dot_f32)(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                               const float *Bt, int64_t ldb, float *C, int64_t ldc,
                               float *Apack);

/* The same dot products with A of type h (bfloat16 or float16, row stride
 * lda) widened in registers as it is read; C float32. */
typedef void (*comera_dot_half_fn)(int h, int64_t M, int64_t N, int64_t K, const uint16_t *A,
                                   int64_t lda, const float *Bt, int64_t ldb, float *C,
                                   int64_t ldc);

/* A bfloat16 product on bfloat16-pair kernels: C (M x N; float32, or
 * bfloat16 with ct) (+)= A Bp, A bfloat16 row-major (row stride lda, K
 * contiguous), Bp packed by comera_amx_pack_* (common/gemm_amx.c). */
typedef void (*comera_pairs_gemm)(int64_t M, int64_t N, int64_t K, const uint16_t *A,
                                  int64_t lda, const uint16_t *Bp, void *C, int ct, int64_t ldc,
                                  int mode);

/* C (M x N float32, row stride ldc) += A^T B over `rows` rows: A float32
 * (rows x M, row stride lda), B of type bt (bfloat16, float16 or float32;
 * rows x N, row stride ldb) widened as it is read. */
typedef void (*comera_outer_fn)(int bt, int64_t M, int64_t N, int64_t rows, const float *A,
                                int64_t lda, const void *B, int64_t ldb, float *C, int64_t ldc);

typedef struct comera_gemm_variant {
    const char *name; /* "amx", "avx512bf16", "avx512", "avx2" or "generic" */
    const char *f32;  /* the float32 tile's own name ("avx512" for amx, avx512bf16) */
    int mr;           /* rows of A per tile */
    int nr;           /* columns per tile: a multiple of COMERA_GEMM_NR */
    comera_tile_f32 tile;
    comera_dot_f32 dot; /* common/gemm_dot.c, or NULL: a plain loop, never chosen */
    /* dot with a 16-bit A read as it lies, or NULL: A widened row group by
     * row group into scratch first */
    comera_dot_half_fn dot_half;
    comera_widen_fn widen;
    comera_pack_half_fn pack_half;
    /* bfloat16 products on AMX tiles or VDPBF16PS tiles, or NULL: on the
     * float32 tile like float16 */
    comera_pairs_gemm pairs;
    /* the 16-bit weight gradients without packing their B (measured faster
     * on avx2), or NULL: packed B on the float32 tile */
    comera_outer_fn outer;
} comera_gemm_variant;

/* Helpers of the tiles (common/gemm_isa.c). */
void comera_store_partial(const float *tile, int width, int mr, int nr, void *C, int64_t ldc,
                          int accumulate, int ct);
void comera_pack_half_panel(int dt, int64_t K, int64_t nr, const uint16_t *src, int64_t ldb,
                            float *dst);

/* Rows beyond mr reuse the last valid row of A (every load stays in
 * bounds); their results are computed and dropped. */
static inline void comera_row_pointers(const float **a, int rows, const float *A, int64_t rsa,
                                       int mr) {
    for (int i = 0; i < rows; i++) a[i] = A + (i < mr ? i : mr - 1) * rsa;
}

/* The AVX2 variant (common/gemm_avx2.c). */
#define COMERA_AVX2_MR 6
void comera_tile_avx2(int64_t K, const float *A, int64_t rsa, int64_t csa, const float *B,
                      int64_t rsb, int64_t psb, void *C, int64_t ldc, int mr, int nr,
                      int accumulate, int ct);
void comera_widen_avx2(int dt, const uint16_t *src, float *dst, int64_t n);
void comera_pack_half_avx2(int dt, int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                           float *packed);
void comera_outer_avx2(int bt, int64_t M, int64_t N, int64_t rows, const float *A, int64_t lda,
                       const void *B, int64_t ldb, float *C, int64_t ldc);

/* The AVX2 and AVX-512 dot-product kernels (common/gemm_dot.c). */
void comera_dot_avx2_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Apack);
void comera_dot_avx512_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Apack);
void comera_dot_avx2_half(int h, int64_t M, int64_t N, int64_t K, const uint16_t *A,
                          int64_t lda, const float *Bt, int64_t ldb, float *C, int64_t ldc);

/* The AMX side (common/gemm_amx.c).  comera_amx_usable: the CPU has AMX-BF16
 * and AVX512-BF16 and Linux lets this process use the tile registers (asked
 * once).  comera_amx_gemm is the amx variant's comera_pairs_gemm; the
 * packing into bfloat16 pairs serves both pair kernels (docs/design.md
 * section 5). */
int comera_amx_usable(void);
int64_t comera_amx_packed_bytes(int64_t K, int64_t N);
void comera_amx_pack_f32(int64_t K, int64_t N, const float *B, int64_t rsb, int64_t csb,
                         uint16_t *packed);
void comera_amx_pack_bf16(int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                          uint16_t *packed);
void comera_amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                     const uint16_t *Bp, void *C, int ct, int64_t ldc, int mode);
/* dst[0..n) = src[0..n) rounded to bfloat16 (VCVTNE2PS2BF16). */
void comera_amx_narrow(const float *src, uint16_t *dst, int64_t n);

/* The tile loops of the products (common/gemm.c): C (M x N, element type
 * ct) = A B (or += under COMERA_GEMM_ADD) on the variant's float32 tiles,
 * B float32 seen as the tiles see it (rsb, psb: packed panels, or whole
 * panels of a row-major B in place; comera_tile_f32).  A float32 A (at
 * COMERA_DT_F32) is read in place through its strides; a 16-bit one (at
 * COMERA_DT_BF16 or _F16, row-major: csa 1) is widened a row group at a
 * time into scratch (mr x K floats). */
void comera_gemm_tiles(int64_t M, int64_t N, int64_t K, int at, const void *A, int64_t rsa,
                       int64_t csa, const float *B, int64_t rsb, int64_t psb, void *C, int ct,
                       int64_t ldc, int mode, float *scratch);

/* The variant in use; the first call decides, later calls return the same. */
const comera_gemm_variant *comera_gemm_variant_in_use(void);

#endif
