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

/* ---- the whole gate step in one call (comera::gate_step_) ----------------
 *
 * What one rank-adaptation step does to the gates before the controller's
 * review (comera/adapt/step.py), all gates of one element type at once:
 *
 *   1. NaN: if any entry of any gate is NaN, nothing changes; live[k] = -1 for
 *      every gate holding one (0 for the others) and, when nan_seen is given
 *      and not yet set, nan_gates[k] = (gate k holds a NaN) and nan_seen = 1;
 *      returns COMERA_GATE_NAN.
 *   2. saliency: for each gate with a gradient (grads[k] != NULL),
 *      saliency = 0.9 saliency + 0.1 |g * grad|, the product rounded to the
 *      element type, the average in float64 with one fused multiply-add
 *      (what torch's add with alpha computes).
 *   3. shrink (amount != NULL and not *frozen): every live entry (signs[k][i]
 *      != 0; dead ones count as 0) becomes sign(g) max(|g| - amount[k], 0) in
 *      the element type.  A gate left with fewer non-zero entries than
 *      need = min(its non-zero entries, min_live) keeps the `need` largest
 *      |g| (ties: the earlier entry) that the shrink zeroed, unshrunk.
 *   4. the proximal rule above (threshold, min_live, kill); live[k] gets the
 *      live count.
 *
 * The pointers in the struct are host pointers for the C kernels and device
 * pointers (in host arrays) for comera_gate_step_cuda.  gates and grads
 * point to elements of the kernel's type (void here so that one struct
 * serves every type); amount holds num_gates of them. */
typedef struct comera_gate_step_args {
    int64_t num_gates;
    void *const *gates;          /* sizes[k] entries each, updated in place */
    int8_t *const *signs;        /* sizes[k] each: +-1 live, 0 dead */
    const void *const *grads;    /* NULL (the table or an entry): no gradient */
    double *const *saliency;     /* sizes[k] float64 each */
    const int64_t *sizes;
    const void *amount;          /* num_gates shrink amounts, NULL: no shrink */
    const uint8_t *frozen;       /* NULL or one flag: nonzero => no shrink */
    uint8_t *nan_seen;           /* NULL: no record of a NaN */
    uint8_t *nan_gates;          /* num_gates flags (with nan_seen) */
    int64_t *live;               /* num_gates live counts (out) */
    double threshold;
    int64_t min_live;
    int kill;
} comera_gate_step_args;

/* Returns COMERA_OK, COMERA_ERR_ARG or COMERA_GATE_NAN.  nthreads <= 0: one. */
int comera_gate_step_f32(const comera_gate_step_args *a, int nthreads);
int comera_gate_step_f64(const comera_gate_step_args *a, int nthreads);

#ifdef __cplusplus
}
#endif
#endif
