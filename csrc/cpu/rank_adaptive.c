/* The fused proximal step on TT gates (see comera/rank_adaptive.h).  The
 * float32 and float64 versions share one text (rank_adaptive_impl.h). */
#include "comera/rank_adaptive.h"

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
#include "rank_adaptive_impl.h"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "rank_adaptive_impl.h"
#undef REAL
#undef FN
