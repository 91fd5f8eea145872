/* TT embedding, what a training forward keeps for its backward: the batch's
 * rows, sorted and grouped, so that the backward does not sort the indices
 * again (measured: about 0.1 ms of a 4096-index step).
 *
 * They go into an int64 array laid out by the position count n (the row
 * count is known only after sorting): a header, then keys[n], start[n + 1]
 * and pos[n], each used up to the row count.  A backward given the array
 * checks it against its own batch first (comera_emb_keep_view): rows of
 * another call are refused, never used as if they were this call's.
 *
 * (Keeping the partial products R_k as well, so that the backward would not
 * recompute them, was measured and dropped: on a machine whose one-thread
 * memory reads run at ~6 GB/s, writing them out and reading them back cost
 * as much as recomputing them; docs/design.md section 5.) */
#include "tt_embedding/shape.h"

#include <stdlib.h>
#include <string.h>

enum { KEEP_MAGIC_AT, KEEP_USED_AT, KEEP_M_AT, KEEP_COUNT_AT, KEEP_REUSE_AT, KEEP_HEADER };
#define KEEP_MAGIC 0x636f6d657261LL /* "comera" */

int64_t comera_tt_embedding_keep_words(const comera_tt_embedding_batch *b) {
    int64_t n = comera_emb_used(b), words;
    if (n < 0 || __builtin_mul_overflow(n, (int64_t)3, &words) ||
        __builtin_add_overflow(words, (int64_t)KEEP_HEADER + 1, &words))
        return -1;
    return words;
}

int comera_tt_embedding_keep_rows(const comera_tt_embedding_prep *p,
                                  const comera_tt_embedding_batch *b, int64_t *words,
                                  int64_t nwords) {
    int64_t n = comera_emb_used(b);
    if (!words || nwords != comera_tt_embedding_keep_words(b)) return COMERA_ERR_ARG;
    emb_rows rows;
    int rc = comera_emb_rows_build(&p->shape, b, p->reuse_resolved != COMERA_REUSE_NONE, &rows);
    if (rc) return rc;
    int64_t m = rows.count > 0 ? rows.start[rows.count] : 0;
    words[KEEP_MAGIC_AT] = KEEP_MAGIC;
    words[KEEP_USED_AT] = n;
    words[KEEP_M_AT] = m;
    words[KEEP_COUNT_AT] = rows.count;
    words[KEEP_REUSE_AT] = p->reuse_resolved;
    int64_t *keys = words + KEEP_HEADER, *start = keys + n, *pos = start + n + 1;
    memcpy(keys, rows.keys, sizeof(int64_t) * (size_t)rows.count);
    memcpy(start, rows.start, sizeof(int64_t) * (size_t)(rows.count + 1));
    memcpy(pos, rows.pos, sizeof(int64_t) * (size_t)m);
    /* the unused tails zeroed: the same batch always gives the same words */
    memset(keys + rows.count, 0, sizeof(int64_t) * (size_t)(n - rows.count));
    memset(start + rows.count + 1, 0, sizeof(int64_t) * (size_t)(n - rows.count));
    memset(pos + m, 0, sizeof(int64_t) * (size_t)(n - m));
    comera_emb_rows_free(&rows);
    return COMERA_OK;
}

/* Whether the kept rows describe batch b exactly: every non-padding
 * position in exactly one row, with that row's key, ascending within the
 * row; sorted distinct keys when the strategy sorts, else one position per
 * row in input order. */
static int keep_rows_match(const emb_shape *s, const comera_tt_embedding_batch *b,
                           const emb_rows *rows, int64_t m) {
    int64_t n = comera_emb_used(b), live = 0;
    for (int64_t p = 0; p < n; p++) live += b->indices[p] != s->padding_idx;
    if (live != m || rows->start[0] != 0 || rows->start[rows->count] != m) return 0;
    unsigned char *seen = calloc((size_t)n + 1, 1);
    if (!seen) return 0;
    int ok = 1;
    for (int64_t u = 0; ok && u < rows->count; u++) {
        int64_t key = rows->keys[u], j0 = rows->start[u], j1 = rows->start[u + 1];
        ok = j1 > j0 && (rows->sorted ? u == 0 || key > rows->keys[u - 1]
                                      : j1 == j0 + 1 && (u == 0 || rows->pos[j0] > rows->pos[j0 - 1]));
        for (int64_t j = j0; ok && j < j1; j++) {
            int64_t p = rows->pos[j];
            ok = p >= 0 && p < n && !seen[p] && b->indices[p] == key &&
                 (j == j0 || p > rows->pos[j - 1]);
            if (ok) seen[p] = 1;
        }
    }
    free(seen);
    return ok;
}

int comera_emb_keep_view(const emb_shape *s, const comera_tt_embedding_batch *b, int reuse,
                         const int64_t *words, int64_t nwords, emb_rows *rows) {
    int64_t n = comera_emb_used(b);
    memset(rows, 0, sizeof *rows);
    if (nwords != comera_tt_embedding_keep_words(b) || words[KEEP_MAGIC_AT] != KEEP_MAGIC ||
        words[KEEP_USED_AT] != n || words[KEEP_REUSE_AT] != reuse)
        return COMERA_ERR_KEPT;
    int64_t m = words[KEEP_M_AT], count = words[KEEP_COUNT_AT];
    if (m < 0 || m > n || count < 0 || count > m) return COMERA_ERR_KEPT;
    rows->count = count;
    rows->keys = (int64_t *)(words + KEEP_HEADER); /* a view: never written */
    rows->start = rows->keys + n;
    rows->pos = rows->start + n + 1;
    rows->sorted = reuse != COMERA_REUSE_NONE;
    if (!keep_rows_match(s, b, rows, m)) {
        memset(rows, 0, sizeof *rows);
        return COMERA_ERR_KEPT;
    }
    return COMERA_OK;
}
