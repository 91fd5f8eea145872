/* Tensor-train embedding kernels (TTM format): C ABI.
 *
 * Layout (docs/design.md section 3): d >= 2 cores, core k (0-based) a contiguous
 * (r[k], v[k], e[k], r[k+1]) array, r[0] = r[d] = 1; gate k (k < d - 1)
 * scales the last rank index of core k.  Row t of the table has the
 * row-major multi-index (i_0..i_{d-1}) over the row modes v (i_0 most
 * significant) and is the product over k of the slices C_k[:, i_k, :, :];
 * its entries are ordered row-major over the dim modes e.  Rows
 * num_embeddings..prod(v)-1 and entries embedding_dim..prod(e)-1 are
 * padding: never read, never written.
 *
 * A row is contracted left to right: R_0 = C_0[:, i_0] as an (e_0, r_1)
 * matrix, then R_k = R_{k-1} (E_{k-1} x r_k) times the slice C_k[:, i_k]
 * (r_k x e_k r_{k+1}), where E_k = e_0 ... e_k.  Level k costs
 * 2 E_{k-1} r_k e_k r_{k+1} flops.
 *
 * Reuse strategies (the `reuse` argument):
 *   NONE    every index is contracted on its own, in input order.
 *   DEDUP   the indices are radix-sorted (stable, so positions stay in
 *           input order within a row) and each distinct row is contracted
 *           once, then copied (plain mode) or reduced (bags).
 *   PREFIX  DEDUP, and in sorted order rows that share a prefix
 *           (i_0..i_k) are adjacent, so the partial product R_k is kept and
 *           reused while the prefix lasts: every distinct prefix is
 *           contracted once per thread chunk.  This never costs more flops
 *           than DEDUP and is cheaper than precomputing C_0 C_1 for all
 *           (i_0, i_1) pairs, which contracts pairs nobody asked for.
 *   AUTO    the planner: sorting costs about SORT_FLOPS_PER_INDEX flops of
 *           time per index, so rows cheaper than that are recomputed (NONE),
 *           otherwise PREFIX.
 * comera_tt_embedding_make_plan reports the modelled cost of every strategy
 * for a concrete batch (it sorts the indices to count rows and prefixes).
 *
 * Backward: the output gradient of each distinct row is summed first, over
 * its positions in ascending order, then pushed through the chain; the
 * prefix-sharing path also accumulates the gradient of a shared R_k and
 * pushes it further down only once, when the prefix ends.  Each thread owns
 * a contiguous chunk of the sorted rows and its own core-gradient
 * accumulator; accumulators are summed in thread order, so the result does
 * not depend on the order of the indices (up to the rounding of the
 * per-row sums) and is the same from run to run.
 *
 * Rows equal to padding_idx read as zero and give no gradient; in bags they
 * are left out of the bag (and of the count for the mean), as
 * nn.EmbeddingBag does.
 *
 * Memory: the packed core slices (about twice the cores) live in one
 * process-wide block that is kept between calls and grows to the largest
 * table seen, because fresh pages cost more than packing them; concurrent
 * calls that find it in use allocate their own.
 */
#ifndef COMERA_TT_EMBEDDING_H
#define COMERA_TT_EMBEDDING_H

#include <stdint.h>

#include "comera/status.h"
#include "comera/tt_linear.h" /* COMERA_MAX_CORES */

#ifdef __cplusplus
extern "C" {
#endif

enum {
    COMERA_EMB_PLAIN = 0, /* one output row per index */
    COMERA_EMB_SUM = 1,   /* bags: sum (weighted by per_sample_weights if given) */
    COMERA_EMB_MEAN = 2   /* bags: mean over the bag's non-padding entries */
};

enum {
    COMERA_REUSE_AUTO = 0,
    COMERA_REUSE_NONE = 1,
    COMERA_REUSE_DEDUP = 2,
    COMERA_REUSE_PREFIX = 3
};

/* Modelled cost of sorting one index, in flops of compute time. */
#define COMERA_EMB_SORT_FLOPS_PER_INDEX 512.0

typedef struct comera_tt_embedding_desc {
    int32_t num_cores;        /* d, 2 <= d <= COMERA_MAX_CORES */
    const int64_t *row_modes; /* v, d entries >= 1 */
    const int64_t *dim_modes; /* e, d entries >= 1 */
    const int64_t *ranks;     /* d + 1 entries >= 1, first and last 1 */
    int64_t num_embeddings;   /* 1 <= num_embeddings <= prod(v) */
    int64_t embedding_dim;    /* 1 <= embedding_dim <= prod(e) */
    int64_t padding_idx;      /* -1 (none) or in [0, num_embeddings) */
} comera_tt_embedding_desc;

/* One batch of lookups.  Plain mode: output row p is row indices[p].  Bag
 * modes: bag b covers positions offsets[b] .. offsets[b + 1] - 1; offsets
 * has num_bags + 1 entries (CSR), offsets[0] == 0, non-decreasing, and
 * offsets[num_bags] == n. */
typedef struct comera_tt_embedding_batch {
    int32_t mode;            /* COMERA_EMB_* */
    int64_t n;               /* number of indices, >= 0 */
    const int64_t *indices;
    int64_t num_bags;        /* bag modes only */
    const int64_t *offsets;  /* bag modes only */
} comera_tt_embedding_batch;

typedef struct comera_tt_embedding_plan {
    int32_t reuse;                      /* what AUTO picks for this batch */
    int64_t rows;                       /* indices that need a row (not padding) */
    int64_t unique;                     /* distinct rows among them */
    int64_t prefixes[COMERA_MAX_CORES]; /* [k]: distinct prefixes (i_0..i_k); [d-1] == unique */
    double flops[4];                    /* forward contraction flops per strategy ([0] unused) */
    double seconds[4];                  /* modelled forward time per strategy ([0] unused) */
} comera_tt_embedding_plan;

/* Derived sizes of a table, computed once with overflow checks by
 * comera_tt_embedding_prepare.  Fields are internal (see
 * csrc/tt_embedding/shape.h); the struct is public so that callers can keep
 * a prepared call on the stack. */
typedef struct comera_tt_embedding_shape {
    int32_t d;
    int64_t v[COMERA_MAX_CORES], e[COMERA_MAX_CORES], r[COMERA_MAX_CORES + 1];
    int64_t vstride[COMERA_MAX_CORES];      /* i_k = (t / vstride[k]) % v[k] */
    int64_t E[COMERA_MAX_CORES];            /* E[k] = e[0] * ... * e[k] */
    int64_t core_off[COMERA_MAX_CORES + 1]; /* cores back to back in one buffer */
    int64_t num, dim, dim_pad, padding_idx;
    /* per-thread partial products R_k (E[k] x r[k+1]), k = 1..d-2 */
    int64_t state_off[COMERA_MAX_CORES + 1];
    /* gradient accumulators dR_k, k = 0..d-2 */
    int64_t acc_off[COMERA_MAX_CORES + 1];
    /* pre-packed slices of cores 1..d-1: forward B = C_k[:, i] (r[k] x
     * e[k] r[k+1]) and backward B = C_k[:, i]^T (e[k] r[k+1] x r[k]) */
    int64_t pf_size[COMERA_MAX_CORES], pf_off[COMERA_MAX_CORES + 1];
    int64_t pb_size[COMERA_MAX_CORES], pb_off[COMERA_MAX_CORES + 1];
    int64_t pack_scratch; /* packed dR_k as a B operand (E[k-1] x e[k] r[k+1]) */
    /* The last level writes only e[d-1] columns (r[d] = 1), which fills a
     * 16-wide panel of the micro-kernel badly when e[d-1] is small; then it
     * runs transposed (rows as columns): last_t = 1, with per-thread room
     * t_pack for the packed R^T or R and t_out for the transposed result.
     * last_bwd_t: the backward's slice gradient of the last level runs
     * transposed (R packed once per prefix instead of the row gradient per
     * row); set with last_t, or alone where its own count favours it. */
    int32_t last_t, last_bwd_t;
    int64_t t_pack, t_out;
    double level_flops[COMERA_MAX_CORES]; /* [0] = 0: R_0 is a slice, no work */
    double row_flops;
} comera_tt_embedding_shape;

/* One table and reuse strategy, validated: what the kernels take. */
typedef struct comera_tt_embedding_prep {
    int32_t reuse;          /* as asked (COMERA_REUSE_*), for the CUDA launchers */
    int32_t reuse_resolved; /* AUTO resolved by the C planner, for the C kernels */
    comera_tt_embedding_shape shape;
} comera_tt_embedding_prep;

/* Validates a descriptor (counts, positive sizes, first/last rank 1, the
 * padding row, and that every size the kernels derive fits in int64) and
 * `reuse`, and builds the shape once.  Returns COMERA_OK or an error code;
 * allocates nothing. */
int comera_tt_embedding_prepare(const comera_tt_embedding_desc *d, int reuse,
                                comera_tt_embedding_prep *out);

/* The descriptor checks of comera_tt_embedding_prepare alone. */
int comera_tt_embedding_check(const comera_tt_embedding_desc *d);

/* Validates a batch (host indices and offsets) against a prepared table.
 * On COMERA_ERR_INDEX *bad is the position of the first index out of range;
 * on COMERA_ERR_OFFSETS the position of the first bad offset. */
int comera_tt_embedding_check_batch(const comera_tt_embedding_prep *p,
                                    const comera_tt_embedding_batch *b, int64_t *bad);

/* Fills *plan for this batch.  Returns COMERA_OK or an error code. */
int comera_tt_embedding_make_plan(const comera_tt_embedding_desc *d,
                                  const comera_tt_embedding_batch *b,
                                  comera_tt_embedding_plan *plan);

/* The kernels take a prepared table and a batch that passed
 * comera_tt_embedding_check_batch, and check neither again.
 *
 * Output: (n x embedding_dim) in plain mode, (num_bags x embedding_dim) in
 * bag modes; overwritten.  psw (per-sample weights, n entries) may be NULL;
 * it is ignored in plain mode.  nthreads <= 0 means one thread. */
int comera_tt_embedding_fwd_f32(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const float *psw,
                                const float *const *cores, const float *const *gates,
                                float *out, int nthreads);
int comera_tt_embedding_fwd_f64(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const double *psw,
                                const double *const *cores, const double *const *gates,
                                double *out, int nthreads);

/* Gradients of the cores and gates from grad_out (shaped like the forward
 * output).  dcores[k] like core k, dgates[k] like gate k; overwritten. */
int comera_tt_embedding_bwd_f32(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const float *psw,
                                const float *grad_out, const float *const *cores,
                                const float *const *gates, float *const *dcores,
                                float *const *dgates, int nthreads);
int comera_tt_embedding_bwd_f64(const comera_tt_embedding_prep *p,
                                const comera_tt_embedding_batch *b, const double *psw,
                                const double *grad_out, const double *const *cores,
                                const double *const *gates, double *const *dcores,
                                double *const *dgates, int nthreads);

#ifdef __cplusplus
}
#endif
#endif
