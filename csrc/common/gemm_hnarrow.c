/* bfloat16 products with a narrow side, on VDPBF16PS (the avx512bf16
 * variant, common/gemm_isa.c), for the TT merge path at small ranks
 * (tt_linear/cpu_half.c):
 *
 *   dot    C = A Bt^T with N (the rank) a few columns: T = x V and
 *          S = dy U^T.  The packed pair tiles compute 16 or 32 columns
 *          for N = 8 and broadcast one A pair per multiply; here each
 *          output is a dot product along K, A and Bt read as they lie
 *          (both row-major along K, so consecutive elements are the
 *          pairs VDPBF16PS wants), 32 products per instruction, the 16
 *          partial sums of an output added once at the end.
 *   outer  C += A^T B with M (the rank, or rank + 1) a few rows: the
 *          weight gradients dV^T += S^T x and [dU; dbias] += [t 1]^T dy
 *          of a row block.  The pair tiles need B (a block of x or dy)
 *          packed in row pairs first, a pass over it; here two rows of B
 *          are loaded and interleaved in registers (VPUNPCK*WD, which
 *          pairs them within 128-bit lanes: the accumulators hold the
 *          columns in that order, put back at the store), and each
 *          column of A is broadcast as a (row, next row) pair.
 *
 * Every product accumulates in float32, as the pair tiles do.  Single-
 * threaded, like common/gemm.h.
 */
#include "common/gemm_hnarrow.h"

#include <string.h>

#include "comera/dtype.h"
#include "common/gemm_isa.h"
#include "common/half.h"

#ifdef COMERA_AMX_VARIANT
#include <immintrin.h>

/* What a dot tile prefetches as it goes: the next tile's rows of A (next),
 * and `lines` 64-byte lines of each of its own rows of another matrix P
 * (rows, stride bytes apart), which a later product of the caller reads. */
typedef struct {
    int next;
    int64_t lines;
    const char *rows;
    int64_t stride;
} hdot_prefetch;

/* ---- dot: ROWS (1..3) x COLS (1..8) outputs, K read 32 at a time; the
 * last K % 32 elements by masked loads (zeros beyond K add nothing). */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline void hdot_tile(int ROWS, int COLS, int64_t K, const uint16_t *A, int64_t lda,
                             const uint16_t *Bt, int64_t ldb, void *C, int ct, int64_t ldc,
                             const hdot_prefetch *pf) {
    __m512 acc[3][8];
    __m512bh x[3];
#pragma GCC unroll 3
    for (int i = 0; i < ROWS; i++)
#pragma GCC unroll 8
        for (int j = 0; j < COLS; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t steps = (K + 31) / 32, line = 0;
    for (int64_t k = 0, step = 1; k < K; k += 32, step++) {
        __mmask32 m = K - k >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (K - k)) - 1u);
        if (pf->next) /* the next rows of A, a line each per step */
#pragma GCC unroll 3
            for (int i = 0; i < ROWS; i++)
                _mm_prefetch((const char *)(A + (ROWS + i) * lda + k), _MM_HINT_T0);
        /* this tile's rows of P, in step with A's */
        for (int64_t end = pf->lines * step / steps; line < end; line++)
#pragma GCC unroll 3
            for (int i = 0; i < ROWS; i++)
                _mm_prefetch(pf->rows + i * pf->stride + 64 * line, _MM_HINT_T1);
#pragma GCC unroll 3
        for (int i = 0; i < ROWS; i++)
            x[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, A + i * lda + k);
#pragma GCC unroll 8
        for (int j = 0; j < COLS; j++) {
            __m512bh b = (__m512bh)_mm512_maskz_loadu_epi16(m, Bt + j * ldb + k);
#pragma GCC unroll 3
            for (int i = 0; i < ROWS; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x[i], b);
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < ROWS; i++)
#pragma GCC unroll 8
        for (int j = 0; j < COLS; j++) {
            float v = _mm512_reduce_add_ps(acc[i][j]);
            if (ct == COMERA_DT_F32) ((float *)C)[i * ldc + j] = v;
            else ((uint16_t *)C)[i * ldc + j] = comera_f32_to_half(COMERA_DT_BF16, v);
        }
}

/* One tile of rows x cols (1..3 x 1..8), each size its own unrolled copy. */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void hdot_rows(int rows, int cols, int64_t K, const uint16_t *A, int64_t lda,
                      const uint16_t *Bt, int64_t ldb, void *C, int ct, int64_t ldc,
                      const hdot_prefetch *pf) {
    switch (rows * 16 + cols) {
    case 3 * 16 + 8: hdot_tile(3, 8, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 3 * 16 + 7: hdot_tile(3, 7, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 3 * 16 + 6: hdot_tile(3, 6, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 3 * 16 + 5: hdot_tile(3, 5, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 3 * 16 + 4: hdot_tile(3, 4, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 3 * 16 + 3: hdot_tile(3, 3, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 3 * 16 + 2: hdot_tile(3, 2, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 3 * 16 + 1: hdot_tile(3, 1, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 2 * 16 + 8: hdot_tile(2, 8, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 2 * 16 + 7: hdot_tile(2, 7, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 2 * 16 + 6: hdot_tile(2, 6, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 2 * 16 + 5: hdot_tile(2, 5, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 2 * 16 + 4: hdot_tile(2, 4, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 2 * 16 + 3: hdot_tile(2, 3, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 2 * 16 + 2: hdot_tile(2, 2, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 2 * 16 + 1: hdot_tile(2, 1, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 1 * 16 + 8: hdot_tile(1, 8, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 1 * 16 + 7: hdot_tile(1, 7, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 1 * 16 + 6: hdot_tile(1, 6, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 1 * 16 + 5: hdot_tile(1, 5, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 1 * 16 + 4: hdot_tile(1, 4, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 1 * 16 + 3: hdot_tile(1, 3, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    case 1 * 16 + 2: hdot_tile(1, 2, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    default: hdot_tile(1, 1, K, A, lda, Bt, ldb, C, ct, ldc, pf); return;
    }
}

void comera_hdot_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                      const uint16_t *Bt, int64_t ldb, void *C, int ct, int64_t ldc,
                      const void *P, int64_t ldp) {
    /* column groups of at most 8, as even as possible; rows in threes */
    int64_t groups = (N + 7) / 8, base = N / groups, extra = N % groups;
    int64_t esize = ct == COMERA_DT_F32 ? 4 : 2;
    for (int64_t i = 0; i < M; i += 3) {
        int rows = M - i >= 3 ? 3 : (int)(M - i);
        int64_t j = 0;
        for (int64_t g = 0; g < groups; g++) {
            int cols = (int)(g < extra ? base + 1 : base);
            /* the first column group reads the rows from memory: it fetches
             * the next ones meanwhile, and P's rows */
            hdot_prefetch pf = {g == 0 && i + rows < M, g == 0 && P ? (ldp + 63) / 64 : 0,
                                P ? (const char *)P + i * ldp : NULL, ldp};
            hdot_rows(rows, cols, K, A + i * lda, lda, Bt + j * ldb, ldb,
                      (char *)C + (i * ldc + j) * esize, ct, ldc, &pf);
            j += cols;
        }
    }
}

/* ---- outer: C rows [c0, c0 + ROWS) (ROWS <= 12) by 32 columns from j0
 * (the last chunk masked), over all the block's rows in pairs. */

/* 32 elements of row i of B from column j as bfloat16 (a float32 B
 * rounded to nearest even, as the pair packing rounds it); zeros past nc. */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline __m512i outer_load(int bt, const void *B, int64_t off, int nc) {
    __mmask32 m = nc >= 32 ? (__mmask32)~0u : (__mmask32)((1u << nc) - 1u);
    if (bt != COMERA_DT_F32) return _mm512_maskz_loadu_epi16(m, (const uint16_t *)B + off);
    const float *f = (const float *)B + off;
    __m512 lo = _mm512_maskz_loadu_ps((__mmask16)m, f);
    __m512 hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), f + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline void outer_tile(int ROWS, int64_t rows, const uint32_t *Ap, int64_t M, int bt,
                              const void *B, int64_t ldb, int nc, float *C, int64_t ldc) {
    __m512 lo[12], hi[12];
#pragma GCC unroll 12
    for (int c = 0; c < ROWS; c++) lo[c] = hi[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; i += 2) {
        __m512i r0 = outer_load(bt, B, i * ldb, nc);
        __m512i r1 = i + 1 < rows ? outer_load(bt, B, (i + 1) * ldb, nc) : _mm512_setzero_si512();
        /* (row i, row i + 1) pairs: columns 0-3, 8-11, 16-19, 24-27 in
         * lo's order, 4-7, 12-15, 20-23, 28-31 in hi's */
        __m512bh plo = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
        __m512bh phi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        const uint32_t *a = Ap + (i / 2) * M;
#pragma GCC unroll 12
        for (int c = 0; c < ROWS; c++) {
            __m512bh s = (__m512bh)_mm512_set1_epi32((int)a[c]);
            lo[c] = _mm512_dpbf16_ps(lo[c], s, plo);
            hi[c] = _mm512_dpbf16_ps(hi[c], s, phi);
        }
    }
    /* back to column order: lane q of lo holds columns 8q..8q+3, of hi 8q+4..8q+7 */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11,
                                            10, 9, 8);
    __mmask16 m0 = nc >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1u);
    __mmask16 m1 = nc <= 16 ? 0 : nc >= 32 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nc - 16)) - 1u);
#pragma GCC unroll 12
    for (int c = 0; c < ROWS; c++) {
        float *row = C + c * ldc;
        __m512 v0 = _mm512_permutex2var_ps(lo[c], first, hi[c]);
        __m512 v1 = _mm512_permutex2var_ps(lo[c], second, hi[c]);
        _mm512_mask_storeu_ps(row, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, row), v0));
        if (m1) _mm512_mask_storeu_ps(row + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, row + 16), v1));
    }
}

__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void outer_rows(int rows_c, int64_t rows, const uint32_t *Ap, int64_t M, int bt,
                       const void *B, int64_t ldb, int nc, float *C, int64_t ldc) {
    switch (rows_c) {
    case 12: outer_tile(12, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 11: outer_tile(11, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 10: outer_tile(10, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 9: outer_tile(9, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 8: outer_tile(8, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 7: outer_tile(7, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 6: outer_tile(6, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 5: outer_tile(5, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 4: outer_tile(4, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 3: outer_tile(3, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    case 2: outer_tile(2, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    default: outer_tile(1, rows, Ap, M, bt, B, ldb, nc, C, ldc); return;
    }
}

void comera_houter_bf16(int64_t M, int64_t N, int64_t rows, const uint32_t *Ap, int bt,
                        const void *B, int64_t ldb, float *C, int64_t ldc) {
    /* row groups of at most 12 (24 accumulators), as even as possible */
    int64_t groups = (M + 11) / 12, base = M / groups, extra = M % groups;
    int64_t esize = bt == COMERA_DT_F32 ? 4 : 2;
    int64_t c0 = 0;
    for (int64_t g = 0; g < groups; g++) {
        int rc = (int)(g < extra ? base + 1 : base);
        for (int64_t j = 0; j < N; j += 32) {
            int nc = N - j >= 32 ? 32 : (int)(N - j);
            outer_rows(rc, rows, Ap + c0, M, bt, (const char *)B + j * esize, ldb, nc,
                       C + c0 * ldc + j, ldc);
        }
        c0 += rc;
    }
}
#else
void comera_hdot_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                      const uint16_t *Bt, int64_t ldb, void *C, int ct, int64_t ldc,
                      const void *P, int64_t ldp) {
    (void)M, (void)N, (void)K, (void)A, (void)lda, (void)Bt, (void)ldb, (void)C, (void)ct,
        (void)ldc, (void)P, (void)ldp;
}

void comera_houter_bf16(int64_t M, int64_t N, int64_t rows, const uint32_t *Ap, int bt,
                        const void *B, int64_t ldb, float *C, int64_t ldc) {
    (void)M, (void)N, (void)rows, (void)Ap, (void)bt, (void)B, (void)ldb, (void)C, (void)ldc;
}
#endif

/* A (rows x M, bfloat16, row stride lda) as the outer product's pairs:
 * Ap[(i / 2) * M + c] = (A[i][c], A[i + 1][c]), the last odd row paired
 * with zero; or the ones column at c = ones (-1: none). */
void comera_houter_pairs(int64_t rows, int64_t M, const uint16_t *A, int64_t lda, int64_t ones,
                         uint32_t *Ap) {
    const uint16_t one = comera_f32_to_half(COMERA_DT_BF16, 1.0f);
    for (int64_t i = 0; i < rows; i += 2)
        for (int64_t c = 0; c < M; c++) {
            uint16_t a0 = c == ones ? one : A[i * lda + c];
            uint16_t a1 = i + 1 >= rows ? 0 : c == ones ? one : A[(i + 1) * lda + c];
            Ap[(i / 2) * M + c] = (uint32_t)a0 | ((uint32_t)a1 << 16);
        }
}

int comera_hnarrow_usable(int h) {
    const comera_gemm_variant *v = comera_gemm_variant_in_use();
    return h == COMERA_DT_BF16 && strcmp(v->name, "avx512bf16") == 0;
}
