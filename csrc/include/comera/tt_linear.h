/* Tensor-train linear layer kernels: C ABI.
 *
 * Layout (docs/design.md section 2): D = p + q cores, input side first.  Core k
 * (0-based) is a contiguous (r[k], dims[k], r[k+1]) array, dims = in_modes
 * followed by out_modes, r[0] = r[D] = 1.  Gate k (k < D - 1) scales the
 * last rank index of core k.  W^T = V U with V = merge(cores 0..p-1), shape
 * (prod in_modes, r[p]), and U = merge(cores p..D-1), shape
 * (r[p], prod out_modes).  Only the first in_features rows of V and the
 * first out_features columns of U are real; the rest is padding that the
 * kernels never read from x nor write to y.
 *
 * Two evaluation paths:
 *
 *   MERGE       build V and U once per call (batch independent), then per
 *               row block T = x V, y = T U + b; backward S = dy U^T,
 *               dx = S V^T, dU += T^T dy, dV += x^T S, then back through the
 *               merges.  Batch cost 6 B r (in + out) flops.
 *   SEQUENTIAL  contract each row with the cores one at a time and never
 *               build V or U.  No batch-independent work, but more flops per
 *               row whenever the inner ranks exceed the mode sizes.
 *
 * Planner cost model: for each path, forward + backward flops F and the
 * bytes B that must cross main memory (x, y, dy, dx and the cores, read or
 * written once each, plus V and U for MERGE).  The modelled time is
 *     max(F / (eff * FLOPS), B / BANDWIDTH)
 * with FLOPS = 1e11, BANDWIDTH = 2e10 (two-core calibration) and eff = 1 for
 * MERGE, whose batch work runs on the packed micro-kernel, and 0.15 for
 * SEQUENTIAL, whose per-row products are too small for it.  The path with
 * the lower time wins; ties go to MERGE.  The time a plan reports
 * (comera_tt_linear_plan_for) is the same formula at the rates of the kernel
 * variant that runs the call's dtype, per thread.
 */
#ifndef COMERA_TT_LINEAR_H
#define COMERA_TT_LINEAR_H

#include <stdint.h>

#include "comera/dtype.h"
#include "comera/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    COMERA_PATH_AUTO = 0,
    COMERA_PATH_MERGE = 1,
    COMERA_PATH_SEQUENTIAL = 2
};

#define COMERA_MAX_CORES 16

typedef struct comera_tt_linear_desc {
    int32_t num_in;           /* p >= 1 */
    int32_t num_out;          /* q >= 1 */
    const int64_t *in_modes;  /* p entries, each >= 1 */
    const int64_t *out_modes; /* q entries, each >= 1 */
    const int64_t *ranks;     /* p + q + 1 entries, first and last 1 */
    int64_t in_features;      /* 1 <= in_features <= prod(in_modes) */
    int64_t out_features;     /* 1 <= out_features <= prod(out_modes) */
} comera_tt_linear_desc;

/* The micro-kernel variant that runs a plan's products: the one in use in
 * this process (COMERA_ISA) for the plan's element type. */
enum {
    COMERA_KERNEL_GENERIC = 0,
    COMERA_KERNEL_AVX2 = 1,
    COMERA_KERNEL_AVX512 = 2,
    COMERA_KERNEL_AMX = 3,
    COMERA_KERNEL_AVX512BF16 = 4
};

typedef struct comera_tt_linear_plan {
    int32_t path;     /* COMERA_PATH_MERGE or COMERA_PATH_SEQUENTIAL */
    double flops[3];  /* indexed by path; [0] unused */
    double bytes[3];
    double seconds[3]; /* predicted on the plan's kernel and threads */
    int32_t dtype;    /* COMERA_DT_* the costs are for */
    int32_t kernel;   /* COMERA_KERNEL_* */
    int32_t threads;
} comera_tt_linear_plan;

/* Derived sizes and workspace offsets of a layer, computed once with
 * overflow checks by comera_tt_linear_prepare.  Fields are internal (see
 * csrc/tt_linear/shape.h); the struct is public so that callers can keep a
 * prepared call on the stack. */
typedef struct comera_tt_linear_shape {
    int32_t D, p;
    int64_t dims[COMERA_MAX_CORES];
    int64_t r[COMERA_MAX_CORES + 1];
    int64_t core_off[COMERA_MAX_CORES + 1]; /* offsets of cores in one buffer */
    int64_t in, out, in_pad, out_pad, rmid;
    /* merge chains: P_k is the product of cores first..k of its chain */
    int64_t P_off[COMERA_MAX_CORES + 1];
    /* sequential path, one row: Z_k = (r[k], R_k) for k = 0..p, then
     * Y_l = (M_l, r[p + l]) for l = 1..q */
    int64_t R[COMERA_MAX_CORES + 1]; /* R_k = prod dims[k..p-1] */
    int64_t M[COMERA_MAX_CORES + 1]; /* M_l = prod dims[p..p+l-1] */
    int64_t Z_off[COMERA_MAX_CORES + 1];
    int64_t Y_off[COMERA_MAX_CORES + 1];
    int64_t seq_state_max; /* largest single state, for gradient scratch */
    int64_t seq_total;
    double merge_flops;    /* building V and U once */
    double seq_row_flops;  /* forward flops of one row on the sequential path */
} comera_tt_linear_shape;

/* One call, validated and planned: what the kernels take. */
typedef struct comera_tt_linear_prep {
    int32_t path;  /* COMERA_PATH_MERGE or COMERA_PATH_SEQUENTIAL (AUTO resolved) */
    int64_t batch; /* rows */
    comera_tt_linear_shape shape;
} comera_tt_linear_prep;

/* Validates a descriptor, `batch` and `path` (COMERA_PATH_*): counts,
 * positive sizes, and that every size the kernels compute (products of
 * modes and ranks, workspace sizes for `batch` rows) fits in int64.  Builds
 * the shape once and resolves COMERA_PATH_AUTO with the planner.  Returns
 * COMERA_OK or an error (COMERA_ERR_ARG, COMERA_ERR_OVERFLOW); allocates
 * nothing. */
int comera_tt_linear_prepare(const comera_tt_linear_desc *d, int64_t batch, int path,
                             comera_tt_linear_prep *out);

/* The checks of comera_tt_linear_prepare alone. */
int comera_tt_linear_check(const comera_tt_linear_desc *d, int64_t batch);

/* Fills *plan for `batch` rows of element type dtype (COMERA_DT_*) on
 * nthreads threads of this CPU: FLOPs and bytes of both paths, the path
 * (the planner's rule; always MERGE for bfloat16 and float16, whose kernels
 * have no other), the micro-kernel that runs the products, and the time
 * predicted at that kernel's measured per-core rate and the machine's
 * bandwidth: max(flops / rate, bytes / bandwidth).  Returns COMERA_OK or an
 * error code (COMERA_ERR_ARG for an unknown dtype). */
int comera_tt_linear_plan_for(const comera_tt_linear_desc *d, int64_t batch, int dtype,
                              int nthreads, comera_tt_linear_plan *plan);

/* comera_tt_linear_plan_for for float32 on one thread. */
int comera_tt_linear_make_plan(const comera_tt_linear_desc *d, int64_t batch,
                               comera_tt_linear_plan *plan);

/* The kernels take a prepared call and do not check it again.
 *
 * y (batch x out_features) = x (batch x in_features) W^T + bias; also writes
 * t (batch x r[p]) = x V, which the backward reuses.  bias may be NULL.
 * nthreads <= 0 means one thread.  Returns COMERA_OK or COMERA_ERR_NOMEM. */
int comera_tt_linear_fwd_f32(const comera_tt_linear_prep *p, const float *x,
                             const float *const *cores, const float *const *gates,
                             const float *bias, float *y, float *t, int nthreads);
int comera_tt_linear_fwd_f64(const comera_tt_linear_prep *p, const double *x,
                             const double *const *cores, const double *const *gates,
                             const double *bias, double *y, double *t, int nthreads);

/* Gradients: dx (batch x in_features, may be NULL to skip), dcores[k]
 * shaped like core k, dgates[k] like gate k, dbias (may be NULL).  All
 * outputs are overwritten, not accumulated. */
int comera_tt_linear_bwd_f32(const comera_tt_linear_prep *p, const float *dy, const float *x,
                             const float *t, const float *const *cores,
                             const float *const *gates, float *dx, float *const *dcores,
                             float *const *dgates, float *dbias, int nthreads);
int comera_tt_linear_bwd_f64(const comera_tt_linear_prep *p, const double *dy,
                             const double *x, const double *t, const double *const *cores,
                             const double *const *gates, double *dx, double *const *dcores,
                             double *const *dgates, double *dbias, int nthreads);

/* The element types of a bfloat16 / float16 call (comera/dtype.h): act is
 * COMERA_DT_BF16 or COMERA_DT_F16, the type of y, t and dy and of the
 * products; x (and dx) are act or COMERA_DT_F32; the cores, gates, bias
 * (and their gradients) act or COMERA_DT_F32.  The float32 forms are a
 * float32 layer under autocast: its parameters, and an input F.linear would
 * cast, taken as they are. */
typedef struct comera_tt_half_types {
    int32_t act, x, param;
} comera_tt_half_types;

/* Same results as the float32 entry points, in the types above: V and U are
 * built in float32 and rounded to act for the batch products, which
 * accumulate in float32 and round t, y, dx (and the backward's dy U^T)
 * once; the parameter gradients are summed in float32.  Always the merge
 * path: the prepared path is not consulted.  Returns COMERA_OK,
 * COMERA_ERR_NOMEM, or COMERA_ERR_ARG for another combination of types. */
int comera_tt_linear_fwd_half(const comera_tt_linear_prep *p, const comera_tt_half_types *ty,
                              const void *x, const void *const *cores,
                              const void *const *gates, const void *bias, void *y, void *t,
                              int nthreads);
int comera_tt_linear_bwd_half(const comera_tt_linear_prep *p, const comera_tt_half_types *ty,
                              const void *dy, const void *x, const void *t,
                              const void *const *cores, const void *const *gates, void *dx,
                              void *const *dcores, void *const *dgates, void *dbias,
                              int nthreads);

#ifdef __cplusplus
}
#endif
#endif
