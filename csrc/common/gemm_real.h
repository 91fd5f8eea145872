/* The GEMM functions of common/gemm.h for the element type REAL, under short
 * names, for the kernel bodies compiled once per type (tt_linear/cpu_impl.h,
 * tt_embedding/cpu_impl.h): define REAL (float or double) first.  Each shim
 * picks comera_<name>_f32 or _f64 when compiled (C11 _Generic on REAL), so
 * both public names are written out here and a call reads gemm(...). */
#ifndef COMERA_GEMM_REAL_H
#define COMERA_GEMM_REAL_H

#include "common/gemm.h"

#ifndef REAL
#error "define REAL (float or double) before including common/gemm_real.h"
#endif

static inline int gemm(int64_t M, int64_t N, int64_t K, const REAL *A, int64_t rsa, int64_t csa,
                       const REAL *B, int64_t rsb, int64_t csb, REAL *C, int64_t ldc,
                       int accumulate) {
    return _Generic((REAL)0, float: comera_gemm_f32, double: comera_gemm_f64)(
        M, N, K, A, rsa, csa, B, rsb, csb, C, ldc, accumulate);
}

static inline void gemm_packed(int64_t M, int64_t N, int64_t K, const REAL *A, int64_t rsa,
                               int64_t csa, const REAL *Bp, REAL *C, int64_t ldc,
                               int accumulate) {
    _Generic((REAL)0, float: comera_gemm_packed_f32, double: comera_gemm_packed_f64)(
        M, N, K, A, rsa, csa, Bp, C, ldc, accumulate);
}

static inline void gemm_rows(int64_t M, int64_t N, int64_t K, const REAL *A, int64_t rsa,
                             int64_t csa, const REAL *B, int64_t ldb, REAL *C, int64_t ldc,
                             int accumulate, REAL *tail) {
    _Generic((REAL)0, float: comera_gemm_rows_f32, double: comera_gemm_rows_f64)(
        M, N, K, A, rsa, csa, B, ldb, C, ldc, accumulate, tail);
}

static inline void gemm_pack_b(int64_t K, int64_t N, const REAL *B, int64_t rsb, int64_t csb,
                               REAL *packed) {
    _Generic((REAL)0, float: comera_gemm_pack_b_f32, double: comera_gemm_pack_b_f64)(
        K, N, B, rsb, csb, packed);
}

static inline void gemm_dot(int64_t M, int64_t N, int64_t K, const REAL *A, int64_t lda,
                            const REAL *Bt, int64_t ldb, REAL *C, int64_t ldc, REAL *Apack) {
    _Generic((REAL)0, float: comera_gemm_dot_f32, double: comera_gemm_dot_f64)(
        M, N, K, A, lda, Bt, ldb, C, ldc, Apack);
}

static inline int gemm_dot_wins(int64_t N) {
    return _Generic((REAL)0, float: comera_gemm_dot_wins_f32, double: comera_gemm_dot_wins_f64)(N);
}

/* comera_copy_f32 / _f64: n elements with a product's store mode */
static inline void gemm_copy(REAL *dst, const REAL *src, int64_t n, int mode) {
    _Generic((REAL)0, float: comera_copy_f32, double: comera_copy_f64)(dst, src, n, mode);
}

#endif
