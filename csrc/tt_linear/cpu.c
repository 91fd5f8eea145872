/* TT linear layer, CPU kernels: the float32/float64 entry points.  The
 * generic text of the kernels is cpu_impl.h, compiled once per element type;
 * the public functions below are thin wrappers, written out so that each can
 * be found by its name.  Checks and planning are in plan.c (prepare). */
#include "tt_linear/shape.h"
#include "common/gemm.h"
#include "common/workspace.h"

#include <stdlib.h>
#include <string.h>

static int threads_for(int nthreads, int64_t blocks) {
    int nt = nthreads > 0 ? nthreads : 1;
    if (blocks < nt) nt = blocks > 0 ? (int)blocks : 1;
    return nt;
}

#define REAL float
#define FN(name) name##_f32
#include "tt_linear/cpu_impl.h"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "tt_linear/cpu_impl.h"
#undef REAL
#undef FN

int comera_tt_linear_fwd_f32(const comera_tt_linear_prep *p, const float *x,
                             const float *const *cores, const float *const *gates,
                             const float *bias, float *y, float *t, int nthreads) {
    return fwd_f32(p, x, cores, gates, bias, y, t, nthreads);
}

int comera_tt_linear_fwd_f64(const comera_tt_linear_prep *p, const double *x,
                             const double *const *cores, const double *const *gates,
                             const double *bias, double *y, double *t, int nthreads) {
    return fwd_f64(p, x, cores, gates, bias, y, t, nthreads);
}

int comera_tt_linear_bwd_f32(const comera_tt_linear_prep *p, const float *dy, const float *x,
                             const float *t, const float *const *cores,
                             const float *const *gates, float *dx, float *const *dcores,
                             float *const *dgates, float *dbias, int nthreads) {
    return bwd_f32(p, dy, x, t, cores, gates, dx, dcores, dgates, dbias, nthreads);
}

int comera_tt_linear_bwd_f64(const comera_tt_linear_prep *p, const double *dy,
                             const double *x, const double *t, const double *const *cores,
                             const double *const *gates, double *dx, double *const *dcores,
                             double *const *dgates, double *dbias, int nthreads) {
    return bwd_f64(p, dy, x, t, cores, gates, dx, dcores, dgates, dbias, nthreads);
}
