/* TT linear layer, CPU kernels for float32: the body of cpu_impl.h (see
 * there) compiled with REAL = float, and the public float32 entry points. */
#define REAL float
#include "tt_linear/cpu_impl.h"

int comera_tt_linear_fwd_f32(const comera_tt_linear_prep *p, const float *x,
                             const float *const *cores, const float *const *gates,
                             const float *bias, float *y, float *t, int nthreads) {
    return linear_fwd(p, x, cores, gates, bias, y, t, nthreads);
}

int comera_tt_linear_bwd_f32(const comera_tt_linear_prep *p, const float *dy, const float *x,
                             const float *t, const float *const *cores,
                             const float *const *gates, float *dx, float *const *dcores,
                             float *const *dgates, float *dbias, int nthreads) {
    return linear_bwd(p, dy, x, t, cores, gates, dx, dcores, dgates, dbias, nthreads);
}

/* The float32 merges of both chains and their backward, for the bfloat16
 * and float16 kernels (cpu_half.c), which build V and U in float32. */
int comera_tt_merges_f32(const tt_shape *s, const float *eff, float *P) {
    int rc = merge_chain(s, 0, s->p - 1, eff, P);
    return rc ? rc : merge_chain(s, s->p, s->D - 1, eff, P);
}

int comera_tt_merges_bwd_f32(const tt_shape *s, const float *eff, const float *P, float *dP,
                             float *deff) {
    int rc = merge_chain_bwd(s, 0, s->p - 1, eff, P, dP, deff);
    return rc ? rc : merge_chain_bwd(s, s->p, s->D - 1, eff, P, dP, deff);
}
