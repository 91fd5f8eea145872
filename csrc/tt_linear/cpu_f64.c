/* TT linear layer, CPU kernels for float64: the body of cpu_impl.h (see
 * there) compiled with REAL = double, and the public float64 entry points. */
#define REAL double
#include "tt_linear/cpu_impl.h"

int comera_tt_linear_fwd_f64(const comera_tt_linear_prep *p, const double *x,
                             const double *const *cores, const double *const *gates,
                             const double *bias, double *y, double *t, int nthreads) {
    return linear_fwd(p, x, cores, gates, bias, y, t, nthreads);
}

int comera_tt_linear_bwd_f64(const comera_tt_linear_prep *p, const double *dy,
                             const double *x, const double *t, const double *const *cores,
                             const double *const *gates, double *dx, double *const *dcores,
                             double *const *dgates, double *dbias, int nthreads) {
    return linear_bwd(p, dy, x, t, cores, gates, dx, dcores, dgates, dbias, nthreads);
}
