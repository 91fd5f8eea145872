/* gate_prox: the rule applied to one gate (see comera/gate_prox.h), one text
 * for the C kernel (cpu_impl.h) and the CUDA kernel (cuda.cu, one thread per
 * gate), so that the two cannot drift apart.
 *
 * In C, REAL (float or double) is defined before this is included, as for
 * cpu_impl.h.  In C++ (nvcc, or the host emulation of tests/cuda_emu, both
 * after common/cuda_common.cuh) the functions on gate entries are templates
 * over the element type REAL, host and device, reading bfloat16 and float16
 * through their accumulator type.  Either way an entry's value is compared
 * as a double: exact for every element type, so the rule decides alike on
 * every device. */
#ifndef COMERA_GATE_PROX_RULE_H
#define COMERA_GATE_PROX_RULE_H

#include <math.h>
#include <stdint.h>

#ifdef __cplusplus
#define GATE_HD __host__ __device__
#define GATE_TEMPLATE template <typename REAL>

template <typename T> static inline GATE_HD double gate_value(T v) {
    return (double)comera_cuda::to_acc<typename comera_cuda::Acc<T>::type>(v);
}

template <typename T> static inline GATE_HD void gate_set_zero(T *g) {
    typedef typename comera_cuda::Acc<T>::type A;
    *g = comera_cuda::from_acc<T, A>((A)0);
}
#else
#ifndef REAL
#error "define REAL (float or double) before including gate_prox/rule.h"
#endif
#define GATE_HD
#define GATE_TEMPLATE

static inline double gate_value(REAL v) { return (double)v; }

static inline void gate_set_zero(REAL *g) { *g = 0; }
#endif

static inline GATE_HD int8_t gate_sign(double v) { return v > 0 ? 1 : v < 0 ? -1 : 0; }

/* Pass 1 marks a doomed entry's sign 2 (or -2) until pass 3. */
static inline GATE_HD int gate_doomed(int8_t s) { return s == 2 || s == -2; }

/* Pass 1: entries already dead (s == 0) are zeroed.  Without kill, the live
 * ones take the sign they have now; with kill, those at or below threshold
 * or whose sign flipped are doomed.  Returns the live count and adds the
 * doomed ones to *doomed. */
GATE_TEMPLATE static inline GATE_HD int64_t gate_classify(REAL *g, int8_t *s, int64_t n,
                                                          double threshold, int kill,
                                                          int64_t *doomed) {
    int64_t live = 0;
    for (int64_t i = 0; i < n; i++) {
        if (s[i] == 0) {
            gate_set_zero(&g[i]);
            continue;
        }
        double v = gate_value(g[i]);
        int8_t now = gate_sign(v);
        if (!kill) {
            if (now != 0) s[i] = now;
            live++;
        } else if (fabs(v) <= threshold || now != s[i]) {
            s[i] = (int8_t)(2 * (now != 0 ? now : 1));
            (*doomed)++;
        } else {
            live++;
        }
    }
    return live;
}

/* Pass 2: while fewer than min_live entries live, the largest doomed
 * non-zero one is spared.  Returns the live count afterwards. */
GATE_TEMPLATE static inline GATE_HD int64_t gate_rescue(const REAL *g, int8_t *s, int64_t n,
                                                        int64_t live, int64_t doomed,
                                                        int64_t min_live) {
    while (live < min_live && doomed > 0) {
        int64_t best = -1;
        double best_abs = 0.0;
        for (int64_t i = 0; i < n; i++) {
            if (gate_doomed(s[i]) && fabs(gate_value(g[i])) > best_abs) {
                best_abs = fabs(gate_value(g[i]));
                best = i;
            }
        }
        if (best < 0) break; /* the rest are exactly zero: nothing to keep */
        s[best] = (int8_t)(s[best] / 2);
        live++;
        doomed--;
    }
    return live;
}

/* Pass 3: the doomed die. */
GATE_TEMPLATE static inline GATE_HD void gate_bury(REAL *g, int8_t *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (gate_doomed(s[i])) {
            s[i] = 0;
            gate_set_zero(&g[i]);
        }
    }
}

/* One gate, entries g and signs s: returns its live count afterwards. */
GATE_TEMPLATE static inline GATE_HD int64_t gate_prox_one(REAL *g, int8_t *s, int64_t n,
                                                          double threshold, int64_t min_live,
                                                          int kill) {
    int64_t doomed = 0;
    int64_t live = gate_classify(g, s, n, threshold, kill, &doomed);
    live = gate_rescue(g, s, n, live, doomed, min_live);
    gate_bury(g, s, n);
    return live;
}

#endif
