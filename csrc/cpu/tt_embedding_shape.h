/* Derived sizes of a TT embedding and the index bookkeeping shared by the
 * float32 and float64 kernels (internal).  Every size is computed once in
 * emb_shape_build with overflow checks, so the kernels use plain int64
 * arithmetic. */
#ifndef COMERA_TT_EMBEDDING_SHAPE_H
#define COMERA_TT_EMBEDDING_SHAPE_H

#include <stddef.h>

#include "comera/tt_embedding.h"

typedef struct emb_shape {
    int d;
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
     * t_pack for the packed R^T or R and t_out for the transposed result. */
    int last_t;
    int64_t t_pack, t_out;
    double level_flops[COMERA_MAX_CORES]; /* [0] = 0: R_0 is a slice, no work */
    double row_flops;
} emb_shape;

int comera_emb_shape_build(const comera_tt_embedding_desc *d, emb_shape *s);

/* The rows a batch needs.  Row u is keys[u]; the positions that read it are
 * pos[start[u] .. start[u + 1] - 1], ascending.  With dedup the keys are
 * sorted and distinct; without, row u is the u-th needed position.
 * Padding positions are in no row. */
typedef struct emb_rows {
    int64_t count;
    int64_t *keys, *start, *pos;
    int sorted;
} emb_rows;

int comera_emb_rows_build(const emb_shape *s, const comera_tt_embedding_batch *b,
                          int dedup, emb_rows *rows);
void comera_emb_rows_free(emb_rows *rows);

/* The packed cores (and per-thread gradient copies) are about twice the
 * cores' size and are needed on every call.  Fresh pages from the system
 * cost more than filling them (page faults, zeroing, unmapping: several ms
 * for a 1M-row table), so one grow-only block is kept and reused; a call
 * that finds it in use (concurrent calls) allocates its own.  *cached
 * tells comera_emb_ws_release which case it was. */
void *comera_emb_ws_acquire(size_t bytes, int *cached);
void comera_emb_ws_release(void *block, int cached);

/* Resolves COMERA_REUSE_AUTO; returns -1 for an unknown value. */
int comera_emb_resolve_reuse(const emb_shape *s, int reuse);

/* Positions that belong to a bag: offsets[num_bags] (== n) in bag modes, else n. */
int64_t comera_emb_used(const comera_tt_embedding_batch *b);

#endif
