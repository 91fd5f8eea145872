/* TT embedding, CPU kernels for float32: the body of cpu_impl.h and
 * cpu_bwd_impl.h (see there) compiled with REAL = float, and the public
 * float32 entry points. */
#define REAL float
#include "tt_embedding/cpu_impl.h"
#include "tt_embedding/cpu_bwd_impl.h"

int comera_tt_embedding_fwd_f32(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const float *psw,
                                const float *const *cores, const float *const *gates,
                                float *out, int nthreads) {
    return emb_fwd(&p->shape, b, psw, p->reuse_resolved, cores, gates, out, nthreads);
}

int comera_tt_embedding_bwd_f32(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const float *psw,
                                const float *grad_out, const float *const *cores,
                                const float *const *gates, float *const *dcores,
                                float *const *dgates, int nthreads) {
    return emb_bwd(&p->shape, b, psw, p->reuse_resolved, grad_out, cores, gates, dcores,
                   dgates, nthreads);
}
