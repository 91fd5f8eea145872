/* gate_prox: the fused proximal step on TT gates (rank adaptation, see
 * comera/gate_prox.h and docs/design.md section 4), CPU kernel: the body
 * shared by float32 and float64.
 *
 * C has no templates, and one text for both element types keeps them from
 * drifting apart, so this file is compiled twice: cpu_f32.c defines REAL as
 * float and includes it, cpu_f64.c as double.  Every function here is
 * static and has its plain name, so grep finds each definition and call;
 * the public entry points (comera_gate_prox_f32, _f64) are written out by
 * name in cpu_f32.c and cpu_f64.c, as thin wrappers of gate_prox_run.  The
 * rule on one gate (gate_prox_one) is rule.h's, shared with the CUDA kernel. */
#ifndef REAL
#error "define REAL (float or double) before including gate_prox/cpu_impl.h"
#endif

#include "comera/gate_prox.h"
#include "common/threads.h"
#include "gate_prox/rule.h"

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
