/* gate_prox: the fused proximal step on TT gates (rank adaptation, see
 * comera/gate_prox.h and docs/design.md section 4), CPU kernel.  The
 * float32 and float64 versions share one text (cpu_impl.h); the public
 * functions below are thin wrappers, written out so that each can be found
 * by its name. */
#include "comera/gate_prox.h"

#include <math.h>
#include <omp.h>
#include <stddef.h>

/* Gates are short (one entry per rank), so threads only pay off when there
 * are many entries in total. */
#define GATE_PARALLEL_MIN 32768

static int gate_threads(int nthreads, int64_t num_gates, int64_t total) {
    if (nthreads <= 1 || total < GATE_PARALLEL_MIN) return 1;
    return num_gates < nthreads ? (int)num_gates : nthreads;
}

#define REAL float
#define FN(name) name##_f32
#include "gate_prox/cpu_impl.h"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "gate_prox/cpu_impl.h"
#undef REAL
#undef FN

int comera_gate_prox_f32(int64_t num_gates, float *const *gates, int8_t *const *signs,
                         const int64_t *sizes, double threshold, int64_t min_live, int kill,
                         int64_t *live, int nthreads) {
    return gate_prox_f32(num_gates, gates, signs, sizes, threshold, min_live, kill, live,
                         nthreads);
}

int comera_gate_prox_f64(int64_t num_gates, double *const *gates, int8_t *const *signs,
                         const int64_t *sizes, double threshold, int64_t min_live, int kill,
                         int64_t *live, int nthreads) {
    return gate_prox_f64(num_gates, gates, signs, sizes, threshold, min_live, kill, live,
                         nthreads);
}
