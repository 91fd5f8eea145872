/* Rank adaptation: the fused proximal step on the TT gates (docs/design.md section 4).
 *
 * Every gate vector g (one per internal bond of every TT layer) comes with a
 * sign vector s of the same length (int8): s[i] = +1 or -1 is the sign the
 * live entry i had after the previous step, s[i] = 0 marks a dead entry.
 *
 * The L1 term gamma * |g| reaches the gates through the loss (its gradient
 * gamma * sign(g) is part of the optimizer step just taken).  For plain SGD a
 * proximal (soft-threshold) step differs from that subgradient step only for
 * entries the L1 pull carries across zero: the proximal map stops them at
 * exactly 0.  So after the optimizer step this kernel does, per entry:
 *
 *     dead (s == 0)                                   g = 0            (stays dead)
 *     kill && (|g| <= threshold || sign(g) != s)      g = 0, s = 0     (dies)
 *     otherwise                                       s = sign(g)      (lives)
 *
 * i.e. soft-thresholding with the zero crossing detected from the signs, plus
 * a dead zone |g| <= threshold that also catches the oscillation around zero
 * of adaptive optimizers (Adam), whose steps rarely land on 0 exactly.
 *
 * min_live: a gate never drops below min_live live entries through this
 * step: if it would, the largest-magnitude non-zero entries that were about
 * to die are kept (a bond of rank 0 would make the layer identically zero).
 *
 * NaN: if any entry of any gate is NaN, no gate is modified, live[k] = -1
 * for every gate k that holds a NaN, and COMERA_GATE_NAN is returned.
 *
 * kill == 0 (ranks frozen): only re-zeroes dead entries; nothing dies.
 */
#ifndef COMERA_GATE_PROX_H
#define COMERA_GATE_PROX_H

#include <stdint.h>

#include "comera/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Returns COMERA_OK, COMERA_ERR_ARG or COMERA_GATE_NAN (comera/status.h). */
/* gates[k], signs[k]: sizes[k] entries each (sizes[k] >= 0).  threshold: the
 * dead zone (< 0 disables it, NaN is an argument error).  live[k] receives
 * the number of live entries of gate k after the step (or -1, see NaN).
 * nthreads <= 0 means one thread. */
int comera_gate_prox_f32(int64_t num_gates, float *const *gates, int8_t *const *signs,
                         const int64_t *sizes, double threshold, int64_t min_live, int kill,
                         int64_t *live, int nthreads);
int comera_gate_prox_f64(int64_t num_gates, double *const *gates, int8_t *const *signs,
                         const int64_t *sizes, double threshold, int64_t min_live, int kill,
                         int64_t *live, int nthreads);

#ifdef __cplusplus
}
#endif
#endif
