/* float32 micro-kernels, one per instruction set, and the choice among them.
 *
 * Each variant is an explicit function compiled for its ISA with
 * __attribute__((target)), so one build runs on any x86-64 and a variant can
 * be forced (COMERA_ISA) to test it.  The AVX2 and AVX-512 tiles use FMA
 * intrinsics: the build is ISO C11, where GCC does not contract a * b + c
 * into an FMA, so the plain-C form would issue a multiply and an add.
 *
 *   avx2     6 x 16: 12 ymm accumulators + 2 B vectors + 1 broadcast of 16
 *            registers, enough independent FMAs to cover their latency;
 *            4- and 2-row forms for the last rows of a product; streaming
 *            stores as on AVX-512 (a tile row is one whole line).
 *   avx512  12 x 32: two packed panels at once, two zmm per row, 24
 *            accumulators, so each broadcast of A feeds two FMAs (with one
 *            panel, 12 x 16, the broadcasts alone kept the load ports as
 *            busy as the FMAs kept the FMA units); 8- and 4-row forms for
 *            the last rows of a product.  AVX-512F; never selected on a CPU
 *            without it.
 *   generic  6 x 16 in plain C (SSE2 on x86-64 after vectorisation).
 */
#include "common/gemm_isa.h"
#include "common/gemm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <stdatomic.h>

#ifdef COMERA_X86_VARIANTS
#include <immintrin.h>
#endif

#define NR COMERA_GEMM_NR

/* Writes (or adds) the first mr x nr of a row-major tile of `width`-wide rows. */
static void store_partial(const float *tile, int width, int mr, int nr, float *C,
                          int64_t ldc, int accumulate) {
    for (int i = 0; i < mr; i++) {
        float *c = C + i * ldc;
        const float *t = tile + i * width;
        if (accumulate == COMERA_GEMM_ADD)
            for (int j = 0; j < nr; j++) c[j] += t[j];
        else
            for (int j = 0; j < nr; j++) c[j] = t[j];
    }
}

/* Rows beyond mr reuse the last valid row of A (every load stays in
 * bounds); their results are computed and dropped. */
static void row_pointers(const float **a, int rows, const float *A, int64_t rsa, int mr) {
    for (int i = 0; i < rows; i++) a[i] = A + (i < mr ? i : mr - 1) * rsa;
}

#define GENERIC_MR 6
static void tile_generic(int64_t K, const float *A, int64_t rsa, int64_t csa,
                         const float *Bp, float *C, int64_t ldc, int mr, int nr,
                         int accumulate) {
    const float *a[GENERIC_MR];
    row_pointers(a, GENERIC_MR, A, rsa, mr);
    float acc[GENERIC_MR][NR];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < K; k++) {
        const float *b = Bp + k * NR;
        for (int i = 0; i < GENERIC_MR; i++) {
            float s = a[i][k * csa];
            for (int j = 0; j < NR; j++) acc[i][j] += s * b[j];
        }
    }
    store_partial(&acc[0][0], NR, mr, nr, C, ldc, accumulate);
}

#ifdef COMERA_X86_VARIANTS
#define AVX2_MR 6
/* The AVX2 tile for ROWS rows of A: 2 x ROWS ymm accumulators.  Always
 * inlined with constant ROWS, so each caller below is its own fully
 * unrolled tile. */
__attribute__((target("avx2,fma"), always_inline))
static inline void avx2_rows(int ROWS, int64_t K, const float *A, int64_t rsa, int64_t csa,
                             const float *Bp, float *C, int64_t ldc, int mr, int nr,
                             int accumulate) {
    const float *a[AVX2_MR];
    row_pointers(a, ROWS, A, rsa, mr);
    __m256 c0[AVX2_MR], c1[AVX2_MR];
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; i++) c0[i] = c1[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 b0 = _mm256_loadu_ps(Bp + k * NR), b1 = _mm256_loadu_ps(Bp + k * NR + 8);
        int64_t o = k * csa;
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; i++) {
            __m256 s = _mm256_broadcast_ss(a[i] + o);
            c0[i] = _mm256_fmadd_ps(s, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(s, b1, c1[i]);
        }
    }
    /* a row of the tile is one whole 64-byte line when C and ldc are aligned */
    uintptr_t rows = (uintptr_t)C | (uintptr_t)(ldc * (int64_t)sizeof(float));
    if (mr == ROWS && nr == NR && accumulate == COMERA_GEMM_STREAM && rows % 64 == 0) {
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; i++) {
            _mm256_stream_ps(C + i * ldc, c0[i]);
            _mm256_stream_ps(C + i * ldc + 8, c1[i]);
        }
        return;
    }
    if (mr == ROWS && nr == NR) {
#pragma GCC unroll 6
        for (int i = 0; i < ROWS; i++) {
            float *c = C + i * ldc;
            if (accumulate == COMERA_GEMM_ADD) {
                c0[i] = _mm256_add_ps(c0[i], _mm256_loadu_ps(c));
                c1[i] = _mm256_add_ps(c1[i], _mm256_loadu_ps(c + 8));
            }
            _mm256_storeu_ps(c, c0[i]);
            _mm256_storeu_ps(c + 8, c1[i]);
        }
        return;
    }
    float tile[AVX2_MR * NR];
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; i++) {
        _mm256_storeu_ps(tile + i * NR, c0[i]);
        _mm256_storeu_ps(tile + i * NR + 8, c1[i]);
    }
    store_partial(tile, NR, mr, nr, C, ldc, accumulate);
}

/* Up to 6 rows; the last rows of a product run on a 4- or 2-row form (the
 * weight-gradient products have M = rank or rank + 1 rows: 31 = 5 x 6 + 1,
 * whose last row would cost a whole 6-row tile). */
__attribute__((target("avx2,fma")))
static void tile_avx2(int64_t K, const float *A, int64_t rsa, int64_t csa,
                      const float *Bp, float *C, int64_t ldc, int mr, int nr,
                      int accumulate) {
    if (mr > 4) avx2_rows(6, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
    else if (mr > 2) avx2_rows(4, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
    else avx2_rows(2, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
}

#define AVX512_MR 12
/* The AVX-512 tile for ROWS rows of A and PANELS (1 or 2) packed panels:
 * ROWS x PANELS zmm accumulators.  Always inlined with constant ROWS and
 * PANELS, so each caller below is its own fully unrolled tile. */
__attribute__((target("avx512f"), always_inline))
static inline void avx512_rows(int ROWS, int PANELS, int64_t K, const float *A, int64_t rsa,
                               int64_t csa, const float *Bp, float *C, int64_t ldc, int mr,
                               int nr, int accumulate) {
    const float *a[AVX512_MR];
    row_pointers(a, ROWS, A, rsa, mr);
    const float *B1 = Bp + K * NR;
    __m512 c0[AVX512_MR], c1[AVX512_MR];
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 b0 = _mm512_loadu_ps(Bp + k * NR);
        __m512 b1 = PANELS == 2 ? _mm512_loadu_ps(B1 + k * NR) : b0;
        int64_t o = k * csa;
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            __m512 s = _mm512_set1_ps(a[i][o]);
            c0[i] = _mm512_fmadd_ps(s, b0, c0[i]);
            if (PANELS == 2) c1[i] = _mm512_fmadd_ps(s, b1, c1[i]);
        }
    }
    /* streaming stores write whole aligned lines without reading them first */
    uintptr_t rows = (uintptr_t)C | (uintptr_t)(ldc * (int64_t)sizeof(float));
    int stream = accumulate == COMERA_GEMM_STREAM && rows % 64 == 0;
    if (mr == ROWS && nr == PANELS * NR && stream) {
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            _mm512_stream_ps(C + i * ldc, c0[i]);
            if (PANELS == 2) _mm512_stream_ps(C + i * ldc + NR, c1[i]);
        }
        return;
    }
    if (mr == ROWS && nr == PANELS * NR) {
        int add = accumulate == COMERA_GEMM_ADD;
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            float *ci = C + i * ldc;
            if (add) c0[i] = _mm512_add_ps(c0[i], _mm512_loadu_ps(ci));
            _mm512_storeu_ps(ci, c0[i]);
            if (PANELS == 1) continue;
            if (add) c1[i] = _mm512_add_ps(c1[i], _mm512_loadu_ps(ci + NR));
            _mm512_storeu_ps(ci + NR, c1[i]);
        }
        return;
    }
    float tile[AVX512_MR * 2 * NR];
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; i++) {
        _mm512_storeu_ps(tile + i * 2 * NR, c0[i]);
        if (PANELS == 2) _mm512_storeu_ps(tile + i * 2 * NR + NR, c1[i]);
    }
    store_partial(tile, 2 * NR, mr, nr, C, ldc, accumulate);
}

/* Up to 12 rows and 32 columns (columns 16..31 from the next panel, Bp +
 * 16 * K; packing pads a last partial panel with zeros).  A short tile runs
 * on 8 or 4 rows: the weight-gradient products have M = rank or rank + 1
 * rows (17 would cost 24 rows of 12-row tiles, 20 with 12 + 8). */
__attribute__((target("avx512f")))
static void tile_avx512(int64_t K, const float *A, int64_t rsa, int64_t csa,
                        const float *Bp, float *C, int64_t ldc, int mr, int nr,
                        int accumulate) {
    int panels = nr <= NR ? 1 : 2;
    if (mr > 8) {
        if (panels == 1) avx512_rows(12, 1, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
        else avx512_rows(12, 2, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
    } else if (mr > 4) {
        if (panels == 1) avx512_rows(8, 1, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
        else avx512_rows(8, 2, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
    } else {
        if (panels == 1) avx512_rows(4, 1, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
        else avx512_rows(4, 2, K, A, rsa, csa, Bp, C, ldc, mr, nr, accumulate);
    }
}
#endif

/* Best first: the automatic choice is the first one the CPU runs. */
static const comera_gemm_variant VARIANTS[] = {
#ifdef COMERA_X86_VARIANTS
    {"avx512", AVX512_MR, 2 * NR, tile_avx512, NULL},
    {"avx2", AVX2_MR, NR, tile_avx2, comera_dot_avx2_f32},
#endif
    {"generic", GENERIC_MR, NR, tile_generic, NULL},
};
#define NVARIANTS ((int)(sizeof VARIANTS / sizeof VARIANTS[0]))

static int cpu_runs(const comera_gemm_variant *v) {
#ifdef COMERA_X86_VARIANTS
    __builtin_cpu_init();
    if (strcmp(v->name, "avx512") == 0) return __builtin_cpu_supports("avx512f");
    if (strcmp(v->name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return strcmp(v->name, "generic") == 0;
}

/* COMERA_ISA unset, empty or "auto": the best variant the CPU runs.  A name
 * the CPU cannot run, or not built, or unknown: a warning on stderr and the
 * automatic choice (a typo must not stop a training run; tests check the
 * variant they asked for with comera_gemm_isa()). */
static const comera_gemm_variant *choose_variant(void) {
    const comera_gemm_variant *best = &VARIANTS[NVARIANTS - 1];
    for (int i = NVARIANTS - 1; i >= 0; i--)
        if (cpu_runs(&VARIANTS[i])) best = &VARIANTS[i];
    const char *want = getenv("COMERA_ISA");
    if (!want || !*want || strcmp(want, "auto") == 0) return best;
    for (int i = 0; i < NVARIANTS; i++)
        if (strcmp(want, VARIANTS[i].name) == 0) {
            if (cpu_runs(&VARIANTS[i])) return &VARIANTS[i];
            fprintf(stderr, "comera: COMERA_ISA=%s: this CPU cannot run it; using %s\n",
                    want, best->name);
            return best;
        }
    fprintf(stderr, "comera: COMERA_ISA=%s is not one of avx512, avx2, generic, auto "
            "(or not built here); using %s\n", want, best->name);
    return best;
}

/* The choice, made once per process: the first caller chooses (so a warning
 * prints once), any other caller meanwhile waits for it.  C11 atomics rather
 * than pthread_once, whose symbol newer glibc versions GLIBC_2.34: that
 * would lift the wheel's platform tag above manylinux_2_28 (setup.py). */
static _Atomic(const comera_gemm_variant *) in_use;
static atomic_int choosing;

const comera_gemm_variant *comera_gemm_variant_in_use(void) {
    const comera_gemm_variant *v = atomic_load_explicit(&in_use, memory_order_acquire);
    if (v) return v;
    int expected = 0;
    if (atomic_compare_exchange_strong(&choosing, &expected, 1)) {
        v = choose_variant();
        atomic_store_explicit(&in_use, v, memory_order_release);
        return v;
    }
    while (!(v = atomic_load_explicit(&in_use, memory_order_acquire))) sched_yield();
    return v;
}

void comera_gemm_store_fence(void) {
#ifdef COMERA_X86_VARIANTS
    _mm_sfence();
#endif
}

void comera_copy_f32(float *dst, const float *src, int64_t n, int mode) {
#ifdef COMERA_X86_VARIANTS
    if (mode == COMERA_GEMM_STREAM && (uintptr_t)dst % 16 == 0) {
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
        for (; i < n; i++) dst[i] = src[i];
        return;
    }
#endif
    (void)mode;
    if (n > 0) memcpy(dst, src, sizeof(float) * (size_t)n);
}

/* float64 is the reference path: a plain copy. */
void comera_copy_f64(double *dst, const double *src, int64_t n, int mode) {
    (void)mode;
    if (n > 0) memcpy(dst, src, sizeof(double) * (size_t)n);
}

const char *comera_gemm_isa(void) {
    return comera_gemm_variant_in_use()->name;
}

int comera_gemm_isa_available(const char *name) {
    for (int i = 0; i < NVARIANTS; i++)
        if (strcmp(name, VARIANTS[i].name) == 0) return cpu_runs(&VARIANTS[i]);
    return 0;
}
