/* gate_prox: the fused proximal step on TT gates (rank adaptation, see
 * comera/gate_prox.h and docs/design.md section 4), CPU kernel: the body
 * shared by float32 and float64.
 *
 * C has no templates, and one text for both element types keeps them from
 * drifting apart, so this file is compiled twice: cpu_f32.c defines REAL as
 * float and includes it, cpu_f64.c as double.  Every function here is
 * static and has its plain name, so grep finds each definition and call;
 * the public entry points (comera_gate_prox_f32, _f64) are written out by
 * name in cpu_f32.c and cpu_f64.c, as thin wrappers of gate_prox_run and
 * gate_step_run.  The rules on one gate (gate_prox_one, gate_step_one) are
 * rule.h's and step_rule.h's, shared with the CUDA kernels. */
#ifndef REAL
#error "define REAL (float or double) before including gate_prox/cpu_impl.h"
#endif

#include "comera/gate_prox.h"
#include "common/threads.h"
#include "gate_prox/rule.h"
#include "gate_prox/step_rule.h"

#include <math.h>
#include <stddef.h>

/* Gates are short (one entry per rank), so threads only pay off when there
 * are many entries in total. */
#define GATE_PARALLEL_MIN 32768

static int gate_threads(int nthreads, int64_t num_gates, int64_t total) {
    if (total < GATE_PARALLEL_MIN) return 1;
    return comera_threads_for_items(nthreads, num_gates);
}

static int gate_has_nan(const REAL *g, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(g[i])) return 1;
    return 0;
}

static int gate_prox_run(int64_t num_gates, REAL *const *gates, int8_t *const *signs,
                         const int64_t *sizes, double threshold, int64_t min_live,
                         int kill, int64_t *live, int nthreads) {
    if (num_gates < 0 || isnan(threshold) || min_live < 0) return COMERA_ERR_ARG;
    if (num_gates == 0) return COMERA_OK;
    if (!gates || !signs || !sizes || !live) return COMERA_ERR_ARG;
    int64_t total = 0;
    for (int64_t k = 0; k < num_gates; k++) {
        if (sizes[k] < 0 || (sizes[k] > 0 && (!gates[k] || !signs[k]))) return COMERA_ERR_ARG;
        total += sizes[k];
    }
    int nt = gate_threads(nthreads, num_gates, total);

    /* NaN first, over everything, so that a NaN anywhere modifies nothing */
    int any_nan = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(|| : any_nan)
    for (int64_t k = 0; k < num_gates; k++) {
        int bad = gate_has_nan(gates[k], sizes[k]);
        live[k] = bad ? -1 : 0;
        any_nan = any_nan || bad;
    }
    if (any_nan) return COMERA_GATE_NAN;

#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t k = 0; k < num_gates; k++)
        live[k] = gate_prox_one(gates[k], signs[k], sizes[k], threshold, min_live, kill);
    return COMERA_OK;
}

/* comera_gate_step_f32/_f64 (comera/gate_prox.h): the NaN pass over every
 * gate first, then each gate's whole step on its own (step_rule.h). */
static int gate_step_run(const comera_gate_step_args *a, int nthreads) {
    if (!gate_step_args_ok(a)) return COMERA_ERR_ARG;
    const int64_t num = a->num_gates;
    if (num == 0) return COMERA_OK;
    int64_t total = 0;
    for (int64_t k = 0; k < num; k++) total += a->sizes[k];
    int nt = gate_threads(nthreads, num, total);
    REAL *const *gates = (REAL *const *)a->gates;
    const REAL *const *grads = (const REAL *const *)a->grads;

    int any_nan = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(|| : any_nan)
    for (int64_t k = 0; k < num; k++) {
        int bad = gate_has_nan(gates[k], a->sizes[k]);
        a->live[k] = bad ? -1 : 0;
        any_nan = any_nan || bad;
    }
    if (any_nan) {
        if (a->nan_seen && !*a->nan_seen) { /* the first NaN seen: which gates */
            for (int64_t k = 0; k < num; k++) a->nan_gates[k] = a->live[k] < 0;
            *a->nan_seen = 1;
        }
        return COMERA_GATE_NAN;
    }
    const REAL *amount = (a->frozen && *a->frozen) ? NULL : (const REAL *)a->amount;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t k = 0; k < num; k++)
        a->live[k] = gate_step_one(gates[k], a->signs[k], grads ? grads[k] : NULL,
                                   a->saliency ? a->saliency[k] : NULL, a->sizes[k],
                                   amount ? amount + k : NULL, a->threshold, a->min_live,
                                   a->kill);
    return COMERA_OK;
}
