/* The plain GEMM loops that float32 (gemm.c) and float64 (gemm_f64.c)
 * share, one text for both element types: define REAL (float or double)
 * before including it.  C has no templates, so each file compiles these
 * static functions for its own type, under the same plain names. */
#ifndef COMERA_GEMM_LOOPS_H
#define COMERA_GEMM_LOOPS_H

#include "common/gemm.h"

#ifndef REAL
#error "define REAL (float or double) before including common/gemm_loops.h"
#endif

/* The panels of B from column j_from (a multiple of COMERA_GEMM_NR) on, read
 * element by element through its strides; the columns of the last panel
 * past N are zeros. */
static inline void pack_b_strided(int64_t K, int64_t N, int64_t j_from, const REAL *B,
                                  int64_t rsb, int64_t csb, REAL *packed) {
    for (int64_t j0 = j_from; j0 < N; j0 += COMERA_GEMM_NR) {
        int64_t nr = N - j0 < COMERA_GEMM_NR ? N - j0 : COMERA_GEMM_NR;
        REAL *dst = packed + j0 * K;
        for (int64_t k = 0; k < K; k++) {
            const REAL *src = B + k * rsb + j0 * csb;
            int64_t j = 0;
            for (; j < nr; j++) dst[k * COMERA_GEMM_NR + j] = src[j * csb];
            for (; j < COMERA_GEMM_NR; j++) dst[k * COMERA_GEMM_NR + j] = 0;
        }
    }
}

/* C (+)= A B straight from the strided operands, a row of C at a time: no
 * packing, for products too small to repay it. */
static inline void gemm_unpacked(int64_t M, int64_t N, int64_t K, const REAL *A, int64_t rsa,
                                 int64_t csa, const REAL *B, int64_t rsb, int64_t csb, REAL *C,
                                 int64_t ldc, int accumulate) {
    for (int64_t i = 0; i < M; i++) {
        REAL *c = C + i * ldc;
        if (accumulate != COMERA_GEMM_ADD)
            for (int64_t j = 0; j < N; j++) c[j] = 0;
        for (int64_t k = 0; k < K; k++) {
            REAL s = A[i * rsa + k * csa];
            const REAL *b = B + k * rsb;
            if (csb == 1)  /* the usual case, and one the compiler vectorises */
                for (int64_t j = 0; j < N; j++) c[j] += s * b[j];
            else
                for (int64_t j = 0; j < N; j++) c[j] += s * b[j * csb];
        }
    }
}

#endif
