/* C = A Bt^T as dot products along K, for products with a few columns.
 *
 * The TT merge path has two products whose output width is the middle TT
 * rank (T = x V and S = dy U^T: N = r, K = 768..3072).  The packed kernel
 * computes 16-column panels, so at r = 8 or 10 most of its multiply-adds
 * fall on padding (measured on a 2-core AVX2 EPYC: 20-23 GFLOP/s of useful
 * work at r = 10 against 34-36 at r = 30).  Here each output is a dot
 * product: both operands are read along K in 8-float vectors, every
 * multiply-add is useful, and the 8 partial sums of an output are added
 * once at the end.  A tile is 3 rows of A by up to 4 rows of Bt: 12
 * accumulators, 7 loads per 12 multiply-adds (2 x 5 tiles, 7 loads per
 * 10, ran at 21-28 GFLOP/s where 3 x 4 ran at 26-33, same machine).
 * Wider tiles on 16-float vectors serve the avx512bf16 variant (an AMD
 * CPU; common/gemm_isa.c), one loop nest (dot_drive) for both.  The AVX2
 * tiles also take a bfloat16 or float16 A, widened in registers: the 16-bit
 * layer's x V and dy U^T then read x and dy from memory while the products
 * run (a widening pass into scratch first stalled on memory; AVX2 on the
 * AVX-512 EPYC, 768 -> 768 rank 8, 4096 rows: bfloat16 forward 2.4 -> 2.0
 * ms, backward 3.9-4.2 -> 3.4-3.8 ms).
 */
#include "common/gemm.h"
#include "common/gemm_isa.h"
#include "comera/dtype.h"
#include "common/avx2_load.h"

#ifdef COMERA_X86_VARIANTS
#include <immintrin.h>
#endif

static void dot_plain_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                          const float *Bt, int64_t ldb, float *C, int64_t ldc) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += A[i * lda + k] * Bt[j * ldb + k];
            C[i * ldc + j] = s;
        }
}

#ifdef COMERA_X86_VARIANTS
__attribute__((target("avx2,fma")))
static float dot_avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The last n < 8 elements of a row of A (type at) from element k on,
 * zeros past them; nothing past the end is touched. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 dot_avx2_load_tail(int at, const void *A, int64_t k, int64_t n, __m256i m) {
    if (at == COMERA_DT_F32) return _mm256_maskload_ps((const float *)A + k, m);
    uint16_t part[8] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = ((const uint16_t *)A)[k + i];
    return comera_avx2_load8(at, part, 0);
}

/* ROWS (1..3) x COLS (1..4) outputs; inlined with constant sizes (and
 * element type at of A), so every caller below is its own fully unrolled
 * tile.  A 16-bit A is widened as it is read, so its rows come from memory
 * while the products run (a separate widening pass would wait for them).
 * The last K % 8 elements are read masked (nothing past the end is
 * touched).  With Ap (float32 A, K a multiple of 16), the A rows loaded are
 * also stored there in 16-column panels `panel` floats apart (the packed-B
 * layout). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void dot_avx2_tile(int at, int ROWS, int COLS, int64_t K, const void *A,
                                 int64_t lda, const float *Bt, int64_t ldb, float *C,
                                 int64_t ldc, float *Ap, int64_t panel, int next) {
    __m256 acc[3][4];
#pragma GCC unroll 3
    for (int i = 0; i < ROWS; i++)
#pragma GCC unroll 4
        for (int j = 0; j < COLS; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t es = at == COMERA_DT_F32 ? 4 : 2, row = lda * es; /* bytes */
    const char *a0 = (const char *)A, *a1 = a0 + (ROWS >= 2 ? row : 0);
    const char *a2 = a0 + (ROWS == 3 ? 2 * row : 0);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        /* with next: the next row triple into L2, a line of each row
         * every 16 columns (past the last row too: a prefetch never
         * faults) */
        if (next && (k & 15) == 0)
#pragma GCC unroll 3
            for (int i = 0; i < 3; i++)
                _mm_prefetch(a0 + (3 + i) * row + k * es, _MM_HINT_T1);
        __m256 x0 = comera_avx2_load8(at, a0, k), x1 = comera_avx2_load8(at, a1, k);
        __m256 x2 = comera_avx2_load8(at, a2, k);
        if (Ap) {
            float *p = Ap + (k >> 4) * panel + (k & 15);
            _mm256_storeu_ps(p, x0);
            if (ROWS >= 2) _mm256_storeu_ps(p + 16, x1);
            if (ROWS == 3) _mm256_storeu_ps(p + 32, x2);
        }
#pragma GCC unroll 4
        for (int j = 0; j < COLS; j++) {
            __m256 b = _mm256_loadu_ps(Bt + j * ldb + k);
            acc[0][j] = _mm256_fmadd_ps(x0, b, acc[0][j]);
            if (ROWS >= 2) acc[1][j] = _mm256_fmadd_ps(x1, b, acc[1][j]);
            if (ROWS == 3) acc[2][j] = _mm256_fmadd_ps(x2, b, acc[2][j]);
        }
    }
    if (k < K) {
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K - k)), lane);
        __m256 x0 = dot_avx2_load_tail(at, a0, k, K - k, m);
        __m256 x1 = dot_avx2_load_tail(at, a1, k, K - k, m);
        __m256 x2 = dot_avx2_load_tail(at, a2, k, K - k, m);
#pragma GCC unroll 4
        for (int j = 0; j < COLS; j++) {
            __m256 b = _mm256_maskload_ps(Bt + j * ldb + k, m);
            acc[0][j] = _mm256_fmadd_ps(x0, b, acc[0][j]);
            if (ROWS >= 2) acc[1][j] = _mm256_fmadd_ps(x1, b, acc[1][j]);
            if (ROWS == 3) acc[2][j] = _mm256_fmadd_ps(x2, b, acc[2][j]);
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < ROWS; i++)
#pragma GCC unroll 4
        for (int j = 0; j < COLS; j++) C[i * ldc + j] = dot_avx2_hsum(acc[i][j]);
}

/* One instance per tile size and element type of A, so each is unrolled
 * with constant sizes. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void dot_avx2_rows(int at, int rows, int cols, int64_t K, const void *A,
                                 int64_t lda, const float *Bt, int64_t ldb, float *C,
                                 int64_t ldc, float *Ap, int64_t panel, int next) {
    switch (rows * 8 + cols) {
    case 3 * 8 + 4: dot_avx2_tile(at, 3, 4, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 3 * 8 + 3: dot_avx2_tile(at, 3, 3, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 3 * 8 + 2: dot_avx2_tile(at, 3, 2, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 3 * 8 + 1: dot_avx2_tile(at, 3, 1, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 4: dot_avx2_tile(at, 2, 4, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 3: dot_avx2_tile(at, 2, 3, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 2: dot_avx2_tile(at, 2, 2, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 1: dot_avx2_tile(at, 2, 1, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 1 * 8 + 4: dot_avx2_tile(at, 1, 4, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 1 * 8 + 3: dot_avx2_tile(at, 1, 3, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 1 * 8 + 2: dot_avx2_tile(at, 1, 2, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    default: dot_avx2_tile(at, 1, 1, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    }
}

__attribute__((target("avx2,fma,f16c")))
static void dot_avx2_rows_f32(int rows, int cols, int64_t K, const void *A, int64_t lda,
                              const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Ap,
                              int64_t panel, int next) {
    dot_avx2_rows(COMERA_DT_F32, rows, cols, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next);
}

__attribute__((target("avx2,fma,f16c")))
static void dot_avx2_rows_bf16(int rows, int cols, int64_t K, const void *A, int64_t lda,
                               const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Ap,
                               int64_t panel, int next) {
    dot_avx2_rows(COMERA_DT_BF16, rows, cols, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next);
}

__attribute__((target("avx2,fma,f16c")))
static void dot_avx2_rows_f16(int rows, int cols, int64_t K, const void *A, int64_t lda,
                              const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Ap,
                              int64_t panel, int next) {
    dot_avx2_rows(COMERA_DT_F16, rows, cols, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next);
}

/* One tile of ROWS x COLS outputs (dot_*_rows): the ISA's own, called
 * through this type by the loops of dot_drive. */
typedef void (*dot_rows_fn)(int rows, int cols, int64_t K, const void *A, int64_t lda,
                            const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Ap,
                            int64_t panel, int next);

/* Groups of tile_rows rows outside, column groups inside: the A rows are
 * read from memory once and from cache for their other column groups.
 * Groups of at most tile_cols columns, as even as possible (AVX2, 4 wide:
 * 10 = 4 + 3 + 3 rather than 4 + 4 + 2, whose 2-wide tile has too few
 * independent sums to hide the multiply-add latency).  The first group
 * packs A (float32) when asked.  A's elements are esize bytes. */
static void dot_drive(dot_rows_fn rows_fn, int tile_rows, int tile_cols, int64_t max_k_next,
                      int64_t M, int64_t N, int64_t K, const void *A, int64_t lda,
                      int64_t esize, const float *Bt, int64_t ldb, float *C, int64_t ldc,
                      float *Apack) {
    int64_t groups = (N + tile_cols - 1) / tile_cols, base = N / groups, extra = N % groups;
    int fuse = Apack && K % 16 == 0;
    for (int64_t i = 0; i < M; i += tile_rows) {
        int rows = M - i >= tile_rows ? tile_rows : (int)(M - i);
        int64_t j = 0;
        for (int64_t g = 0; g < groups; g++) {
            int cols = (int)(g < extra ? base + 1 : base);
            float *ap = fuse && g == 0 ? Apack + i * 16 : NULL;
            /* the first column group reads the rows from memory, the
             * others from cache: up to K = max_k_next those fetch the next
             * triple meanwhile, spreading that read over them (AVX2 EPYC:
             * x V and dy U^T at rank 8, K = 768, 17-25% faster; at K = 3072
             * 4% slower, where the hardware streams of the long rows were
             * doing well; AVX-512 EPYC: dy U^T at rank 10, K = 3072, faster
             * too) */
            int next = g > 0 && rows == tile_rows && K <= max_k_next;
            rows_fn(rows, cols, K, (const char *)A + i * lda * esize, lda, Bt + j * ldb, ldb,
                    C + i * ldc + j, ldc, ap, 16 * M, next);
            j += cols;
        }
    }
    if (Apack && !fuse) comera_gemm_pack_b_f32(M, K, (const float *)A, lda, 1, Apack);
}

void comera_dot_avx2_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Apack) {
    dot_drive(dot_avx2_rows_f32, 3, 4, 1024, M, N, K, A, lda, 4, Bt, ldb, C, ldc, Apack);
}

void comera_dot_avx2_half(int h, int64_t M, int64_t N, int64_t K, const uint16_t *A,
                          int64_t lda, const float *Bt, int64_t ldb, float *C, int64_t ldc) {
    dot_drive(h == COMERA_DT_F16 ? dot_avx2_rows_f16 : dot_avx2_rows_bf16, 3, 4, 1024, M, N, K,
              A, lda, 2, Bt, ldb, C, ldc, NULL);
}

/* Tiles of up to 4 rows of A by 5 rows of Bt on 16-float vectors (32
 * registers: 20 accumulators, 9 loads per 20 multiply-adds; on the
 * AVX-512 EPYC dy U^T at rank 10 ran 3-5% faster than with the AVX2
 * shape of 3 x 4), the K % 16 tail with a masked load, A stored into its
 * 16-column panels whole (K a multiple of 16). */
__attribute__((target("avx512f"), always_inline))
static inline void dot_avx512_tile(int ROWS, int COLS, int64_t K, const float *A, int64_t lda,
                                   const float *Bt, int64_t ldb, float *C, int64_t ldc,
                                   float *Ap, int64_t panel, int next) {
    __m512 acc[4][5], x[4];
    const float *a[4];
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; i++) {
        a[i] = A + i * lda;
#pragma GCC unroll 5
        for (int j = 0; j < COLS; j++) acc[i][j] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (next) /* the next rows into L2 (dot_avx2_tile) */
#pragma GCC unroll 4
            for (int i = 0; i < ROWS; i++)
                _mm_prefetch((const char *)(A + (ROWS + i) * lda + k), _MM_HINT_T1);
#pragma GCC unroll 4
        for (int i = 0; i < ROWS; i++) x[i] = _mm512_loadu_ps(a[i] + k);
        if (Ap)
#pragma GCC unroll 4
            for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(Ap + (k >> 4) * panel + 16 * i, x[i]);
#pragma GCC unroll 5
        for (int j = 0; j < COLS; j++) {
            __m512 b = _mm512_loadu_ps(Bt + j * ldb + k);
#pragma GCC unroll 4
            for (int i = 0; i < ROWS; i++) acc[i][j] = _mm512_fmadd_ps(x[i], b, acc[i][j]);
        }
    }
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
#pragma GCC unroll 4
        for (int i = 0; i < ROWS; i++) x[i] = _mm512_maskz_loadu_ps(m, a[i] + k);
#pragma GCC unroll 5
        for (int j = 0; j < COLS; j++) {
            __m512 b = _mm512_maskz_loadu_ps(m, Bt + j * ldb + k);
#pragma GCC unroll 4
            for (int i = 0; i < ROWS; i++) acc[i][j] = _mm512_fmadd_ps(x[i], b, acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; i++)
#pragma GCC unroll 5
        for (int j = 0; j < COLS; j++) C[i * ldc + j] = _mm512_reduce_add_ps(acc[i][j]);
}

__attribute__((target("avx512f")))
static void dot_avx512_rows(int rows, int cols, int64_t K, const void *Av, int64_t lda,
                            const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Ap,
                            int64_t panel, int next) {
    const float *A = (const float *)Av; /* float32 only */
    switch (rows * 8 + cols) {
    case 4 * 8 + 5: dot_avx512_tile(4, 5, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 4 * 8 + 4: dot_avx512_tile(4, 4, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 4 * 8 + 3: dot_avx512_tile(4, 3, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 4 * 8 + 2: dot_avx512_tile(4, 2, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 4 * 8 + 1: dot_avx512_tile(4, 1, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 3 * 8 + 5: dot_avx512_tile(3, 5, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 3 * 8 + 4: dot_avx512_tile(3, 4, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 3 * 8 + 3: dot_avx512_tile(3, 3, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 3 * 8 + 2: dot_avx512_tile(3, 2, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 3 * 8 + 1: dot_avx512_tile(3, 1, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 5: dot_avx512_tile(2, 5, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 4: dot_avx512_tile(2, 4, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 3: dot_avx512_tile(2, 3, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 2: dot_avx512_tile(2, 2, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 2 * 8 + 1: dot_avx512_tile(2, 1, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 1 * 8 + 5: dot_avx512_tile(1, 5, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 1 * 8 + 4: dot_avx512_tile(1, 4, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 1 * 8 + 3: dot_avx512_tile(1, 3, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    case 1 * 8 + 2: dot_avx512_tile(1, 2, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    default: dot_avx512_tile(1, 1, K, A, lda, Bt, ldb, C, ldc, Ap, panel, next); return;
    }
}

void comera_dot_avx512_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Apack) {
    dot_drive(dot_avx512_rows, 4, 5, INT64_MAX, M, N, K, A, lda, 4, Bt, ldb, C, ldc, Apack);
}
#endif

/* Where the packed tiles would waste 15% or more of their multiply-adds on
 * padding, up to N = 64.  Measured (AVX2 EPYC, K = 768 and 3072, 4096
 * rows): N = 8 1.5-1.6x faster, 10 1.2-1.4x, 12 1.1x, 20 1.4x, 24 1.2x,
 * 40 1.1x, 52 1.1x; N = 14, 30 and 44 even, N = 16 and 64 slower. */
int comera_gemm_dot_wins_f32(int64_t N) {
    const comera_gemm_variant *v = comera_gemm_variant_in_use();
    /* a tile narrower than its variant's width computes 16-column panels */
    int64_t padded = (N + COMERA_GEMM_NR - 1) / COMERA_GEMM_NR * COMERA_GEMM_NR;
    return v->dot != NULL && N > 0 && N <= 64 && N * 100 < 85 * padded;
}

int comera_gemm_dot_wins_f64(int64_t N) {
    (void)N;
    return 0;
}

void comera_gemm_dot_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *Bt, int64_t ldb, float *C, int64_t ldc, float *Apack) {
    if (M <= 0 || N <= 0) return;
    const comera_gemm_variant *v = comera_gemm_variant_in_use();
    if (v->dot) {
        v->dot(M, N, K, A, lda, Bt, ldb, C, ldc, Apack);
        return;
    }
    dot_plain_f32(M, N, K, A, lda, Bt, ldb, C, ldc);
    if (Apack) comera_gemm_pack_b_f32(M, K, A, lda, 1, Apack);
}

void comera_gemm_dot_f64(int64_t M, int64_t N, int64_t K, const double *A, int64_t lda,
                         const double *Bt, int64_t ldb, double *C, int64_t ldc, double *Apack) {
    if (M <= 0 || N <= 0) return;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0.0;
            for (int64_t k = 0; k < K; k++) s += A[i * lda + k] * Bt[j * ldb + k];
            C[i * ldc + j] = s;
        }
    if (Apack) comera_gemm_pack_b_f64(M, K, A, lda, 1, Apack);
}
