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

/* C (+)= A B straight from the strided operands, a row of C at a time,
 * the inner loop along a row of B (contiguous when csb == 1). */
static inline void gemm_rows_unpacked(int64_t M, int64_t N, int64_t K, const REAL *A,
                                      int64_t rsa, int64_t csa, const REAL *B, int64_t rsb,
                                      int64_t csb, REAL *C, int64_t ldc, int accumulate) {
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

/* Rows of C per block of the column loop below (a stack buffer). */
#define GEMM_COLUMN_BLOCK 256

/* The same, a column of C at a time, the inner loop down a column of A
 * (rsa == 1): for a B read across its rows (csb != 1) or only a few
 * columns wide, where the row loop above runs scalar. */
static inline void gemm_columns_unpacked(int64_t M, int64_t N, int64_t K, const REAL *A,
                                         int64_t csa, const REAL *B, int64_t rsb, int64_t csb,
                                         REAL *C, int64_t ldc, int accumulate) {
    REAL acc[GEMM_COLUMN_BLOCK];
    for (int64_t i0 = 0; i0 < M; i0 += GEMM_COLUMN_BLOCK) {
        int64_t m = M - i0 < GEMM_COLUMN_BLOCK ? M - i0 : GEMM_COLUMN_BLOCK;
        for (int64_t j = 0; j < N; j++) {
            REAL *c = C + i0 * ldc + j;
            for (int64_t i = 0; i < m; i++)
                acc[i] = accumulate == COMERA_GEMM_ADD ? c[i * ldc] : 0;
            for (int64_t k = 0; k < K; k++) {
                REAL s = B[k * rsb + j * csb];
                const REAL *a = A + i0 + k * csa;
                for (int64_t i = 0; i < m; i++) acc[i] += s * a[i];
            }
            for (int64_t i = 0; i < m; i++) c[i * ldc] = acc[i];
        }
    }
}

/* Partial sums per dot product below: independent lanes the compiler can
 * keep in one vector register. */
#define GEMM_DOT_LANES 8

/* The same as dot products along K, for A read along its rows (csa == 1)
 * and B down its columns (rsb == 1). */
static inline void gemm_dots_unpacked(int64_t M, int64_t N, int64_t K, const REAL *A,
                                      int64_t rsa, const REAL *B, int64_t csb, REAL *C,
                                      int64_t ldc, int accumulate) {
    int64_t whole = K - K % GEMM_DOT_LANES;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            const REAL *a = A + i * rsa, *b = B + j * csb;
            REAL lane[GEMM_DOT_LANES] = {0};
            for (int64_t k = 0; k < whole; k += GEMM_DOT_LANES)
                for (int l = 0; l < GEMM_DOT_LANES; l++) lane[l] += a[k + l] * b[k + l];
            REAL s = 0;
            for (int l = 0; l < GEMM_DOT_LANES; l++) s += lane[l];
            for (int64_t k = whole; k < K; k++) s += a[k] * b[k];
            C[i * ldc + j] = accumulate == COMERA_GEMM_ADD ? C[i * ldc + j] + s : s;
        }
}

/* Below this many columns a row of C is too short for the row loop's
 * vectors. */
#define GEMM_FEW_COLUMNS 8

/* C (+)= A B with no packing, for products too small to repay it: the loop
 * order whose inner loop runs along contiguous memory, where the strides
 * allow one. */
static inline void gemm_unpacked(int64_t M, int64_t N, int64_t K, const REAL *A, int64_t rsa,
                                 int64_t csa, const REAL *B, int64_t rsb, int64_t csb, REAL *C,
                                 int64_t ldc, int accumulate) {
    int rows_contiguous = csb == 1 && N >= GEMM_FEW_COLUMNS;
    if (!rows_contiguous && rsa == 1 && M >= GEMM_FEW_COLUMNS)
        gemm_columns_unpacked(M, N, K, A, csa, B, rsb, csb, C, ldc, accumulate);
    else if (!rows_contiguous && csa == 1 && rsb == 1 && K >= GEMM_DOT_LANES)
        gemm_dots_unpacked(M, N, K, A, rsa, B, csb, C, ldc, accumulate);
    else
        gemm_rows_unpacked(M, N, K, A, rsa, csa, B, rsb, csb, C, ldc, accumulate);
}

#endif
