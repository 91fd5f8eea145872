/* Micro-kernels, one per instruction set, and the choice among them.
 *
 * Each variant is an explicit function compiled for its ISA with
 * __attribute__((target)), so one build runs on any x86-64 and a variant can
 * be forced (COMERA_ISA) to test it.  The AVX2 and AVX-512 tiles use FMA
 * intrinsics: the build is ISO C11, where GCC does not contract a * b + c
 * into an FMA, so the plain-C form would issue a multiply and an add.
 *
 *   avx2     6 x 16 (common/gemm_avx2.c).
 *   avx512  12 x 32: two packed panels at once, two zmm per row, 24
 *            accumulators, so each broadcast of A feeds two FMAs (with one
 *            panel, 12 x 16, the broadcasts alone kept the load ports as
 *            busy as the FMAs kept the FMA units); 8- and 4-row forms for
 *            the last rows of a product.  AVX-512F; never selected on a CPU
 *            without it.
 *   generic  6 x 16 in plain C (SSE2 on x86-64 after vectorisation).
 *   amx      the avx512 tiles for float32 and float16; bfloat16 products
 *            on AMX tiles (common/gemm_amx.c).
 *   avx512bf16  the avx512 tiles for float32 and float16; bfloat16 products
 *            on 12 x 32 VDPBF16PS tiles (each instruction a pair of
 *            products along K: twice the float32 tile's multiply-adds),
 *            for CPUs with AVX512-BF16 but no AMX.
 *
 * Every tile writes its C as float32 or, rounded in registers on the way
 * out, as bfloat16 or float16 (the 16-bit kernels' outputs: no float32
 * copy of them is ever made).  The widen functions turn 16-bit operands
 * into float32 for the float32 tiles (common/gemm_half.c).
 */
#include "common/gemm_isa.h"
#include "common/gemm.h"
#include "common/half.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <stdatomic.h>

#ifdef COMERA_X86_VARIANTS
#include <immintrin.h>
#endif

#define NR COMERA_GEMM_NR

/* Writes (or adds) the first mr x nr of a row-major tile of `width`-wide
 * rows to C of element type ct (16-bit types: rounded, never added to). */
void comera_store_partial(const float *tile, int width, int mr, int nr, void *C,
                          int64_t ldc, int accumulate, int ct) {
    for (int i = 0; i < mr; i++) {
        const float *t = tile + i * width;
        if (ct != COMERA_DT_F32) {
            uint16_t *h = (uint16_t *)C + i * ldc;
            for (int j = 0; j < nr; j++) h[j] = comera_f32_to_half(ct, t[j]);
            continue;
        }
        float *c = (float *)C + i * ldc;
        if (accumulate == COMERA_GEMM_ADD)
            for (int j = 0; j < nr; j++) c[j] += t[j];
        else
            for (int j = 0; j < nr; j++) c[j] = t[j];
    }
}

static void widen_generic(int dt, const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = comera_half_to_f32(dt, src[i]);
}

/* One panel of nr <= 16 columns from src (row stride ldb), zero-padded. */
void comera_pack_half_panel(int dt, int64_t K, int64_t nr, const uint16_t *src, int64_t ldb,
                            float *dst) {
    for (int64_t k = 0; k < K; k++) {
        int64_t j = 0;
        for (; j < nr; j++) dst[k * NR + j] = comera_half_to_f32(dt, src[k * ldb + j]);
        for (; j < NR; j++) dst[k * NR + j] = 0;
    }
}

/* Panel by panel, each written front to back (its rows are 64-byte lines
 * a K-row panel apart from the next panel's). */
static void pack_half_generic(int dt, int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                              float *packed) {
    for (int64_t j0 = 0; j0 < N; j0 += NR)
        comera_pack_half_panel(dt, K, N - j0 < NR ? N - j0 : NR, B + j0, ldb, packed + j0 * K);
}

#define GENERIC_MR 6
static void tile_generic(int64_t K, const float *A, int64_t rsa, int64_t csa,
                         const float *B, int64_t rsb, int64_t psb, void *C, int64_t ldc, int mr,
                         int nr, int accumulate, int ct) {
    (void)psb; /* one panel */
    const float *a[GENERIC_MR];
    comera_row_pointers(a, GENERIC_MR, A, rsa, mr);
    float acc[GENERIC_MR][NR];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * rsb;
        for (int i = 0; i < GENERIC_MR; i++) {
            float s = a[i][k * csa];
            for (int j = 0; j < NR; j++) acc[i][j] += s * b[j];
        }
    }
    comera_store_partial(&acc[0][0], NR, mr, nr, C, ldc, accumulate, ct);
}

#ifdef COMERA_X86_VARIANTS
/* 16 floats to 16 bfloat16 / float16 values, rounded to nearest even */
__attribute__((target("avx512f"), always_inline))
static inline __m256i avx512_narrow(__m512 v, int ct) {
    if (ct == COMERA_DT_F16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* a tile row's 16 floats at C + at (element type ct) */
__attribute__((target("avx512f"), always_inline))
static inline void avx512_put(__m512 v, void *C, int64_t at, int accumulate, int ct) {
    if (ct != COMERA_DT_F32) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)C + at), avx512_narrow(v, ct));
        return;
    }
    float *c = (float *)C + at;
    if (accumulate == COMERA_GEMM_ADD) v = _mm512_add_ps(v, _mm512_loadu_ps(c));
    _mm512_storeu_ps(c, v);
}

__attribute__((target("avx512f")))
static void widen_avx512(int dt, const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        __m512 v = dt == COMERA_DT_F16
                       ? _mm512_cvtph_ps(h)
                       : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm512_storeu_ps(dst + i, v);
    }
    for (; i < n; i++) dst[i] = comera_half_to_f32(dt, src[i]);
}

__attribute__((target("avx512f")))
static void pack_half_avx512(int dt, int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                             float *packed) {
    int64_t whole = N - N % NR;
    for (int64_t j0 = 0; j0 < whole; j0 += NR) {
        float *dst = packed + j0 * K;
        for (int64_t k = 0; k < K; k++) widen_avx512(dt, B + k * ldb + j0, dst + k * NR, NR);
    }
    if (whole < N) comera_pack_half_panel(dt, K, N - whole, B + whole, ldb, packed + whole * K);
}

#define AVX512_MR 12
/* Writes an AVX-512 tile's ROWS x PANELS accumulators, c0 (columns 0..15)
 * and c1 (16..31), to C: its first mr rows and nr columns, as float32
 * (stored, added to or streamed) or rounded to a 16-bit ct.  Always inlined
 * with constant ROWS and PANELS, so the accumulators stay in registers. */
__attribute__((target("avx512f"), always_inline))
static inline void avx512_store(int ROWS, int PANELS, __m512 *c0, __m512 *c1, void *C,
                                int64_t ldc, int mr, int nr, int accumulate, int ct) {
    /* streaming stores write whole aligned lines without reading them
     * first: a float32 row of one panel, a 16-bit row of two */
    int64_t esize = ct == COMERA_DT_F32 ? 4 : 2;
    uintptr_t rows = (uintptr_t)C | (uintptr_t)(ldc * esize);
    int stream = accumulate == COMERA_GEMM_STREAM && rows % 64 == 0;
    if (mr == ROWS && nr == PANELS * NR && stream && ct == COMERA_DT_F32) {
        float *Cf = C;
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            _mm512_stream_ps(Cf + i * ldc, c0[i]);
            if (PANELS == 2) _mm512_stream_ps(Cf + i * ldc + NR, c1[i]);
        }
        return;
    }
    if (mr == ROWS && nr == PANELS * NR && stream && PANELS == 2) {
        uint16_t *Ch = C;
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(avx512_narrow(c0[i], ct)),
                                              avx512_narrow(c1[i], ct), 1);
            _mm512_stream_si512((void *)(Ch + i * ldc), line);
        }
        return;
    }
    if (mr == ROWS && nr == PANELS * NR) {
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            avx512_put(c0[i], C, i * ldc, accumulate, ct);
            if (PANELS == 2) avx512_put(c1[i], C, i * ldc + NR, accumulate, ct);
        }
        return;
    }
    if (ct == COMERA_DT_F32) {
        /* a float32 tile's first mr rows and nr columns, by masked stores
         * (a rank of 30 makes every tile of x V and dy U^T 30 wide) */
        __mmask16 m0 = (__mmask16)(nr >= NR ? 0xffff : (1u << nr) - 1);
        __mmask16 m1 = (__mmask16)(nr >= 2 * NR ? 0xffff : nr > NR ? (1u << (nr - NR)) - 1 : 0);
        float *Cf = C;
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            if (i >= mr) break;
            float *ci = Cf + i * ldc;
            if (accumulate == COMERA_GEMM_ADD) {
                c0[i] = _mm512_add_ps(c0[i], _mm512_maskz_loadu_ps(m0, ci));
                if (PANELS == 2) c1[i] = _mm512_add_ps(c1[i], _mm512_maskz_loadu_ps(m1, ci + NR));
            }
            _mm512_mask_storeu_ps(ci, m0, c0[i]);
            if (PANELS == 2) _mm512_mask_storeu_ps(ci + NR, m1, c1[i]);
        }
        return;
    }
    float tile[AVX512_MR * 2 * NR];
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; i++) {
        _mm512_storeu_ps(tile + i * 2 * NR, c0[i]);
        if (PANELS == 2) _mm512_storeu_ps(tile + i * 2 * NR + NR, c1[i]);
    }
    comera_store_partial(tile, 2 * NR, mr, nr, C, ldc, accumulate, ct);
}

/* The AVX-512 tile for ROWS rows of A and PANELS (1 or 2) packed panels:
 * ROWS x PANELS zmm accumulators.  Always inlined with constant ROWS and
 * PANELS, so each caller below is its own fully unrolled tile. */
__attribute__((target("avx512f"), always_inline))
static inline void avx512_rows(int ROWS, int PANELS, int64_t K, const float *A, int64_t rsa,
                               int64_t csa, const float *B, int64_t rsb, int64_t psb, void *C,
                               int64_t ldc, int mr, int nr, int accumulate, int ct) {
    const float *a[AVX512_MR];
    comera_row_pointers(a, ROWS, A, rsa, mr);
    const float *B1 = B + psb;
    __m512 c0[AVX512_MR], c1[AVX512_MR];
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 b0 = _mm512_loadu_ps(B + k * rsb);
        __m512 b1 = PANELS == 2 ? _mm512_loadu_ps(B1 + k * rsb) : b0;
        int64_t o = k * csa;
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            __m512 s = _mm512_set1_ps(a[i][o]);
            c0[i] = _mm512_fmadd_ps(s, b0, c0[i]);
            if (PANELS == 2) c1[i] = _mm512_fmadd_ps(s, b1, c1[i]);
        }
    }
    avx512_store(ROWS, PANELS, c0, c1, C, ldc, mr, nr, accumulate, ct);
}

/* Up to 12 rows and 32 columns (columns 16..31 from the next panel, B +
 * 16 * K; packing pads a last partial panel with zeros).  A short tile runs
 * on 8 or 4 rows: the weight-gradient products have M = rank or rank + 1
 * rows (17 would cost 24 rows of 12-row tiles, 20 with 12 + 8). */
__attribute__((target("avx512f")))
static void tile_avx512(int64_t K, const float *A, int64_t rsa, int64_t csa,
                        const float *B, int64_t rsb, int64_t psb, void *C, int64_t ldc, int mr,
                        int nr, int accumulate, int ct) {
    int panels = nr <= NR ? 1 : 2;
    if (mr > 8) {
        if (panels == 1)
            avx512_rows(12, 1, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
        else avx512_rows(12, 2, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
    } else if (mr > 4) {
        if (panels == 1)
            avx512_rows(8, 1, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
        else avx512_rows(8, 2, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
    } else {
        if (panels == 1)
            avx512_rows(4, 1, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
        else avx512_rows(4, 2, K, A, rsa, csa, B, rsb, psb, C, ldc, mr, nr, accumulate, ct);
    }
}
#endif

#ifdef COMERA_AMX_VARIANT
/* The avx512bf16 tile for ROWS rows of A and PANELS (1 or 2) panels: A
 * bfloat16 rows (row stride lda), two consecutive elements broadcast as one
 * 32-bit lane; B packed in bfloat16 pairs (common/gemm_amx.c's layout,
 * pstride elements from a panel to the next); an odd K's last element
 * pairs with zero. */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline void dpbf16_step(int ROWS, int PANELS, int LAST, const uint16_t *const *a,
                               int64_t kk, const uint16_t *Bp, int64_t pstride, __m512 *c0,
                               __m512 *c1) {
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(Bp + kk * 32);
    __m512bh b1 = PANELS == 2 ? (__m512bh)_mm512_loadu_si512(Bp + pstride + kk * 32) : b0;
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; i++) {
        /* a whole pair is one broadcast straight from memory; an odd K's
         * last element alone */
        int32_t pair = a[i][2 * kk];
        if (!LAST) memcpy(&pair, a[i] + 2 * kk, sizeof pair);
        __m512bh s = (__m512bh)_mm512_set1_epi32(pair);
        c0[i] = _mm512_dpbf16_ps(c0[i], s, b0);
        if (PANELS == 2) c1[i] = _mm512_dpbf16_ps(c1[i], s, b1);
    }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline void dpbf16_rows(int ROWS, int PANELS, int64_t K, const uint16_t *A, int64_t lda,
                               const uint16_t *Bp, int64_t pstride, void *C, int64_t ldc, int mr,
                               int nr, int accumulate, int ct) {
    const uint16_t *a[AVX512_MR];
    for (int i = 0; i < ROWS; i++) a[i] = A + (i < mr ? i : mr - 1) * lda;
    __m512 c0[AVX512_MR], c1[AVX512_MR];
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; kk < K / 2; kk++) dpbf16_step(ROWS, PANELS, 0, a, kk, Bp, pstride, c0, c1);
    if (K % 2) dpbf16_step(ROWS, PANELS, 1, a, kk, Bp, pstride, c0, c1);
    avx512_store(ROWS, PANELS, c0, c1, C, ldc, mr, nr, accumulate, ct);
}

/* 12, 8 or 4 rows, one or two panels, as tile_avx512. */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void tile_dpbf16(int64_t K, const uint16_t *A, int64_t lda, const uint16_t *Bp,
                        int64_t pstride, void *C, int64_t ldc, int mr, int nr, int accumulate,
                        int ct) {
    int panels = nr <= NR ? 1 : 2;
    if (mr > 8) {
        if (panels == 1) dpbf16_rows(12, 1, K, A, lda, Bp, pstride, C, ldc, mr, nr, accumulate, ct);
        else dpbf16_rows(12, 2, K, A, lda, Bp, pstride, C, ldc, mr, nr, accumulate, ct);
    } else if (mr > 4) {
        if (panels == 1) dpbf16_rows(8, 1, K, A, lda, Bp, pstride, C, ldc, mr, nr, accumulate, ct);
        else dpbf16_rows(8, 2, K, A, lda, Bp, pstride, C, ldc, mr, nr, accumulate, ct);
    } else {
        if (panels == 1) dpbf16_rows(4, 1, K, A, lda, Bp, pstride, C, ldc, mr, nr, accumulate, ct);
        else dpbf16_rows(4, 2, K, A, lda, Bp, pstride, C, ldc, mr, nr, accumulate, ct);
    }
}

/* The bfloat16 product of the avx512bf16 variant (comera_pairs_gemm): row
 * groups of 12, then tiles across C.  B (a TT factor, or a row block of x
 * or dy) stays in L2 while the row groups pass. */
static void gemm_dpbf16(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                        const uint16_t *Bp, void *C, int ct, int64_t ldc, int mode) {
    int64_t pstride = comera_amx_packed_bytes(K, NR) / 2, esize = ct == COMERA_DT_F32 ? 4 : 2;
    for (int64_t i0 = 0; i0 < M; i0 += AVX512_MR) {
        int mr = (int)(M - i0 < AVX512_MR ? M - i0 : AVX512_MR);
        for (int64_t j0 = 0; j0 < N; j0 += 2 * NR) {
            int nr = (int)(N - j0 < 2 * NR ? N - j0 : 2 * NR);
            tile_dpbf16(K, A + i0 * lda, lda, Bp + (j0 / NR) * pstride, pstride,
                        (char *)C + (i0 * ldc + j0) * esize, ldc, mr, nr, mode, ct);
        }
    }
    if (mode == COMERA_GEMM_STREAM) _mm_sfence();
}
#endif

/* Best first: the automatic choice is the first one the CPU runs. */
static const comera_gemm_variant VARIANTS[] = {
#ifdef COMERA_AMX_VARIANT
    {"amx", "avx512", AVX512_MR, 2 * NR, tile_avx512, NULL, NULL, widen_avx512,
     pack_half_avx512, comera_amx_gemm, NULL},
    /* the AVX-512 dot kernel where it was measured faster: an AMD CPU */
    {"avx512bf16", "avx512", AVX512_MR, 2 * NR, tile_avx512, comera_dot_avx512_f32, NULL,
     widen_avx512, pack_half_avx512, gemm_dpbf16, NULL},
#endif
#ifdef COMERA_X86_VARIANTS
    {"avx512", "avx512", AVX512_MR, 2 * NR, tile_avx512, NULL, NULL, widen_avx512,
     pack_half_avx512, NULL, NULL},
    {"avx2", "avx2", COMERA_AVX2_MR, NR, comera_tile_avx2, comera_dot_avx2_f32,
     comera_dot_avx2_half, comera_widen_avx2, comera_pack_half_avx2, NULL, comera_outer_avx2},
#endif
    {"generic", "generic", GENERIC_MR, NR, tile_generic, NULL, NULL, widen_generic,
     pack_half_generic, NULL, NULL},
};
#define NVARIANTS ((int)(sizeof VARIANTS / sizeof VARIANTS[0]))

static int cpu_runs(const comera_gemm_variant *v) {
#ifdef COMERA_X86_VARIANTS
    __builtin_cpu_init();
    if (v->pairs == comera_amx_gemm) return comera_amx_usable();
    if (strcmp(v->name, "avx512bf16") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512bf16");
    if (strcmp(v->name, "avx512") == 0) return __builtin_cpu_supports("avx512f");
    if (strcmp(v->name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
#endif
    return strcmp(v->name, "generic") == 0;
}

/* COMERA_ISA unset, empty or "auto": the best variant the CPU runs.  A name
 * the CPU cannot run, or not built, or unknown: a warning on stderr and the
 * automatic choice (a typo must not stop a training run; tests check the
 * variant they asked for with comera_gemm_variant_name()). */
/* The automatic choice passes over avx512bf16 on Intel CPUs: there
 * VDPBF16PS issues on one port, so its pairs of products run no faster than
 * the avx512 tile's two float32 FMA ports, and its packing costs more
 * (measured on the AMX Xeon, forced: 768 -> 768 rank 30 bfloat16 15.8 ms
 * against 12.3 ms).  AMD Zen 4 and later run it at twice their float32 FMA
 * rate (not measured here). */
static int chosen_automatically(const comera_gemm_variant *v) {
#ifdef COMERA_X86_VARIANTS
    if (strcmp(v->name, "avx512bf16") == 0) return __builtin_cpu_is("amd");
#endif
    return 1;
}

static const comera_gemm_variant *choose_variant(void) {
    const comera_gemm_variant *best = &VARIANTS[NVARIANTS - 1];
    for (int i = NVARIANTS - 1; i >= 0; i--)
        if (cpu_runs(&VARIANTS[i]) && chosen_automatically(&VARIANTS[i])) best = &VARIANTS[i];
    const char *want = getenv("COMERA_ISA");
    if (!want || !*want || strcmp(want, "auto") == 0) return best;
    for (int i = 0; i < NVARIANTS; i++)
        if (strcmp(want, VARIANTS[i].name) == 0) {
            if (cpu_runs(&VARIANTS[i])) return &VARIANTS[i];
            fprintf(stderr, "comera: COMERA_ISA=%s: this CPU cannot run it; using %s%s%s\n",
                    want, best->f32, best->pairs ? " with bfloat16 on " : "",
                    best->pairs ? best->name : "");
            return best;
        }
    fprintf(stderr, "comera: COMERA_ISA=%s is not one of amx, avx512bf16, avx512, avx2, generic, "
            "auto (or not built here); using %s%s%s\n", want, best->f32,
            best->pairs ? " with bfloat16 on " : "", best->pairs ? best->name : "");
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
    return comera_gemm_variant_in_use()->f32;
}

const char *comera_gemm_variant_name(void) {
    return comera_gemm_variant_in_use()->name;
}

const char *comera_gemm_isa_for(int dtype) {
    const comera_gemm_variant *v = comera_gemm_variant_in_use();
    if (dtype == COMERA_DT_F64) return "generic";
    return dtype == COMERA_DT_BF16 ? v->name : v->f32;
}

int comera_gemm_isa_available(const char *name) {
    for (int i = 0; i < NVARIANTS; i++)
        if (strcmp(name, VARIANTS[i].name) == 0) return cpu_runs(&VARIANTS[i]);
    return 0;
}
