/* The AVX2 micro-kernel (a variant of common/gemm_isa.c, which chooses):
 * a 6 x 16 tile, 12 ymm accumulators + 2 B vectors + 1 broadcast of the 16
 * registers, enough independent FMAs to cover their latency; 4- and 2-row
 * forms for the last rows of a product; streaming stores as on AVX-512 (a
 * tile row is one whole line); masked stores for partial tiles; prefetches
 * where the hardware prefetchers fall short (comera_tile_avx2).  Compiled
 * for AVX2 with __attribute__((target)), so one build runs on any x86-64. */
#include "common/gemm_isa.h"
#include "common/gemm.h"
#include "common/half.h"
#include "common/avx2_load.h"

#ifdef COMERA_X86_VARIANTS
#include <immintrin.h>

#define NR COMERA_GEMM_NR

/* 8 floats to 8 bfloat16 / float16 values, rounded to nearest even */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m128i avx2_narrow(__m256 v, int ct) {
    if (ct == COMERA_DT_F16) return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, q, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* 32-bit lanes to 16-bit: pack within 128-bit halves, then join them */
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(p);
}

/* a tile row's 8 floats at C + at (element type ct) */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void avx2_put(__m256 v, void *C, int64_t at, int accumulate, int ct) {
    if (ct != COMERA_DT_F32) {
        _mm_storeu_si128((__m128i *)((uint16_t *)C + at), avx2_narrow(v, ct));
        return;
    }
    float *c = (float *)C + at;
    if (accumulate == COMERA_GEMM_ADD) v = _mm256_add_ps(v, _mm256_loadu_ps(c));
    _mm256_storeu_ps(c, v);
}

__attribute__((target("avx2,fma,f16c")))
void comera_widen_avx2(int dt, const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, comera_avx2_load8(dt, src, i));
    for (; i < n; i++) dst[i] = comera_half_to_f32(dt, src[i]);
}

__attribute__((target("avx2,fma,f16c")))
void comera_pack_half_avx2(int dt, int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                           float *packed) {
    int64_t whole = N - N % NR;
    for (int64_t j0 = 0; j0 < whole; j0 += NR) {
        float *dst = packed + j0 * K;
        for (int64_t k = 0; k < K; k++) comera_widen_avx2(dt, B + k * ldb + j0, dst + k * NR, NR);
    }
    if (whole < N) comera_pack_half_panel(dt, K, N - whole, B + whole, ldb, packed + whole * K);
}

/* What an AVX2 tile prefetches as it runs (comera_tile_avx2 chooses). */
#define AVX2_PF_NONE 0
#define AVX2_PF_NEXT_B 1    /* the next tile's B, B + psb, a line per step */
#define AVX2_PF_NEXT_ROWS 2 /* the next row group's A rows (csa 1) into L2 */

/* The AVX2 tile for ROWS rows of A: 2 x ROWS ymm accumulators.  Always
 * inlined with constant ROWS and PF (AVX2_PF_*), so each caller below is
 * its own fully unrolled tile. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void avx2_rows(int ROWS, int PF, int64_t K, const float *A, int64_t rsa,
                             int64_t csa, const float *B, int64_t rsb, int64_t psb, void *C,
                             int64_t ldc, int mr, int nr, int accumulate, int ct) {
    const float *a[COMERA_AVX2_MR];
    comera_row_pointers(a, ROWS, A, rsa, mr);
    __m256 c0[COMERA_AVX2_MR], c1[COMERA_AVX2_MR];
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; i++) c0[i] = c1[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 b0 = _mm256_loadu_ps(B + k * rsb), b1 = _mm256_loadu_ps(B + k * rsb + 8);
        if (PF == AVX2_PF_NEXT_B) _mm_prefetch((const char *)(B + psb + k * rsb), _MM_HINT_T0);
        /* a line of each row every 16 steps */
        if (PF == AVX2_PF_NEXT_ROWS && (k & 15) == 0)
#pragma GCC unroll 6
            for (int i = 0; i < ROWS; i++)
                _mm_prefetch((const char *)(a[i] + ROWS * rsa + k), _MM_HINT_T1);
        int64_t o = k * csa;
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; i++) {
            __m256 s = _mm256_broadcast_ss(a[i] + o);
            c0[i] = _mm256_fmadd_ps(s, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(s, b1, c1[i]);
        }
    }
    /* a float32 row of the tile is one whole 64-byte line when C and ldc
     * are aligned */
    uintptr_t rows = (uintptr_t)C | (uintptr_t)(ldc * (int64_t)sizeof(float));
    if (mr == ROWS && nr == NR && accumulate == COMERA_GEMM_STREAM && rows % 64 == 0 &&
        ct == COMERA_DT_F32) {
        float *Cf = C;
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; i++) {
            _mm256_stream_ps(Cf + i * ldc, c0[i]);
            _mm256_stream_ps(Cf + i * ldc + 8, c1[i]);
        }
        return;
    }
    if (mr == ROWS && nr == NR) {
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; i++) {
            avx2_put(c0[i], C, i * ldc, accumulate, ct);
            avx2_put(c1[i], C, i * ldc + 8, accumulate, ct);
        }
        return;
    }
    if (ct == COMERA_DT_F32) {
        /* a float32 tile's first mr rows and nr columns by masked stores
         * (a rank of 30 makes every tile of x V and dy U^T 30 wide: going
         * through a stack tile and a scalar copy cost 2-3% of the layer) */
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), lane);
        __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8), lane);
        float *Cf = C;
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; i++) {
            if (i >= mr) break;
            float *ci = Cf + i * ldc;
            if (accumulate == COMERA_GEMM_ADD) {
                c0[i] = _mm256_add_ps(c0[i], _mm256_maskload_ps(ci, m0));
                c1[i] = _mm256_add_ps(c1[i], _mm256_maskload_ps(ci + 8, m1));
            }
            _mm256_maskstore_ps(ci, m0, c0[i]);
            _mm256_maskstore_ps(ci + 8, m1, c1[i]);
        }
        return;
    }
    float tile[COMERA_AVX2_MR * NR];
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; i++) {
        _mm256_storeu_ps(tile + i * NR, c0[i]);
        _mm256_storeu_ps(tile + i * NR + 8, c1[i]);
    }
    comera_store_partial(tile, NR, mr, nr, C, ldc, accumulate, ct);
}

/* Up to 6 rows; the last rows of a product run on a 4- or 2-row form (the
 * weight-gradient products have M = rank or rank + 1 rows: 31 = 5 x 6 + 1,
 * whose last row would cost a whole 6-row tile). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void avx2_forms(int PF, int64_t K, const float *A, int64_t rsa, int64_t csa,
                              const float *B, int64_t rsb, int64_t psb, void *C, int64_t ldc,
                              int mr, int nr, int accumulate, int ct) {
    if (mr > 4) avx2_rows(6, PF, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
    else if (mr > 2) avx2_rows(4, PF, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
    else avx2_rows(2, PF, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
}

/* The prefetch a tile does as it runs:
 *  - the next tile's B into L1: the next 16 columns of a B read in place
 *    (rows of x or dy a large stride apart, which the hardware prefetchers
 *    do not follow: the x-side weight gradient ran 12-16% faster), or the
 *    next panel when it is short enough to stay in L1 until used;
 *  - in a long packed product on row-major A (x V, dy U^T), the next row
 *    group's rows into L2: the first panel's tile read its rows from
 *    memory at about the core's whole read bandwidth and the second from
 *    L2; this spreads the read over both (dy U^T at 3072 -> 768 rank 30:
 *    28% faster). */
__attribute__((target("avx2,fma,f16c")))
void comera_tile_avx2(int64_t K, const float *A, int64_t rsa, int64_t csa,
                      const float *B, int64_t rsb, int64_t psb, void *C, int64_t ldc, int mr,
                      int nr, int accumulate, int ct) {
    if (psb == NR || K <= 128)
        avx2_forms(AVX2_PF_NEXT_B, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
    else if (mr == COMERA_AVX2_MR && csa == 1)
        avx2_rows(6, AVX2_PF_NEXT_ROWS, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate,
                  ct);
    else avx2_forms(AVX2_PF_NONE, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
}
/* ---- C (M x N, float32) += A^T B summed over `rows` rows: A float32
 * (rows x M, row stride lda: the small [t 1] or S of a block), B of type
 * bt (bfloat16, float16 or float32; rows x N, row stride ldb: a block of
 * x or dy) widened 8 columns at a time as it is read, so the block needs no
 * packing pass of its own.  Groups of at most 6 rows of C by 16 columns:
 * 12 accumulators, 2 B vectors and a broadcast. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void outer_avx2_tile(int ROWS, int bt, int64_t rows, const float *A, int64_t lda,
                                   const void *B, int64_t ldb, float *C, int64_t ldc) {
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int c = 0; c < ROWS; c++) {
        lo[c] = _mm256_loadu_ps(C + c * ldc);
        hi[c] = _mm256_loadu_ps(C + c * ldc + 8);
    }
    for (int64_t i = 0; i < rows; i++) {
        __m256 b0 = comera_avx2_load8(bt, B, i * ldb), b1 = comera_avx2_load8(bt, B, i * ldb + 8);
#pragma GCC unroll 6
        for (int c = 0; c < ROWS; c++) {
            __m256 a = _mm256_broadcast_ss(A + i * lda + c);
            lo[c] = _mm256_fmadd_ps(a, b0, lo[c]);
            hi[c] = _mm256_fmadd_ps(a, b1, hi[c]);
        }
    }
#pragma GCC unroll 6
    for (int c = 0; c < ROWS; c++) {
        _mm256_storeu_ps(C + c * ldc, lo[c]);
        _mm256_storeu_ps(C + c * ldc + 8, hi[c]);
    }
}

/* One group of rc (1..6) rows of C over its whole width; the last N % 16
 * columns in plain loops. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void outer_avx2_group(int bt, int rc, int64_t N, int64_t rows, const float *A,
                                    int64_t lda, const void *B, int64_t ldb, float *C,
                                    int64_t ldc) {
    int64_t esize = bt == COMERA_DT_F32 ? 4 : 2, j = 0;
    for (; j + 16 <= N; j += 16) {
        const void *Bj = (const char *)B + j * esize;
        switch (rc) {
        case 6: outer_avx2_tile(6, bt, rows, A, lda, Bj, ldb, C + j, ldc); break;
        case 5: outer_avx2_tile(5, bt, rows, A, lda, Bj, ldb, C + j, ldc); break;
        case 4: outer_avx2_tile(4, bt, rows, A, lda, Bj, ldb, C + j, ldc); break;
        case 3: outer_avx2_tile(3, bt, rows, A, lda, Bj, ldb, C + j, ldc); break;
        case 2: outer_avx2_tile(2, bt, rows, A, lda, Bj, ldb, C + j, ldc); break;
        default: outer_avx2_tile(1, bt, rows, A, lda, Bj, ldb, C + j, ldc); break;
        }
    }
    for (int64_t i = 0; i < rows && j < N; i++)
        for (int64_t jj = j; jj < N; jj++) {
            float b = bt == COMERA_DT_F32 ? ((const float *)B)[i * ldb + jj]
                                          : comera_half_to_f32(bt, ((const uint16_t *)B)[i * ldb + jj]);
            for (int c = 0; c < rc; c++) C[c * ldc + jj] += A[i * lda + c] * b;
        }
}

__attribute__((target("avx2,fma,f16c")))
void comera_outer_avx2(int bt, int64_t M, int64_t N, int64_t rows, const float *A, int64_t lda,
                       const void *B, int64_t ldb, float *C, int64_t ldc) {
    /* row groups of at most 6, as even as possible */
    int64_t groups = (M + 5) / 6, base = M / groups, extra = M % groups, c0 = 0;
    for (int64_t g = 0; g < groups; g++) {
        int rc = (int)(g < extra ? base + 1 : base);
        if (bt == COMERA_DT_BF16)
            outer_avx2_group(COMERA_DT_BF16, rc, N, rows, A + c0, lda, B, ldb, C + c0 * ldc, ldc);
        else if (bt == COMERA_DT_F16)
            outer_avx2_group(COMERA_DT_F16, rc, N, rows, A + c0, lda, B, ldb, C + c0 * ldc, ldc);
        else
            outer_avx2_group(COMERA_DT_F32, rc, N, rows, A + c0, lda, B, ldb, C + c0 * ldc, ldc);
        c0 += rc;
    }
}
#endif
