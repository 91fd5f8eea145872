/* comera's float64 GEMM: plain loops without packing tricks or micro-kernels,
 * as float64 serves gradcheck and reference work, not speed.  The strided
 * packing and the unpacked product are gemm_loops.h's, shared with float32
 * (gemm.c). */
#define REAL double
#include "common/gemm.h"
#include "common/gemm_loops.h"

#define NR COMERA_GEMM_NR

void comera_gemm_pack_b_f64(int64_t K, int64_t N, const double *B,
                            int64_t rsb, int64_t csb, double *packed) {
    pack_b_strided(K, N, 0, B, rsb, csb, packed);
}

/* A plain loop over the packed panels, a row of C at a time. */
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
            for (int64_t j = 0; j < nr; j++)
                c[j] = accumulate == COMERA_GEMM_ADD ? c[j] + acc[j] : acc[j];
        }
    }
}

/* B read in place (tail unused): the unpacked loop does that anyway. */
void comera_gemm_rows_f64(int64_t M, int64_t N, int64_t K, const double *A, int64_t rsa,
                          int64_t csa, const double *B, int64_t ldb, double *C, int64_t ldc,
                          int accumulate, double *tail) {
    (void)tail;
    if (M > 0 && N > 0) gemm_unpacked(M, N, K, A, rsa, csa, B, ldb, 1, C, ldc, accumulate);
}

/* Every float64 product is unpacked: packing pays off only where a tuned
 * tile reads the panels. */
int comera_gemm_f64(int64_t M, int64_t N, int64_t K,
                    const double *A, int64_t rsa, int64_t csa,
                    const double *B, int64_t rsb, int64_t csb,
                    double *C, int64_t ldc, int accumulate) {
    if (M <= 0 || N <= 0) return 0;
    gemm_unpacked(M, N, K, A, rsa, csa, B, rsb, csb, C, ldc, accumulate);
    return 0;
}
