/* comera's float32 GEMM drivers: packing of B into 16-column panels, the
 * loop over tiles, and the unpacked loop for small products (gemm_loops.h,
 * shared with float64 in gemm_f64.c).  The float32 tiles, one per
 * instruction set, and the choice among them are in gemm_isa.c.
 */
#define REAL float
#include "common/gemm.h"
#include "common/gemm_isa.h"
#include "comera/dtype.h"
#include "common/gemm_loops.h"
#include "common/workspace.h"

#include <stdlib.h>
#include <string.h>

#define NR COMERA_GEMM_NR

int64_t comera_gemm_packed_size(int64_t K, int64_t N) {
    int64_t panels = (N + NR - 1) / NR;
    return panels * NR * (K > 0 ? K : 1);
}

void comera_gemm_pack_b_f32(int64_t K, int64_t N, const float *B,
                            int64_t rsb, int64_t csb, float *packed) {
    int64_t j_whole = csb == 1 ? N - N % NR : 0;
    /* row-major B: each row read once, front to back, its whole panels
     * copied 16 floats at a time (a panel at a time would read one strip of
     * every row, rows a power-of-two-ish stride apart) */
    for (int64_t k = 0; k < K && j_whole > 0; k++) {
        const float *src = B + k * rsb;
        for (int64_t j0 = 0; j0 < j_whole; j0 += NR)
            memcpy(packed + j0 * K + k * NR, src + j0, sizeof(float) * NR);
    }
    pack_b_strided(K, N, j_whole, B, rsb, csb, packed);
}

/* Packed B columns swept per row group: small enough that the block of B
 * stays in L2 while every row group of A passes over it, so C is written row
 * by row (contiguous) instead of one 16-column strip of every row at a time
 * (a strip of rows a power-of-two stride apart thrashes the cache sets). */
#define B_BLOCK_BYTES (160 * 1024)

void comera_gemm_tiles(int64_t M, int64_t N, int64_t K, int at, const void *A, int64_t rsa,
                       int64_t csa, const float *B, int64_t rsb, int64_t psb, void *C, int ct,
                       int64_t ldc, int mode, float *scratch) {
    if (M <= 0 || N <= 0) return;
    const comera_gemm_variant *v = comera_gemm_variant_in_use();
    int64_t esize = ct == COMERA_DT_F32 ? 4 : 2;
    int64_t panel_bytes = (K > 0 ? K : 1) * NR * (int64_t)sizeof(float);
    int64_t nc = (B_BLOCK_BYTES / panel_bytes) * NR; /* columns */
    nc -= nc % v->nr;
    if (nc < v->nr) nc = v->nr;
    for (int64_t jb = 0; jb < N; jb += nc) {
        int64_t jend = N - jb < nc ? N : jb + nc;
        for (int64_t i0 = 0; i0 < M; i0 += v->mr) {
            int mr = (int)(M - i0 < v->mr ? M - i0 : v->mr);
            const float *a = (const float *)A + i0 * rsa;
            int64_t ra = rsa, ca = csa;
            if (at != COMERA_DT_F32) {
                /* this row group of a 16-bit A in float32, K contiguous */
                const uint16_t *h = (const uint16_t *)A + i0 * rsa;
                for (int i = 0; i < mr; i++) v->widen(at, h + i * rsa, scratch + i * K, K);
                a = scratch;
                ra = K;
                ca = 1;
            }
            for (int64_t j0 = jb; j0 < jend; j0 += v->nr) {
                int nr = (int)(N - j0 < v->nr ? N - j0 : v->nr);
                v->tile(K, a, ra, ca, B + (j0 / NR) * psb, rsb, psb,
                        (char *)C + (i0 * ldc + j0) * esize, ldc, mr, nr, mode, ct);
            }
        }
    }
    if (mode == COMERA_GEMM_STREAM) comera_gemm_store_fence();
}

void comera_gemm_packed_f32(int64_t M, int64_t N, int64_t K,
                            const float *A, int64_t rsa, int64_t csa,
                            const float *Bp, float *C, int64_t ldc,
                            int accumulate) {
    comera_gemm_tiles(M, N, K, COMERA_DT_F32, A, rsa, csa, Bp, NR, (K > 0 ? K : 1) * NR, C,
                      COMERA_DT_F32, ldc, accumulate, NULL);
}

void comera_gemm_rows_f32(int64_t M, int64_t N, int64_t K, const float *A, int64_t rsa,
                          int64_t csa, const float *B, int64_t ldb, float *C, int64_t ldc,
                          int accumulate, float *tail) {
    int64_t whole = N - N % NR;
    comera_gemm_tiles(M, whole, K, COMERA_DT_F32, A, rsa, csa, B, ldb, NR, C, COMERA_DT_F32,
                      ldc, accumulate, NULL);
    if (whole == N || M <= 0) return;
    /* the last N % 16 columns: one zero-padded panel */
    pack_b_strided(K, N - whole, 0, B + whole, ldb, 1, tail);
    comera_gemm_tiles(M, N - whole, K, COMERA_DT_F32, A, rsa, csa, tail, NR, (K > 0 ? K : 1) * NR,
                      C + whole, COMERA_DT_F32, ldc, accumulate, NULL);
}

/* Below this many multiply-adds packing costs more than it saves.  Above
 * it the plain loops lose even on small products: a dot product along a
 * K of 8 or 16 per output, or a row of 8 updated once per k, runs at a
 * few multiply-adds per cycle (the one-row sequential path of
 * TTLinear(128, 512, rank=16): 35% faster with 1024 than with 4096). */
#define SMALL_GEMM 1024

int comera_gemm_f32(int64_t M, int64_t N, int64_t K,
                    const float *A, int64_t rsa, int64_t csa,
                    const float *B, int64_t rsb, int64_t csb,
                    float *C, int64_t ldc, int accumulate) {
    if (M <= 0 || N <= 0) return 0;
    if (M * N * K <= SMALL_GEMM) {
        gemm_unpacked(M, N, K, A, rsa, csa, B, rsb, csb, C, ldc, accumulate);
        return 0;
    }
    int cached = 0;
    float *packed = comera_ws_acquire(sizeof(float) * (size_t)comera_gemm_packed_size(K, N),
                                      &cached);
    if (!packed) return -3;
    comera_gemm_pack_b_f32(K, N, B, rsb, csb, packed);
    comera_gemm_packed_f32(M, N, K, A, rsa, csa, packed, C, ldc, accumulate);
    comera_ws_release(packed, cached);
    return 0;
}
