/* TT embedding, CPU kernels for float64: the body of cpu_impl.h and
 * cpu_bwd_impl.h (see there) compiled with REAL = double, and the public
 * float64 entry points. */
#define REAL double
#include "tt_embedding/cpu_impl.h"
#include "tt_embedding/cpu_bwd_impl.h"

int comera_tt_embedding_fwd_f64(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const double *psw,
                                const double *const *cores, const double *const *gates,
                                double *out, int nthreads) {
    return emb_fwd(&p->shape, b, psw, p->reuse_resolved, cores, gates, out, nthreads);
}

int comera_tt_embedding_bwd_f64(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const double *psw,
                                const double *grad_out, const double *const *cores,
                                const double *const *gates, double *const *dcores,
                                double *const *dgates, int nthreads) {
    return emb_bwd(&p->shape, b, psw, p->reuse_resolved, grad_out, cores, gates, dcores,
                   dgates, nthreads);
}
