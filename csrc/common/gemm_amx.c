/* bfloat16 products on AMX tiles (Intel Sapphire Rapids and later): the
 * large products of the bfloat16 kernels under the amx variant
 * (common/gemm_isa.c, docs/design.md section 5).
 *
 *   C tile    16 x 16 float32 accumulators; a block of C is 32 x 32, four
 *             tiles, so each A and B tile loaded feeds two TDPBF16PS.
 *   A         bfloat16, row-major, read in place by TILELOADD with its row
 *             stride (x and dy straight from the caller; the last K % 32
 *             columns go through a zero-padded copy).
 *   B         packed once (or per row block) in 16-column panels of
 *             bfloat16 pairs: row kk of a panel holds (B[2kk][j],
 *             B[2kk + 1][j]) for its 16 columns j, the layout TDPBF16PS
 *             reads; K is padded with zeros to a multiple of 32.
 *   C out     float32 tiles stored straight to a float32 C (or loaded
 *             from it to accumulate); for a bfloat16 C the tiles go through
 *             a 4 KB float32 buffer and are rounded by VCVTNE2PS2BF16 (round
 *             to nearest even; like every AVX512-BF16 conversion it takes
 *             float32 subnormals as zero).
 *
 * Linux hands out the tile registers only on request
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), made once per
 * process by comera_amx_usable.  Every product loads its tile
 * configuration and releases the tiles at its end, so a thread holds no
 * tile state between products (none to save at a context switch).
 */
#define _DEFAULT_SOURCE /* syscall() under -std=c11 */
#include "common/gemm_isa.h"
#include "common/gemm.h"
#include "common/half.h"

#include <stdatomic.h>
#include <string.h>

#ifdef COMERA_AMX_VARIANT
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* K padded to whole 32-element tile chunks (at least one). */
static int64_t amx_kpad(int64_t K) {
    return K <= 32 ? 32 : (K + 31) / 32 * 32;
}

/* Rows in groups of AMX_PACK_ROWS, each group across all columns before
 * the next: the group's rows are read front to back, a few streams the
 * hardware prefetcher follows (a block of x comes from memory), and each
 * panel gets AMX_PACK_ROWS / 2 consecutive 64-byte rows at a time. */
#define AMX_PACK_ROWS 8

int64_t comera_amx_packed_bytes(int64_t K, int64_t N) {
    int64_t panels = (N + COMERA_GEMM_NR - 1) / COMERA_GEMM_NR;
    return panels * amx_kpad(K) * COMERA_GEMM_NR * 2;
}

/* 0 not yet asked, 1 usable, 2 not */
static atomic_int amx_state;

int comera_amx_usable(void) {
    int st = atomic_load(&amx_state);
    if (st) return st == 1;
    __builtin_cpu_init();
    int cpu = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
              __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
    int ok = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    atomic_store(&amx_state, ok ? 1 : 2);
    return ok;
}

__attribute__((target("avx512f,avx512bw,avx512bf16")))
void comera_amx_narrow(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
        _mm512_storeu_si512(dst + i, (__m512i)h);
    }
    for (; i < n; i++) dst[i] = comera_f32_to_bf16(src[i]);
}

/* Row-major float32 B (a block of a float32 x): rows k and k + 1, 16
 * columns at a time, rounded together and interleaved into one panel row. */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void amx_pack_f32_rows(int64_t K, int64_t N, const float *B, int64_t ldb,
                              uint16_t *packed) {
    int64_t Kp = amx_kpad(K), pstride = Kp * COMERA_GEMM_NR;
    /* cvtne2ps gives a0..a15 b0..b15; the panel row wants a0 b0 a1 b1 ... */
    uint16_t idx[32];
    for (int n = 0; n < 16; n++) {
        idx[2 * n] = (uint16_t)n;
        idx[2 * n + 1] = (uint16_t)(16 + n);
    }
    __m512i pairs = _mm512_loadu_si512(idx);
    /* row groups across all columns, as in comera_amx_pack_bf16 */
    for (int64_t k0 = 0; k0 < Kp; k0 += AMX_PACK_ROWS)
        for (int64_t j = 0; j < N; j += COMERA_GEMM_NR) {
            int64_t n = N - j < COMERA_GEMM_NR ? N - j : COMERA_GEMM_NR;
            __mmask16 m = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1);
            uint16_t *panel = packed + (j / COMERA_GEMM_NR) * pstride;
            for (int64_t k = k0; k < k0 + AMX_PACK_ROWS; k += 2) {
                __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
                if (k < K) a = _mm512_maskz_loadu_ps(m, B + k * ldb + j);
                if (k + 1 < K) b = _mm512_maskz_loadu_ps(m, B + (k + 1) * ldb + j);
                __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);
                _mm512_storeu_si512(panel + k * 16, _mm512_permutexvar_epi16(pairs, ab));
            }
        }
}

void comera_amx_pack_f32(int64_t K, int64_t N, const float *B, int64_t rsb, int64_t csb,
                         uint16_t *packed) {
    if (csb == 1) {
        amx_pack_f32_rows(K, N, B, rsb, packed);
        return;
    }
    int64_t Kp = amx_kpad(K), pstride = Kp * COMERA_GEMM_NR;
    for (int64_t j0 = 0; j0 < N; j0 += COMERA_GEMM_NR) {
        uint16_t *panel = packed + (j0 / COMERA_GEMM_NR) * pstride;
        for (int64_t k = 0; k < Kp; k++)
            for (int64_t n = 0; n < COMERA_GEMM_NR; n++) {
                int64_t j = j0 + n;
                float v = k < K && j < N ? B[k * rsb + j * csb] : 0.0f;
                panel[(k / 2) * 32 + n * 2 + k % 2] = comera_f32_to_bf16(v);
            }
    }
}

__attribute__((target("avx512f,avx512bw")))
void comera_amx_pack_bf16(int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                          uint16_t *packed) {
    int64_t Kp = amx_kpad(K), pstride = Kp * COMERA_GEMM_NR;
    /* interleave row k (a) and row k + 1 (b): a0 b0 a1 b1 ... */
    uint16_t lo_idx[32], hi_idx[32];
    for (int n = 0; n < 16; n++) {
        lo_idx[2 * n] = (uint16_t)n;
        lo_idx[2 * n + 1] = (uint16_t)(32 + n);
        hi_idx[2 * n] = (uint16_t)(16 + n);
        hi_idx[2 * n + 1] = (uint16_t)(48 + n);
    }
    __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_loadu_si512(hi_idx);
    for (int64_t k0 = 0; k0 < Kp; k0 += AMX_PACK_ROWS)
        for (int64_t j = 0; j < N; j += 32) {
            int64_t n = N - j < 32 ? N - j : 32;
            __mmask32 m = n == 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1);
            uint16_t *p0 = packed + (j / COMERA_GEMM_NR) * pstride, *p1 = p0 + pstride;
            for (int64_t k = k0; k < k0 + AMX_PACK_ROWS; k += 2) {
                __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
                if (k < K) a = _mm512_maskz_loadu_epi16(m, B + k * ldb + j);
                if (k + 1 < K) b = _mm512_maskz_loadu_epi16(m, B + (k + 1) * ldb + j);
                _mm512_storeu_si512(p0 + k * 16, _mm512_permutex2var_epi16(a, lo, b));
                if (n > 16) _mm512_storeu_si512(p1 + k * 16, _mm512_permutex2var_epi16(a, hi, b));
            }
        }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0, 1: C rows 0..15 (panels j, j + 1); 2, 3: C rows 16..31; 4, 5:
 * A rows 0..15, 16..31; 6, 7: B panels j, j + 1.  rows0 + rows1 rows of C
 * and A (a tile of no rows is left unconfigured and unused). */
__attribute__((target("amx-tile")))
static void amx_configure(int rows0, int rows1) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&c);
}

/* The tile instructions are asm statements that do not tell the compiler
 * which memory they touch: order them against plain loads and stores. */
#define AMX_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

/* Writes rows x cols of the 32 x 32 float32 buffer to C (element type ct):
 * float32 stored or added, bfloat16 rounded; under COMERA_GEMM_STREAM whole
 * aligned 64-byte lines are streamed (a float32 dx under autocast, a
 * bfloat16 y or dx). */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void amx_put(const float *buf, int rows, int cols, void *C, int ct, int64_t ldc,
                    int mode) {
    __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xffff : (1u << cols) - 1);
    __mmask16 m1 = (__mmask16)(cols >= 32 ? 0xffff : cols > 16 ? (1u << (cols - 16)) - 1 : 0);
    uintptr_t lines = (uintptr_t)C | (uintptr_t)(ldc * (ct == COMERA_DT_F32 ? 4 : 2));
    int stream = mode == COMERA_GEMM_STREAM && cols == 32 && lines % 64 == 0;
    if (ct == COMERA_DT_F32) {
        for (int i = 0; i < rows; i++) {
            float *c = (float *)C + i * ldc;
            __m512 v0 = _mm512_load_ps(buf + i * 32), v1 = _mm512_load_ps(buf + i * 32 + 16);
            if (stream) {
                _mm512_stream_ps(c, v0);
                _mm512_stream_ps(c + 16, v1);
                continue;
            }
            if (mode == COMERA_GEMM_ADD) {
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, c));
                v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, c + 16));
            }
            _mm512_mask_storeu_ps(c, m0, v0);
            _mm512_mask_storeu_ps(c + 16, m1, v1);
        }
        return;
    }
    __mmask32 m = cols >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << cols) - 1);
    for (int i = 0; i < rows; i++) {
        uint16_t *c = (uint16_t *)C + i * ldc;
        __m512bh h = _mm512_cvtne2ps_pbh(_mm512_load_ps(buf + i * 32 + 16),
                                         _mm512_load_ps(buf + i * 32));
        if (stream) _mm512_stream_si512((void *)c, (__m512i)h);
        else _mm512_mask_storeu_epi16(c, m, (__m512i)h);
    }
}

/* The K steps of one 32 x 32 block of C: A rows 0..15 from a0 (16..31
 * from a1 when two_rows) with row stride sa bytes, B panels from b0 (and
 * b1 when two_cols), `chunks` chunks of 32 K each. */
__attribute__((target("amx-tile,amx-bf16"), always_inline))
static inline void amx_steps(const uint16_t *a0, const uint16_t *a1, int64_t sa,
                             const uint16_t *b0, const uint16_t *b1, int64_t chunks,
                             int two_rows, int two_cols) {
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(4, a0 + c * 32, sa);
        if (two_rows) _tile_loadd(5, a1 + c * 32, sa);
        _tile_loadd(6, b0 + c * 512, 64);
        if (two_cols) _tile_loadd(7, b1 + c * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) _tile_dpbf16ps(1, 4, 7);
        if (two_rows) _tile_dpbf16ps(2, 5, 6);
        if (two_rows && two_cols) _tile_dpbf16ps(3, 5, 7);
    }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
void comera_amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                     const uint16_t *Bp, void *C, int ct, int64_t ldc, int mode) {
    if (M <= 0 || N <= 0) return;
    int64_t pstride = amx_kpad(K) * COMERA_GEMM_NR, full = K / 32, tail = K % 32;
    int64_t sa = lda * 2, esize = ct == COMERA_DT_F32 ? 4 : 2;
    uint16_t atail[32 * 32] __attribute__((aligned(64)));
    float buf[32 * 32] __attribute__((aligned(64)));
    int shape = -1;
    for (int64_t i0 = 0; i0 < M; i0 += 32) {
        int rows = M - i0 < 32 ? (int)(M - i0) : 32;
        int rows0 = rows < 16 ? rows : 16, two_rows = rows > 16;
        if (rows != shape) {
            amx_configure(rows0, rows - rows0);
            shape = rows;
        }
        const uint16_t *a0 = A + i0 * lda, *a1 = a0 + 16 * lda;
        if (tail) {
            /* the last K % 32 columns, zero-padded to a whole chunk */
            memset(atail, 0, sizeof atail);
            for (int i = 0; i < rows; i++)
                memcpy(atail + i * 32, a0 + i * lda + full * 32, sizeof(uint16_t) * (size_t)tail);
            AMX_MEMORY_BARRIER();
        }
        for (int64_t j0 = 0; j0 < N; j0 += 32) {
            int cols = N - j0 < 32 ? (int)(N - j0) : 32, two_cols = cols > 16;
            const uint16_t *b0 = Bp + (j0 / COMERA_GEMM_NR) * pstride, *b1 = b0 + pstride;
            /* float32 whole tiles go to and from C itself (but streamed ones) */
            int direct = ct == COMERA_DT_F32 && cols % 16 == 0 && mode != COMERA_GEMM_STREAM;
            char *c0 = (char *)C + (i0 * ldc + j0) * esize, *c1 = c0 + 16 * ldc * esize;
            int64_t sc = ldc * 4;
            if (direct && mode == COMERA_GEMM_ADD) {
                AMX_MEMORY_BARRIER();
                _tile_loadd(0, c0, sc);
                if (two_cols) _tile_loadd(1, c0 + 64, sc);
                if (two_rows) _tile_loadd(2, c1, sc);
                if (two_rows && two_cols) _tile_loadd(3, c1 + 64, sc);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                if (two_rows) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
            }
            amx_steps(a0, a1, sa, b0, b1, full, two_rows, two_cols);
            if (tail)
                amx_steps(atail, atail + 16 * 32, 64, b0 + full * 512, b1 + full * 512, 1,
                          two_rows, two_cols);
            AMX_MEMORY_BARRIER();
            if (direct) {
                _tile_stored(0, c0, sc);
                if (two_cols) _tile_stored(1, c0 + 64, sc);
                if (two_rows) _tile_stored(2, c1, sc);
                if (two_rows && two_cols) _tile_stored(3, c1 + 64, sc);
                AMX_MEMORY_BARRIER();
                continue;
            }
            _tile_stored(0, buf, 128);
            _tile_stored(1, buf + 16, 128);
            if (two_rows) {
                _tile_stored(2, buf + 16 * 32, 128);
                _tile_stored(3, buf + 16 * 32 + 16, 128);
            }
            AMX_MEMORY_BARRIER();
            amx_put(buf, rows, cols, c0, ct, ldc, mode);
        }
    }
    _tile_release();
    if (mode == COMERA_GEMM_STREAM) _mm_sfence();
}

#else /* a build without the AMX variant: never usable, never called */

int comera_amx_usable(void) {
    return 0;
}

/* Rows in groups of AMX_PACK_ROWS, each group across all columns before
 * the next: the group's rows are read front to back, a few streams the
 * hardware prefetcher follows (a block of x comes from memory), and each
 * panel gets AMX_PACK_ROWS / 2 consecutive 64-byte rows at a time. */
#define AMX_PACK_ROWS 8

int64_t comera_amx_packed_bytes(int64_t K, int64_t N) {
    (void)K;
    (void)N;
    return 0;
}

void comera_amx_pack_f32(int64_t K, int64_t N, const float *B, int64_t rsb, int64_t csb,
                         uint16_t *packed) {
    (void)K; (void)N; (void)B; (void)rsb; (void)csb; (void)packed;
}

void comera_amx_pack_bf16(int64_t K, int64_t N, const uint16_t *B, int64_t ldb,
                          uint16_t *packed) {
    (void)K; (void)N; (void)B; (void)ldb; (void)packed;
}

void comera_amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                     const uint16_t *Bp, void *C, int ct, int64_t ldc, int mode) {
    (void)M; (void)N; (void)K; (void)A; (void)lda; (void)Bp; (void)C; (void)ct; (void)ldc;
    (void)mode;
}

void comera_amx_narrow(const float *src, uint16_t *dst, int64_t n) {
    (void)src; (void)dst; (void)n;
}
#endif
