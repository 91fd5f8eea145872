/* Register-blocked GEMM micro-kernel (6 rows x 16 columns of accumulators).
 *
 * 6 x 16 floats is 12 AVX2 registers of accumulators, leaving room for two B
 * vectors and one broadcast A value: the classic shape that keeps both FMA
 * pipes busy on AVX2.  The kernel is compiled three times (AVX-512, AVX2+FMA,
 * baseline x86-64) and the loader picks the best one for the running CPU, so
 * one build is fast here and still runs on older machines.
 */
#include "common/gemm.h"

#include <stdlib.h>
#include <string.h>

#define MR 6
#define NR COMERA_GEMM_NR

typedef float v8f __attribute__((vector_size(32), aligned(4)));

#if defined(__x86_64__) && !defined(COMERA_NO_CLONES)
#define COMERA_CLONES \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define COMERA_CLONES
#endif

int64_t comera_gemm_packed_size(int64_t K, int64_t N) {
    int64_t panels = (N + NR - 1) / NR;
    return panels * NR * (K > 0 ? K : 1);
}

void comera_gemm_pack_b_f32(int64_t K, int64_t N, const float *B,
                            int64_t rsb, int64_t csb, float *packed) {
    for (int64_t j0 = 0; j0 < N; j0 += NR) {
        int64_t nr = N - j0 < NR ? N - j0 : NR;
        float *dst = packed + j0 * K;
        for (int64_t k = 0; k < K; k++) {
            const float *src = B + k * rsb + j0 * csb;
            int64_t j = 0;
            for (; j < nr; j++) dst[k * NR + j] = src[j * csb];
            for (; j < NR; j++) dst[k * NR + j] = 0.0f;
        }
    }
}

void comera_gemm_pack_b_f64(int64_t K, int64_t N, const double *B,
                            int64_t rsb, int64_t csb, double *packed) {
    for (int64_t j0 = 0; j0 < N; j0 += NR) {
        int64_t nr = N - j0 < NR ? N - j0 : NR;
        double *dst = packed + j0 * K;
        for (int64_t k = 0; k < K; k++) {
            const double *src = B + k * rsb + j0 * csb;
            int64_t j = 0;
            for (; j < nr; j++) dst[k * NR + j] = src[j * csb];
            for (; j < NR; j++) dst[k * NR + j] = 0.0;
        }
    }
}

/* One MR x NR tile: rows beyond mr reuse the last valid row of A (so every
 * load is in bounds) and are simply not stored. */
COMERA_CLONES
static void kernel_f32(int64_t K, const float *A, int64_t rsa, int64_t csa,
                       const float *Bp, int64_t ldb, float *C, int64_t ldc, int mr,
                       int nr, int accumulate) {
    const float *a[MR];
    for (int i = 0; i < MR; i++) a[i] = A + (i < mr ? i : mr - 1) * rsa;
    v8f c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    v8f c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    for (int64_t k = 0; k < K; k++) {
        v8f b0, b1;
        memcpy(&b0, Bp + k * ldb, sizeof b0);
        memcpy(&b1, Bp + k * ldb + 8, sizeof b1);
        int64_t o = k * csa;
        float s;
        s = a[0][o]; c00 += s * b0; c01 += s * b1;
        s = a[1][o]; c10 += s * b0; c11 += s * b1;
        s = a[2][o]; c20 += s * b0; c21 += s * b1;
        s = a[3][o]; c30 += s * b0; c31 += s * b1;
        s = a[4][o]; c40 += s * b0; c41 += s * b1;
        s = a[5][o]; c50 += s * b0; c51 += s * b1;
    }
    v8f acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                      {c30, c31}, {c40, c41}, {c50, c51}};
    if (nr == NR) {
        for (int i = 0; i < mr; i++) {
            float *c = C + i * ldc;
            if (accumulate) {
                v8f o0, o1;
                memcpy(&o0, c, sizeof o0);
                memcpy(&o1, c + 8, sizeof o1);
                acc[i][0] += o0;
                acc[i][1] += o1;
            }
            memcpy(c, &acc[i][0], sizeof acc[i][0]);
            memcpy(c + 8, &acc[i][1], sizeof acc[i][1]);
        }
        return;
    }
    float tile[MR][NR];
    memcpy(tile, acc, sizeof tile);
    for (int i = 0; i < mr; i++) {
        float *c = C + i * ldc;
        if (accumulate)
            for (int j = 0; j < nr; j++) c[j] += tile[i][j];
        else
            for (int j = 0; j < nr; j++) c[j] = tile[i][j];
    }
}

/* Packed B columns swept per row group: small enough that the block of B
 * stays in L2 while every row group of A passes over it, so C is written row
 * by row (contiguous) instead of one 16-column strip of every row at a time
 * (a strip of rows a power-of-two stride apart thrashes the cache sets). */
#define B_BLOCK_BYTES (160 * 1024)

void comera_gemm_packed_f32(int64_t M, int64_t N, int64_t K,
                            const float *A, int64_t rsa, int64_t csa,
                            const float *Bp, float *C, int64_t ldc,
                            int accumulate) {
    if (M <= 0 || N <= 0) return;
    int64_t panel_bytes = (K > 0 ? K : 1) * NR * (int64_t)sizeof(float);
    int64_t nc = (B_BLOCK_BYTES / panel_bytes) * NR;
    if (nc < NR) nc = NR;
    for (int64_t jb = 0; jb < N; jb += nc) {
        int64_t jend = N - jb < nc ? N : jb + nc;
        for (int64_t i0 = 0; i0 < M; i0 += MR) {
            int mr = (int)(M - i0 < MR ? M - i0 : MR);
            for (int64_t j0 = jb; j0 < jend; j0 += NR) {
                int nr = (int)(N - j0 < NR ? N - j0 : NR);
                kernel_f32(K, A + i0 * rsa, rsa, csa, Bp + j0 * K, NR, C + i0 * ldc + j0,
                           ldc, mr, nr, accumulate);
            }
        }
    }
}

/* float64 serves gradcheck and reference work: a plain loop is enough. */
void comera_gemm_packed_f64(int64_t M, int64_t N, int64_t K,
                            const double *A, int64_t rsa, int64_t csa,
                            const double *Bp, double *C, int64_t ldc,
                            int accumulate) {
    if (M <= 0 || N <= 0) return;
    for (int64_t j0 = 0; j0 < N; j0 += NR) {
        int64_t nr = N - j0 < NR ? N - j0 : NR;
        const double *panel = Bp + j0 * K;
        for (int64_t i = 0; i < M; i++) {
            double acc[NR] = {0};
            for (int64_t k = 0; k < K; k++) {
                double s = A[i * rsa + k * csa];
                for (int j = 0; j < NR; j++) acc[j] += s * panel[k * NR + j];
            }
            double *c = C + i * ldc + j0;
            for (int64_t j = 0; j < nr; j++) c[j] = accumulate ? c[j] + acc[j] : acc[j];
        }
    }
}

/* Below this many multiply-adds packing costs more than it saves. */
#define SMALL_GEMM 4096

int comera_gemm_f32(int64_t M, int64_t N, int64_t K,
                    const float *A, int64_t rsa, int64_t csa,
                    const float *B, int64_t rsb, int64_t csb,
                    float *C, int64_t ldc, int accumulate) {
    if (M <= 0 || N <= 0) return 0;
    if (M * N * K <= SMALL_GEMM) {
        for (int64_t i = 0; i < M; i++) {
            float *c = C + i * ldc;
            if (!accumulate)
                for (int64_t j = 0; j < N; j++) c[j] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                float s = A[i * rsa + k * csa];
                const float *b = B + k * rsb;
                for (int64_t j = 0; j < N; j++) c[j] += s * b[j * csb];
            }
        }
        return 0;
    }
    float *packed = malloc(sizeof(float) * (size_t)comera_gemm_packed_size(K, N));
    if (!packed) return -3;
    comera_gemm_pack_b_f32(K, N, B, rsb, csb, packed);
    comera_gemm_packed_f32(M, N, K, A, rsa, csa, packed, C, ldc, accumulate);
    free(packed);
    return 0;
}

int comera_gemm_f64(int64_t M, int64_t N, int64_t K,
                    const double *A, int64_t rsa, int64_t csa,
                    const double *B, int64_t rsb, int64_t csb,
                    double *C, int64_t ldc, int accumulate) {
    if (M <= 0 || N <= 0) return 0;
    for (int64_t i = 0; i < M; i++) {
        double *c = C + i * ldc;
        if (!accumulate)
            for (int64_t j = 0; j < N; j++) c[j] = 0.0;
        for (int64_t k = 0; k < K; k++) {
            double s = A[i * rsa + k * csa];
            const double *b = B + k * rsb;
            for (int64_t j = 0; j < N; j++) c[j] += s * b[j * csb];
        }
    }
    return 0;
}
