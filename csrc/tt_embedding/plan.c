/* TT embedding, device-neutral half: the descriptor and batch checks, the
 * derived sizes (shape.h), index sorting and grouping, the planner, and
 * comera_tt_embedding_prepare, which validates a table once per call for
 * the CPU kernels (cpu_f32.c, cpu_f64.c) and the CUDA launchers (cuda.cu).
 * The format is in docs/design.md section 3. */
#include "tt_embedding/shape.h"
#include "common/gemm.h"

#include <stdlib.h>
#include <string.h>

static int mul_ok(int64_t a, int64_t b, int64_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
static int add_ok(int64_t a, int64_t b, int64_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

/* Micro-kernel slots of an M x N product K deep: 6-row, 16-column tiles. */
static double tile_slots(int64_t M, int64_t N, int64_t K) {
    return (double)((M + 5) / 6 * 6) * (double)((N + 15) / 16 * 16) * (double)K;
}

int comera_emb_shape_build(const comera_tt_embedding_desc *d, emb_shape *s) {
    if (!d || !d->row_modes || !d->dim_modes || !d->ranks) return COMERA_ERR_ARG;
    if (d->num_cores < 2 || d->num_cores > COMERA_MAX_CORES) return COMERA_ERR_ARG;
    memset(s, 0, sizeof *s);
    int D = s->d = d->num_cores;
    for (int k = 0; k < D; k++) {
        s->v[k] = d->row_modes[k];
        s->e[k] = d->dim_modes[k];
        if (s->v[k] < 1 || s->e[k] < 1) return COMERA_ERR_ARG;
    }
    for (int k = 0; k <= D; k++) {
        s->r[k] = d->ranks[k];
        if (s->r[k] < 1) return COMERA_ERR_ARG;
    }
    if (s->r[0] != 1 || s->r[D] != 1) return COMERA_ERR_ARG;

    int64_t rows_pad = 1, t;
    for (int k = D - 1; k >= 0; k--) {
        s->vstride[k] = rows_pad;
        if (!mul_ok(rows_pad, s->v[k], &rows_pad)) return COMERA_ERR_OVERFLOW;
    }
    s->E[0] = s->e[0];
    for (int k = 1; k < D; k++)
        if (!mul_ok(s->E[k - 1], s->e[k], &s->E[k])) return COMERA_ERR_OVERFLOW;
    s->dim_pad = s->E[D - 1];
    s->num = d->num_embeddings;
    s->dim = d->embedding_dim;
    s->padding_idx = d->padding_idx;
    if (s->num < 1 || s->num > rows_pad || s->dim < 1 || s->dim > s->dim_pad)
        return COMERA_ERR_ARG;
    if (s->padding_idx < -1 || s->padding_idx >= s->num) return COMERA_ERR_ARG;

    s->core_off[0] = 0;
    for (int k = 0; k < D; k++) {
        if (!mul_ok(s->r[k], s->v[k], &t) || !mul_ok(t, s->e[k], &t) ||
            !mul_ok(t, s->r[k + 1], &t) || !add_ok(s->core_off[k], t, &s->core_off[k + 1]))
            return COMERA_ERR_OVERFLOW;
    }
    /* per-thread states and accumulators; also bounds every E[k] r[k+1] */
    s->state_off[0] = s->state_off[1] = 0;
    s->acc_off[0] = 0;
    for (int k = 0; k < D - 1; k++) {
        if (!mul_ok(s->E[k], s->r[k + 1], &t)) return COMERA_ERR_OVERFLOW;
        if (!add_ok(s->acc_off[k], t, &s->acc_off[k + 1])) return COMERA_ERR_OVERFLOW;
        if (k >= 1 && !add_ok(s->state_off[k], t, &s->state_off[k + 1]))
            return COMERA_ERR_OVERFLOW;
    }
    s->pf_off[1] = s->pb_off[1] = 0;
    s->pack_scratch = 1;
    s->row_flops = 0.0;
    for (int k = 1; k < D; k++) {
        int64_t N, sz;
        if (!mul_ok(s->e[k], s->r[k + 1], &N) || !mul_ok(N, 16, &t) ||
            !mul_ok(s->r[k] + 16, t, &t) || !mul_ok(s->E[k - 1] + 16, t, &t))
            return COMERA_ERR_OVERFLOW; /* bounds every packed size below */
        s->pf_size[k] = comera_gemm_packed_size(s->r[k], N);
        s->pb_size[k] = comera_gemm_packed_size(N, s->r[k]);
        if (!mul_ok(s->v[k], s->pf_size[k], &sz) || !add_ok(s->pf_off[k], sz, &s->pf_off[k + 1]))
            return COMERA_ERR_OVERFLOW;
        if (!mul_ok(s->v[k], s->pb_size[k], &sz) || !add_ok(s->pb_off[k], sz, &s->pb_off[k + 1]))
            return COMERA_ERR_OVERFLOW;
        sz = comera_gemm_packed_size(s->E[k - 1], N);
        if (sz > s->pack_scratch) s->pack_scratch = sz;
        s->level_flops[k] = 2.0 * (double)s->E[k - 1] * (double)s->r[k] * (double)N;
        s->row_flops += s->level_flops[k];
    }
    {
        /* the last level in micro-kernel slots, straight and transposed
         * (packing R^T and writing the result back transposed added) */
        int64_t K = s->r[D - 1], M = s->E[D - 2], N = s->e[D - 1];
        int64_t a = comera_gemm_packed_size(K, M), b = comera_gemm_packed_size(M, K);
        double straight = tile_slots(M, N, K);
        double transposed = tile_slots(N, M, K) + (double)a + (double)(M * N);
        s->last_t = transposed < 0.8 * straight;
        /* the backward's slice gradient: straight (r x e) = R^T X with the
         * row gradient X packed per row, or transposed (e x r) = X^T R with
         * R packed (at most once per row), added back transposed */
        double bwd_straight = tile_slots(K, N, M) + (double)comera_gemm_packed_size(M, N);
        double bwd_transposed = tile_slots(N, K, M) + (double)b + (double)(K * N);
        s->last_bwd_t = s->last_t || bwd_transposed < 0.8 * bwd_straight;
        int any_t = s->last_t || s->last_bwd_t;
        s->t_pack = any_t ? (a > b ? a : b) : 0;
        s->t_out = any_t ? N * (M > K ? M : K) : 0;
    }
    /* room for per-thread copies of every workspace, with margin */
    int64_t per = s->core_off[D] + s->acc_off[D - 1] + s->state_off[D - 1] + s->pack_scratch +
                  s->dim_pad + s->t_pack + s->t_out;
    if (!mul_ok(per, 8 * 256, &t) || !mul_ok(s->pf_off[D] + s->pb_off[D], 16, &t))
        return COMERA_ERR_OVERFLOW;
    return COMERA_OK;
}

int comera_tt_embedding_check(const comera_tt_embedding_desc *d) {
    emb_shape s;
    return comera_emb_shape_build(d, &s);
}

/* The C kernels' answer to COMERA_REUSE_AUTO: sorting costs about
 * COMERA_EMB_SORT_FLOPS_PER_INDEX per index, so cheaper rows are recomputed. */
static int resolve_reuse(const emb_shape *s, int reuse) {
    if (reuse != COMERA_REUSE_AUTO) return reuse;
    return s->row_flops < COMERA_EMB_SORT_FLOPS_PER_INDEX ? COMERA_REUSE_NONE
                                                         : COMERA_REUSE_PREFIX;
}

int comera_tt_embedding_prepare(const comera_tt_embedding_desc *d, int reuse,
                                comera_tt_embedding_prep *out) {
    if (!out) return COMERA_ERR_ARG;
    int rc = comera_emb_shape_build(d, &out->shape);
    if (rc) return rc;
    if (reuse < COMERA_REUSE_AUTO || reuse > COMERA_REUSE_PREFIX) return COMERA_ERR_ARG;
    out->reuse = reuse;
    out->reuse_resolved = resolve_reuse(&out->shape, reuse);
    return COMERA_OK;
}

int64_t comera_emb_used(const comera_tt_embedding_batch *b) {
    return b->mode == COMERA_EMB_PLAIN ? b->n : b->offsets[b->num_bags];
}

int comera_tt_embedding_check_batch(const comera_tt_embedding_prep *p,
                                    const comera_tt_embedding_batch *b, int64_t *bad) {
    if (!p) return COMERA_ERR_ARG;
    const emb_shape s = p->shape;
    if (!b || b->n < 0 || (b->n > 0 && !b->indices)) return COMERA_ERR_ARG;
    if (b->mode < COMERA_EMB_PLAIN || b->mode > COMERA_EMB_MEAN) return COMERA_ERR_ARG;
    int64_t t;
    /* n + 1 itself may overflow (n near INT64_MAX): checked too */
    if (!add_ok(b->n, 1, &t) || !mul_ok(t, s.dim_pad, &t) || !mul_ok(t, 16, &t))
        return COMERA_ERR_OVERFLOW;
    for (int64_t p = 0; p < b->n; p++)
        if (b->indices[p] < 0 || b->indices[p] >= s.num) {
            if (bad) *bad = p;
            return COMERA_ERR_INDEX;
        }
    if (b->mode == COMERA_EMB_PLAIN) return COMERA_OK;
    if (b->num_bags < 0 || !b->offsets) return COMERA_ERR_ARG;
    if (!add_ok(b->num_bags, 1, &t) || !mul_ok(t, s.dim_pad, &t) || !mul_ok(t, 16, &t))
        return COMERA_ERR_OVERFLOW;
    for (int64_t i = 0; i <= b->num_bags; i++) {
        int64_t o = b->offsets[i];
        if ((i == 0 && o != 0) || (i > 0 && o < b->offsets[i - 1]) || o > b->n ||
            (i == b->num_bags && o != b->n)) {
            if (bad) *bad = i;
            return COMERA_ERR_OFFSETS;
        }
    }
    return COMERA_OK;
}

/* ------------------------------------------------------------ index sort */

/* Stable LSD radix sort of (key, pos) pairs by key, 11 bits per pass; only
 * as many passes as the largest key needs.  The result ends in keys/pos. */
#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)

/* Below this many indices an insertion sort beats the radix passes, whose
 * bucket counts alone are 2048 entries a pass. */
#define SMALL_SORT 64

/* keys ascending, pos carried along; stable (equal keys keep their order). */
static void insertion_sort(int64_t n, int64_t *keys, int64_t *pos) {
    for (int64_t i = 1; i < n; i++) {
        int64_t k = keys[i], p = pos[i], j = i;
        for (; j > 0 && keys[j - 1] > k; j--) {
            keys[j] = keys[j - 1];
            pos[j] = pos[j - 1];
        }
        keys[j] = k;
        pos[j] = p;
    }
}

static int radix_sort(int64_t n, int64_t max_key, int64_t *keys, int64_t *pos) {
    if (n < 2) return COMERA_OK;
    if (n <= SMALL_SORT) {
        insertion_sort(n, keys, pos);
        return COMERA_OK;
    }
    int64_t *tk = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *tp = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *count = malloc(sizeof(int64_t) * RADIX);
    if (!tk || !tp || !count) {
        free(tk); free(tp); free(count);
        return COMERA_ERR_NOMEM;
    }
    int64_t *sk = keys, *sp = pos, *dk = tk, *dp = tp;
    for (int shift = 0; shift < 63 && (max_key >> shift) > 0; shift += RADIX_BITS) {
        memset(count, 0, sizeof(int64_t) * RADIX);
        for (int64_t i = 0; i < n; i++) count[(sk[i] >> shift) & (RADIX - 1)]++;
        int64_t total = 0;
        for (int64_t c = 0; c < RADIX; c++) {
            int64_t k = count[c];
            count[c] = total;
            total += k;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t at = count[(sk[i] >> shift) & (RADIX - 1)]++;
            dk[at] = sk[i];
            dp[at] = sp[i];
        }
        int64_t *x = sk; sk = dk; dk = x;
        x = sp; sp = dp; dp = x;
    }
    if (sk != keys) {
        memcpy(keys, sk, sizeof(int64_t) * (size_t)n);
        memcpy(pos, sp, sizeof(int64_t) * (size_t)n);
    }
    free(tk); free(tp); free(count);
    return COMERA_OK;
}

void comera_emb_rows_free(emb_rows *rows) {
    free(rows->keys); /* the whole block */
    memset(rows, 0, sizeof *rows);
}

int comera_emb_rows_build(const emb_shape *s, const comera_tt_embedding_batch *b,
                          int dedup, emb_rows *rows) {
    memset(rows, 0, sizeof *rows);
    int64_t used = comera_emb_used(b), m = 0;
    size_t cap = (size_t)(used > 0 ? used : 1);
    /* one block: keys, pos, start (freed as keys) */
    rows->keys = malloc(sizeof(int64_t) * (3 * cap + 1));
    if (!rows->keys) return COMERA_ERR_NOMEM;
    rows->pos = rows->keys + cap;
    rows->start = rows->pos + cap;
    for (int64_t p = 0; p < used; p++) {
        if (b->indices[p] == s->padding_idx) continue;
        rows->keys[m] = b->indices[p];
        rows->pos[m] = p;
        m++;
    }
    if (!dedup) {
        for (int64_t u = 0; u <= m; u++) rows->start[u] = u;
        rows->count = m;
        return COMERA_OK;
    }
    int rc = radix_sort(m, s->num - 1, rows->keys, rows->pos);
    if (rc) {
        comera_emb_rows_free(rows);
        return rc;
    }
    /* compact keys to one per group; start[] marks the groups in pos[] */
    int64_t u = 0;
    for (int64_t j = 0; j < m; j++) {
        if (j > 0 && rows->keys[j] == rows->keys[j - 1]) continue;
        rows->keys[u] = rows->keys[j];
        rows->start[u] = j;
        u++;
    }
    rows->start[u] = m;
    rows->count = u;
    rows->sorted = 1;
    return COMERA_OK;
}

/* A batch of fewer rows than twice the largest mode reads few slices, and
 * packing only those keeps a one-index call from packing whole cores; a
 * larger batch reads nearly all of them and skips the marking. */
unsigned char *comera_emb_used_slices(const emb_shape *s, const emb_rows *rows) {
    int64_t total = 0, vmax = 0;
    for (int k = 0; k < s->d; k++) {
        total += s->v[k];
        if (s->v[k] > vmax) vmax = s->v[k];
    }
    if (rows->count >= 2 * vmax) return NULL;
    unsigned char *used = calloc((size_t)total, 1);
    if (!used) return NULL; /* packing everything is still right */
    for (int64_t u = 0; u < rows->count; u++) {
        int64_t idx[COMERA_MAX_CORES], off = 0;
        emb_unravel(s, rows->keys[u], idx);
        for (int k = 0; k < s->d; k++) {
            used[off + idx[k]] = 1;
            off += s->v[k];
        }
    }
    return used;
}

/* -------------------------------------------------------------- planner */

/* Calibration of the same two-core machine as the TT linear planner: the
 * per-row products are small (a few thousand multiply-adds), so they run
 * at a fraction of the GEMM peak. */
#define EMB_FLOPS_PER_S 2e10

int comera_tt_embedding_make_plan(const comera_tt_embedding_desc *d,
                                  const comera_tt_embedding_batch *b,
                                  comera_tt_embedding_plan *plan) {
    comera_tt_embedding_prep prep;
    int rc = comera_tt_embedding_prepare(d, COMERA_REUSE_AUTO, &prep);
    if (!rc) rc = comera_tt_embedding_check_batch(&prep, b, NULL);
    if (rc) return rc;
    const emb_shape s = prep.shape;
    memset(plan, 0, sizeof *plan);
    emb_rows rows;
    rc = comera_emb_rows_build(&s, b, 1, &rows);
    if (rc) return rc;
    plan->rows = rows.count > 0 ? rows.start[rows.count] : 0;
    plan->unique = rows.count;
    for (int k = 0; k < s.d; k++) {
        int64_t distinct = 0, prev = -1;
        for (int64_t u = 0; u < rows.count; u++) {
            int64_t prefix = rows.keys[u] / s.vstride[k];
            if (u == 0 || prefix != prev) distinct++;
            prev = prefix;
        }
        plan->prefixes[k] = distinct;
    }
    comera_emb_rows_free(&rows);
    double sort = COMERA_EMB_SORT_FLOPS_PER_INDEX * (double)plan->rows;
    plan->flops[COMERA_REUSE_NONE] = (double)plan->rows * s.row_flops;
    plan->flops[COMERA_REUSE_DEDUP] = (double)plan->unique * s.row_flops;
    for (int k = 1; k < s.d; k++)
        plan->flops[COMERA_REUSE_PREFIX] += (double)plan->prefixes[k] * s.level_flops[k];
    for (int r = COMERA_REUSE_NONE; r <= COMERA_REUSE_PREFIX; r++)
        plan->seconds[r] = (plan->flops[r] + (r == COMERA_REUSE_NONE ? 0.0 : sort)) /
                           EMB_FLOPS_PER_S;
    plan->reuse = prep.reuse_resolved;
    return COMERA_OK;
}

