/* gate_prox, CPU kernel for float32: the body of cpu_impl.h (see there)
 * compiled with REAL = float, and the public float32 entry points. */
#define REAL float
#include "gate_prox/cpu_impl.h"

int comera_gate_prox_f32(int64_t num_gates, float *const *gates, int8_t *const *signs,
                         const int64_t *sizes, double threshold, int64_t min_live, int kill,
                         int64_t *live, int nthreads) {
    return gate_prox_run(num_gates, gates, signs, sizes, threshold, min_live, kill, live, nthreads);
}

int comera_gate_step_f32(const comera_gate_step_args *a, int nthreads) {
    return gate_step_run(a, nthreads);
}
