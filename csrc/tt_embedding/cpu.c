/* TT embedding, CPU kernels: the float32/float64 entry points.  The generic
 * text of the kernels is cpu_impl.h (the backward: cpu_bwd_impl.h),
 * compiled once per element type; the public functions below are thin
 * wrappers, written out so that each can be found by its name.  Checks,
 * index grouping and the planner are in plan.c. */
#include "tt_embedding/shape.h"
#include "common/gemm.h"
#include "common/workspace.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Below this much work per thread a parallel region costs more than it
 * saves: fork and join, and on a busy machine threads that spin while they
 * wait for a core.  Tiny lookups (a few hundred rows of a small table) run
 * on one thread. */
#define EMB_MIN_FLOPS_PER_THREAD 2e5

static int threads_for(int nthreads, int64_t items, double flops_per_item) {
    int nt = nthreads > 0 ? nthreads : 1;
    double by_work = (double)items * flops_per_item / EMB_MIN_FLOPS_PER_THREAD;
    if (by_work < nt) nt = by_work < 1.0 ? 1 : (int)by_work;
    if (items < nt) nt = items > 0 ? (int)items : 1;
    return nt;
}

/* This thread's contiguous chunk [*u0, *u1) of `count` rows.  The team may
 * be smaller than asked (a nested region runs with one thread), so the
 * chunks follow the team that actually runs; a thread of an empty chunk
 * leaves its accumulators at zero. */
static void thread_rows(int64_t count, int64_t *u0, int64_t *u1) {
    int tid = omp_get_thread_num(), team = omp_get_num_threads();
    *u0 = count * tid / team;
    *u1 = count * (tid + 1) / team;
}

static void unravel(const emb_shape *s, int64_t t, int64_t *idx) {
    for (int k = 0; k < s->d; k++) idx[k] = (t / s->vstride[k]) % s->v[k];
}

/* First level whose index differs between two rows (d when equal). */
static int first_diff(int d, const int64_t *a, const int64_t *b) {
    int l = 0;
    while (l < d && a[l] == b[l]) l++;
    return l;
}

/* Flags of the core slices a small batch's rows read (used[off_k + i] for
 * slice i of core k, off_k the slices of the cores before k), or NULL: pack
 * every slice.  A batch of fewer rows than twice the largest mode reads few
 * slices, and packing only those keeps a one-index call from packing whole
 * cores; a larger batch reads nearly all of them and skips the marking. */
static unsigned char *used_slices(const emb_shape *s, const emb_rows *rows) {
    int64_t total = 0, vmax = 0;
    for (int k = 0; k < s->d; k++) {
        total += s->v[k];
        if (s->v[k] > vmax) vmax = s->v[k];
    }
    if (rows->count >= 2 * vmax) return NULL;
    unsigned char *used = calloc((size_t)total, 1);
    if (!used) return NULL; /* packing everything is still right */
    for (int64_t u = 0; u < rows->count; u++) {
        int64_t idx[COMERA_MAX_CORES], off = 0;
        unravel(s, rows->keys[u], idx);
        for (int k = 0; k < s->d; k++) {
            used[off + idx[k]] = 1;
            off += s->v[k];
        }
    }
    return used;
}

#define REAL float
#define FN(name) name##_f32
#include "tt_embedding/cpu_impl.h"
#include "tt_embedding/cpu_bwd_impl.h"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "tt_embedding/cpu_impl.h"
#include "tt_embedding/cpu_bwd_impl.h"
#undef REAL
#undef FN

int comera_tt_embedding_fwd_f32(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const float *psw,
                                const float *const *cores, const float *const *gates,
                                float *out, int nthreads) {
    return emb_fwd_prepared_f32(p, b, psw, cores, gates, out, nthreads);
}

int comera_tt_embedding_fwd_f64(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const double *psw,
                                const double *const *cores, const double *const *gates,
                                double *out, int nthreads) {
    return emb_fwd_prepared_f64(p, b, psw, cores, gates, out, nthreads);
}

int comera_tt_embedding_bwd_f32(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const float *psw,
                                const float *grad_out, const float *const *cores,
                                const float *const *gates, float *const *dcores,
                                float *const *dgates, int nthreads) {
    return emb_bwd_prepared_f32(p, b, psw, grad_out, cores, gates, dcores, dgates, nthreads);
}

int comera_tt_embedding_bwd_f64(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const double *psw,
                                const double *grad_out, const double *const *cores,
                                const double *const *gates, double *const *dcores,
                                double *const *dgates, int nthreads) {
    return emb_bwd_prepared_f64(p, b, psw, grad_out, cores, gates, dcores, dgates, nthreads);
}
