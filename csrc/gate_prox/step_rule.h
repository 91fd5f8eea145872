/* gate_step: the rank-adaptation step on one gate (see comera/gate_prox.h,
 * comera_gate_step_args), one text for the C kernel (cpu_impl.h) and the
 * CUDA kernel (step.cu), as rule.h is for the proximal rule, which it ends
 * with.  Included after rule.h (REAL, GATE_HD and GATE_TEMPLATE as there).
 *
 * It repeats, entry for entry, the tensor code of comera/adapt/step.py
 * (update_saliency, GateStep._shrink): each value is rounded to the element
 * type where torch rounds it, so both give the same bits. */
#ifndef COMERA_GATE_STEP_RULE_H
#define COMERA_GATE_STEP_RULE_H

#include "comera/gate_prox.h"
#include "gate_prox/rule.h"

/* The tables of comera_gate_step_args, checked before either kernel runs
 * (host code, one text for the C entry points and the CUDA launcher). */
static inline int gate_step_args_ok(const comera_gate_step_args *a) {
    if (!a || a->num_gates < 0 || a->threshold != a->threshold || a->min_live < 0) return 0;
    if (a->num_gates == 0) return 1;
    if (!a->gates || !a->signs || !a->sizes || !a->live || (a->grads && !a->saliency)) return 0;
    if (a->nan_seen && !a->nan_gates) return 0;
    for (int64_t k = 0; k < a->num_gates; k++) {
        int64_t n = a->sizes[k];
        if (n < 0 || (n > 0 && (!a->gates[k] || !a->signs[k]))) return 0;
        if (n > 0 && a->grads && a->grads[k] && !a->saliency[k]) return 0;
    }
    return 1;
}

/* The saliency's running average keeps this much of its past
 * (comera/adapt/step.py SALIENCY_DECAY); the new term weighs 1 - it. */
#define GATE_SALIENCY_DECAY 0.9

#ifdef __cplusplus
/* |a b| with the product rounded to T (torch multiplies, then converts). */
template <typename T> static inline GATE_HD double gate_product_abs(T a, T b) {
    typedef typename comera_cuda::Acc<T>::type A;
    T p = comera_cuda::from_acc<T, A>(comera_cuda::to_acc<A>(a) * comera_cuda::to_acc<A>(b));
    return fabs(gate_value(p));
}

/* sign(v) max(|v| - amount, 0), the difference rounded to T. */
template <typename T> static inline GATE_HD T gate_shrunk(T v, T amount) {
    typedef typename comera_cuda::Acc<T>::type A;
    double x = gate_value(v);
    A diff = (A)fabs(x) - comera_cuda::to_acc<A>(amount);
    A m = comera_cuda::to_acc<A>(comera_cuda::from_acc<T, A>(diff));
    if (m < 0) m = 0;
    A sg = (A)((x > 0) - (x < 0));
    return comera_cuda::from_acc<T, A>(sg * m);
}
#else
static inline double gate_product_abs(REAL a, REAL b) {
    REAL p = a * b;
    return fabs((double)p);
}

static inline REAL gate_shrunk(REAL v, REAL amount) {
    REAL m = (REAL)fabs((double)v) - amount;
    if (m < 0) m = 0;
    REAL sg = (REAL)((v > 0) - (v < 0));
    return sg * m;
}
#endif

/* saliency = decay saliency + (1 - decay) |g grad|: torch's mul, then its
 * add with alpha, which is one fused multiply-add (on the CPU and CUDA). */
GATE_TEMPLATE static inline GATE_HD void gate_saliency(const REAL *g, const REAL *grad,
                                                       double *sal, int64_t n) {
    const double fresh = 1.0 - GATE_SALIENCY_DECAY;
    for (int64_t i = 0; i < n; i++)
        sal[i] = fma(fresh, gate_product_abs(g[i], grad[i]), sal[i] * GATE_SALIENCY_DECAY);
}

/* An entry's value as the shrink sees it: dead entries count as 0 (the
 * optimizer's momentum may have moved them; the rule re-zeroes them). */
GATE_TEMPLATE static inline GATE_HD double gate_old(const REAL *g, const int8_t *s, int64_t i) {
    return s[i] != 0 ? fabs(gate_value(g[i])) : 0.0;
}

/* The entry at place need - 1 when the gate is sorted by decreasing |old|,
 * ties the earlier first: (*cut_v, *cut_i).  An entry is among the `need`
 * first iff its (|old|, -i) is at least (cut_v, -cut_i).  need passes of
 * the gate, each taking the largest entry below the previous one. */
GATE_TEMPLATE static inline GATE_HD void gate_cutoff(const REAL *g, const int8_t *s, int64_t n,
                                                     int64_t need, double *cut_v,
                                                     int64_t *cut_i) {
    double v = INFINITY;
    int64_t at = -1; /* (inf, -1): above every entry */
    for (int64_t r = 0; r < need; r++) {
        double best_v = -1.0;
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++) {
            double a = gate_old(g, s, i);
            int below = a < v || (a == v && i > at);
            if (below && (best < 0 || a > best_v)) {
                best_v = a;
                best = i;
            }
        }
        v = best_v;
        at = best;
    }
    *cut_v = v;
    *cut_i = at;
}

/* The decoupled L1 step with the min_live rescue (GateStep._shrink). */
GATE_TEMPLATE static inline GATE_HD void gate_shrink(REAL *g, const int8_t *s, int64_t n,
                                                     REAL amount, int64_t min_live) {
    int64_t before = 0, after = 0;
    for (int64_t i = 0; i < n; i++) {
        REAL old = g[i];
        if (s[i] == 0) gate_set_zero(&old);
        before += gate_value(old) != 0;
        after += gate_value(gate_shrunk(old, amount)) != 0;
    }
    int64_t need = before < min_live ? before : min_live;
    int rescue = after < need; /* the gate would fall short: keep its largest */
    double cut_v = 0.0;
    int64_t cut_i = -1;
    if (rescue) gate_cutoff(g, s, n, need, &cut_v, &cut_i);
    for (int64_t i = 0; i < n; i++) {
        REAL old = g[i];
        if (s[i] == 0) gate_set_zero(&old);
        REAL shrunk = gate_shrunk(old, amount);
        double a = fabs(gate_value(old));
        int top = a > cut_v || (a == cut_v && i <= cut_i);
        g[i] = rescue && top && gate_value(shrunk) == 0 ? old : shrunk;
    }
}

/* One gate: saliency (grad: NULL when it has none), shrink (amount: NULL
 * for none), then the proximal rule; returns the live count. */
GATE_TEMPLATE static inline GATE_HD int64_t gate_step_one(REAL *g, int8_t *s, const REAL *grad,
                                                          double *sal, int64_t n,
                                                          const REAL *amount, double threshold,
                                                          int64_t min_live, int kill) {
    if (grad) gate_saliency(g, grad, sal, n);
    if (amount) gate_shrink(g, s, n, *amount, min_live);
    return gate_prox_one(g, s, n, threshold, min_live, kill);
}

#endif
