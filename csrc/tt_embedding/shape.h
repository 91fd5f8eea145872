/* Derived sizes of a TT embedding and the index bookkeeping shared by the
 * float32 and float64 kernels (internal to csrc/tt_embedding).  Every size
 * is computed once in comera_emb_shape_build (plan.c) with overflow checks,
 * so the kernels use plain int64 arithmetic.  The struct itself is public
 * (comera_tt_embedding_shape) because it is part of a prepared call. */
#ifndef COMERA_TT_EMBEDDING_SHAPE_H
#define COMERA_TT_EMBEDDING_SHAPE_H

#include <stddef.h>

#include "comera/tt_embedding.h"

typedef comera_tt_embedding_shape emb_shape;

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

/* Positions that belong to a bag: offsets[num_bags] (== n) in bag modes, else n. */
int64_t comera_emb_used(const comera_tt_embedding_batch *b);

/* Flags of the core slices a small batch's rows read (used[off_k + i] for
 * slice i of core k, off_k the slices of the cores before k; the caller
 * frees it), or NULL: pack every slice. */
unsigned char *comera_emb_used_slices(const emb_shape *s, const emb_rows *rows);

/* The multi-index (i_0 .. i_{d-1}) of table row t. */
static inline void emb_unravel(const emb_shape *s, int64_t t, int64_t *idx) {
    for (int k = 0; k < s->d; k++) idx[k] = (t / s->vstride[k]) % s->v[k];
}

/* First level whose index differs between two rows (d when equal). */
static inline int emb_first_diff(int d, const int64_t *a, const int64_t *b) {
    int l = 0;
    while (l < d && a[l] == b[l]) l++;
    return l;
}

#endif
