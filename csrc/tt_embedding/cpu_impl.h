/* TT embedding, CPU kernels: the body shared by float32 and float64 (the
 * forward here, the backward in cpu_bwd_impl.h).
 *
 * C has no templates, and one text for both element types keeps them from
 * drifting apart, so the body is compiled twice: cpu_f32.c defines REAL as
 * float and includes both files, cpu_f64.c as double.  Every function here
 * is static and has its plain name (emb_chain, emb_fwd, ...): a name means
 * the same in both units, and grep finds each definition and call.  The
 * GEMM is called through the short names of common/gemm_real.h (gemm_packed,
 * gemm_pack_b, ...), which resolve to comera_gemm_*_f32 or _f64 with REAL.
 * The public entry points (comera_tt_embedding_fwd_f32, ...) are written out
 * by name in cpu_f32.c and cpu_f64.c, as thin wrappers of emb_fwd and
 * emb_bwd.  Checks, index grouping and the planner are in plan.c. */
#ifndef REAL
#error "define REAL (float or double) before including tt_embedding/cpu_impl.h"
#endif

#include "tt_embedding/shape.h"
#include "common/gemm_real.h"
#include "common/threads.h"
#include "common/workspace.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Asks for a row of n values ahead of its use (to read, or to write when
 * `write`), one request per cache line. */
static inline void prefetch_row(const REAL *row, int64_t n, int write) {
    for (int64_t c = 0; c < n; c += 64 / (int64_t)sizeof(REAL)) {
        if (write) __builtin_prefetch(row + c, 1);
        else __builtin_prefetch(row + c, 0);
    }
}

/* dst = src times g on the last index: n values in rows of `cols`, the
 * gate's length (restrict: the loop vectorizes). */
static void emb_gate_rows(REAL *restrict dst, const REAL *restrict src, int64_t n,
                          const REAL *restrict g, int64_t cols) {
    for (int64_t x = 0; x < n; x += cols)
        for (int64_t j = 0; j < cols; j++) dst[x + j] = src[x + j] * g[j];
}

/* Core 0 times gate 0: its slices are the rows' first partial products.
 * Only the slices flagged in `used` (all when it is NULL:
 * comera_emb_used_slices) are made: a few-token lookup reads a few. */
static void emb_gated_core0(const emb_shape *s, const REAL *const *cores,
                            const REAL *const *gates, const unsigned char *used, REAL *eff0) {
    int64_t n = s->e[0] * s->r[1]; /* core 0 is (1, v_0, e_0, r_1) */
    for (int64_t i = 0; i < s->v[0]; i++)
        if (!used || used[i]) emb_gate_rows(eff0 + i * n, cores[0] + i * n, n, gates[0], s->r[1]);
}

/* In place: dcores[k] holds the gradient of the gated core k on entry and
 * the gradient of core k on exit; dgates[k] is overwritten.  Only the
 * slices flagged in `used` (all when it is NULL: comera_emb_used_slices)
 * hold anything else than zeros, so only they are visited: a one-index
 * backward does not sweep whole cores. */
static void emb_finish_grads(const emb_shape *s, const REAL *const *cores,
                             const REAL *const *gates, REAL *const *dcores,
                             REAL *const *dgates, const unsigned char *used) {
    int64_t used_off = 0;
    for (int k = 0; k < s->d - 1; used_off += s->v[k], k++) {
        const REAL *c = cores[k], *g = gates[k];
        REAL *dc = dcores[k], *dg = dgates[k];
        int64_t cols = s->r[k + 1], v = s->v[k], e = s->e[k];
        for (int64_t j = 0; j < cols; j++) dg[j] = 0;
        /* core k is (r_k, v_k, e_k, r_k+1): slice i is e_k rows of each of the r_k blocks */
        for (int64_t a = 0; a < s->r[k]; a++)
            for (int64_t i = 0; i < v; i++) {
                if (used && !used[used_off + i]) continue;
                int64_t row0 = (a * v + i) * e;
                for (int64_t r = row0; r < row0 + e; r++)
                    for (int64_t j = 0; j < cols; j++) {
                        dg[j] += dc[r * cols + j] * c[r * cols + j];
                        dc[r * cols + j] *= g[j];
                    }
            }
    }
}

/* Packs the gated slices C_k[:, i] of cores 1..d-1 once per call (those
 * flagged in `used`, or all when it is NULL: comera_emb_used_slices), so
 * the per-row products run on the micro-kernel without packing: pf as the
 * forward B operand (r[k] x e[k] r[k+1]), pb (if not NULL) transposed for
 * the backward.  Returns COMERA_ERR_NOMEM if a scratch slice cannot be
 * allocated. */
/* The used slices of one core, gated and packed, shared among a team. */
typedef struct emb_pack_job {
    const emb_shape *s;
    int k;
    const unsigned char *use; /* slices to pack (NULL: all) */
    const REAL *core, *g;     /* g: the core's gate, NULL for the last core */
    REAL *pf, *pb;            /* pb: backward only */
    int rc;
} emb_pack_job;

static void emb_pack_slices(void *arg, int tid, int team) {
    emb_pack_job *j = arg;
    const emb_shape *s = j->s;
    int k = j->k;
    int64_t K = s->r[k], rr = s->r[k + 1], N = s->e[k] * rr, rs = s->v[k] * N;
    REAL *slice = malloc(sizeof(REAL) * (size_t)(K * N));
    if (!slice) {
#pragma omp atomic write
        j->rc = COMERA_ERR_NOMEM;
    }
    int64_t i0, i1;
    comera_team_rows(s->v[k], tid, team, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        if (!slice || (j->use && !j->use[i])) continue;
        for (int64_t a = 0; a < K; a++) {
            const REAL *src = j->core + a * rs + i * N;
            REAL *dst = slice + a * N;
            if (!j->g) {
                memcpy(dst, src, sizeof(REAL) * (size_t)N);
                continue;
            }
            emb_gate_rows(dst, src, N, j->g, rr);
        }
        if (j->pf) gemm_pack_b(K, N, slice, N, 1, j->pf + s->pf_off[k] + i * s->pf_size[k]);
        if (j->pb)
            gemm_pack_b(N, K, slice, 1, N, j->pb + s->pb_off[k] + i * s->pb_size[k]);
    }
    free(slice);
}

static int emb_pack(const emb_shape *s, const REAL *const *cores, const REAL *const *gates,
                    const unsigned char *used, REAL *pf, REAL *pb, int nthreads) {
    int64_t used_off = s->v[0];
    for (int k = 1; k < s->d; used_off += s->v[k], k++) {
        /* the last level's forward slices serve only a straight (not
         * transposed) forward; the backward never recomputes that level */
        int no_pf = k == s->d - 1 && (pb || s->last_t);
        if (no_pf && !pb) continue; /* nothing to pack */
        emb_pack_job job = {.s = s, .k = k, .use = used ? used + used_off : NULL,
                            .core = cores[k], .g = k < s->d - 1 ? gates[k] : NULL,
                            .pf = no_pf ? NULL : pf, .pb = pb, .rc = COMERA_OK};
        double flops = (double)((no_pf ? 0 : s->pf_size[k]) + (pb ? s->pb_size[k] : 0));
        comera_run_team(comera_threads_for_work(nthreads, s->v[k], flops), emb_pack_slices,
                        &job);
        if (job.rc) return job.rc;
    }
    return COMERA_OK;
}

/* What one thread's per-row work reads and writes. */
typedef struct emb_ctx {
    const emb_shape *s;
    const REAL *eff;      /* gated core 0 */
    const REAL *pf, *pb;  /* packed slices of cores 1..d-1 */
    const REAL *last;     /* core d-1 itself, for the transposed last level */
    const REAL *const *cores, *const *gates; /* read in place when `unpacked` */
    int unpacked;         /* levels 1..d-1 read their slices in place (few rows) */
    REAL *tail;           /* unpacked: a zero-padded last column panel (gemm_rows) */
    REAL *gated;          /* unpacked: a slice of core k >= 2 times gate k-1 */
    REAL *state;          /* R_k, k = 1..d-2 */
    REAL *acc;            /* dR_k, k = 0..d-2 (backward) */
    REAL *pack;           /* a packed dR_k (backward) */
    REAL *tpack, *tout;   /* transposed last level */
    int same_prefix;      /* this row's R_{d-2} is the previous row's: tpack holds it packed */
    REAL *acc1;           /* grouped level 1 (backward, see cpu_bwd_impl.h): dR_1 of the
                           * current level-1 prefix, kept for one product per core-1 slice */
    int acc1_fresh;       /* acc1 not yet written: the first product stores, no zeroing */
    REAL *deff[COMERA_MAX_CORES]; /* gated-core gradient accumulators (backward) */
} emb_ctx;

/* Carves one thread's scratch out of ws: states, then (backward only)
 * accumulators and the packing buffer, then the transposed-level buffers.
 * Returns the number of elements used; the same call with ws == NULL
 * sizes it. */
static int64_t emb_ctx_init(emb_ctx *c, const emb_shape *s, REAL *ws, int backward) {
    int d = s->d;
    int64_t off = 0;
    memset(c, 0, sizeof *c);
    c->s = s;
    c->state = ws ? ws + off : NULL;
    off += s->state_off[d - 1];
    if (backward) {
        c->acc = ws ? ws + off : NULL;
        off += s->acc_off[d - 1];
        c->pack = ws ? ws + off : NULL;
        off += s->pack_scratch;
    }
    c->tpack = ws ? ws + off : NULL;
    off += s->t_pack;
    c->tout = ws ? ws + off : NULL;
    off += s->t_out;
    int64_t rmax = 1, slice_max = 1;
    for (int k = 1; k < d; k++) {
        if (s->r[k] > rmax) rmax = s->r[k];
        if (k >= 2 && s->r[k] * s->e[k] * s->r[k + 1] > slice_max)
            slice_max = s->r[k] * s->e[k] * s->r[k + 1];
    }
    c->tail = ws ? ws + off : NULL;
    off += rmax * COMERA_GEMM_NR;
    c->gated = ws ? ws + off : NULL;
    off += slice_max;
    return off;
}

/* This thread's context in a parallel region: its own `per` elements of ws,
 * carved by emb_ctx_init, and the inputs all threads share: gated core 0,
 * the packed slices (pb: backward only) and the last core.  Returns the
 * rest of its elements: its row buffer. */
static REAL *emb_thread_ctx(emb_ctx *c, const emb_shape *s, int backward, REAL *ws, int tid,
                            int64_t per,
                            const REAL *eff, const REAL *pf, const REAL *pb, const REAL *last) {
    REAL *mine = ws + per * tid;
    REAL *row = mine + emb_ctx_init(c, s, mine, backward);
    c->eff = eff;
    c->pf = pf;
    c->pb = pb;
    c->last = last;
    return row;
}

/* R_{k-1} of the row with multi-index idx: a slice of core 0, or a state. */
static const REAL *emb_prev_state(const emb_ctx *c, const int64_t *idx, int k) {
    const emb_shape *s = c->s;
    return k == 1 ? c->eff + idx[0] * s->e[0] * s->r[1] : c->state + s->state_off[k - 1];
}

/* The last level transposed: row^T (e x E) = C_{d-1}[:, i]^T (e x r) times
 * R^T (r x E), then transposed into dst (E x e). */
static void emb_last_fwd_t(const emb_ctx *c, const int64_t *idx, REAL *dst) {
    const emb_shape *s = c->s;
    int k = s->d - 1;
    int64_t K = s->r[k], M = s->E[k - 1], N = s->e[k];
    const REAL *R = emb_prev_state(c, idx, k);
    if (!c->same_prefix) gemm_pack_b(K, M, R, 1, K, c->tpack);
    gemm_packed(N, M, K, c->last + idx[k] * N, 1, s->v[k] * N, c->tpack, c->tout, M, 0);
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < N; j++) dst[m * N + j] = c->tout[j * M + m];
}

/* Level k with the slice of core k read where it lies (its rows v_k e_k
 * r_{k+1} apart): for a few rows, packing a slice costs more than its one
 * use.  The states stay ungated: level k >= 2 takes gate k-1 on its slice's
 * rows, R_{k-1} diag(g_{k-1}) C_k[:, i_k], in a copy as large as the slice
 * (scaling the state just written instead stalls on its stores). */
static void emb_level_unpacked(const emb_ctx *c, const int64_t *idx, int k, REAL *C) {
    const emb_shape *s = c->s;
    int64_t N = s->e[k] * s->r[k + 1], K = s->r[k], ldb = s->v[k] * N;
    const REAL *B = c->cores[k] + idx[k] * N;
    if (k >= 2) {
        const REAL *restrict g = c->gates[k - 1], *restrict src = B;
        REAL *restrict dst = c->gated;
        for (int64_t a = 0; a < K; a++)
            for (int64_t j = 0; j < N; j++) dst[a * N + j] = src[a * ldb + j] * g[a];
        B = c->gated;
        ldb = N;
    }
    gemm_rows(s->E[k - 1], N, K, emb_prev_state(c, idx, k), K, 1, B, ldb, C, N, 0, c->tail);
}

/* Levels from..to of the chain for row idx: R_k = R_{k-1} C_k[:, i_k];
 * level d-1 writes the row (dim_pad entries) to dst. */
static void emb_chain(const emb_ctx *c, const int64_t *idx, int from, int to, REAL *dst) {
    const emb_shape *s = c->s;
    for (int k = from; k <= to; k++) {
        if (k == s->d - 1 && s->last_t && !c->unpacked) {
            emb_last_fwd_t(c, idx, dst);
            continue;
        }
        REAL *C = k == s->d - 1 ? dst : c->state + s->state_off[k];
        if (c->unpacked) {
            emb_level_unpacked(c, idx, k, C);
            continue;
        }
        int64_t N = s->e[k] * s->r[k + 1];
        gemm_packed(s->E[k - 1], N, s->r[k], emb_prev_state(c, idx, k), s->r[k], 1,
                    c->pf + s->pf_off[k] + idx[k] * s->pf_size[k], C, N, 0);
    }
}

/* Backward of level k >= 1 given X = d(R_{k-1} C_k[:, i_k]) (E[k-1] x
 * e[k] r[k+1]): the slice gradient += R_{k-1}^T X, dR_{k-1} += X C_k^T. */
static void emb_level_bwd(emb_ctx *c, const int64_t *idx, int k, const REAL *X) {
    const emb_shape *s = c->s;
    int64_t N = s->e[k] * s->r[k + 1], M = s->E[k - 1], rk = s->r[k], ld = s->v[k] * N;
    const REAL *R = emb_prev_state(c, idx, k);
    REAL *dslice = c->deff[k] + idx[k] * N;
    if (k == s->d - 1 && s->last_bwd_t) {
        /* slice gradient transposed: (e x r) = X^T (e x E) times R (E x r) */
        if (!c->same_prefix) gemm_pack_b(M, rk, R, rk, 1, c->tpack);
        gemm_packed(N, rk, M, X, 1, N, c->tpack, c->tout, rk, 0);
        for (int64_t a = 0; a < rk; a++)
            for (int64_t j = 0; j < N; j++) dslice[a * ld + j] += c->tout[j * rk + a];
    } else {
        gemm_pack_b(M, N, X, N, 1, c->pack);
        gemm_packed(rk, N, M, R, 1, rk, c->pack, dslice, ld, 1);
    }
    REAL *dR = c->acc + s->acc_off[k - 1];
    int mode = COMERA_GEMM_ADD;
    if (k == 2 && c->acc1) {
        dR = c->acc1;
        if (c->acc1_fresh) mode = COMERA_GEMM_STORE;
        c->acc1_fresh = 0;
    }
    gemm_packed(M, rk, N, X, N, 1, c->pb + s->pb_off[k] + idx[k] * s->pb_size[k],
                dR, rk, mode);
}

/* The prefix (i_0..i_k) ends: push its accumulated dR_k one level down
 * (with grouped level 1, levels 1 and 0 wait for the grouped products). */
static void emb_flush(emb_ctx *c, const int64_t *idx, int k) {
    const emb_shape *s = c->s;
    if (c->acc1 && k <= 1) return;
    REAL *X = c->acc + s->acc_off[k];
    int64_t n = s->acc_off[k + 1] - s->acc_off[k];
    if (k == 0) {
        REAL *slice = c->deff[0] + idx[0] * n;
        for (int64_t i = 0; i < n; i++) slice[i] += X[i];
    } else {
        emb_level_bwd(c, idx, k, X);
    }
    memset(X, 0, sizeof(REAL) * (size_t)n);
}

/* The rows of a forward call, shared among a team (comera_run_team). */
typedef struct emb_fwd_job {
    const emb_shape *s;
    const emb_rows *rows;
    REAL *ws;                     /* per elements per thread */
    int64_t per;
    const REAL *eff, *pf, *last;  /* gated core 0, packed slices, the last core */
    const REAL *const *cores, *const *gates;
    REAL *out, *rowbuf;           /* rowbuf: bag modes, one row per distinct index */
    int share, bag, inplace, copy_mode, unpacked;
} emb_fwd_job;

static void emb_fwd_rows(void *arg, int tid, int team) {
    const emb_fwd_job *j = arg;
    const emb_shape *s = j->s;
    const emb_rows *rows = j->rows;
    int d = s->d, bag = j->bag, inplace = j->inplace, copy_mode = j->copy_mode;
    int64_t dim = s->dim, dp = s->dim_pad;
    REAL *out = j->out;
    int64_t u0, u1;
    comera_team_rows(rows->count, tid, team, &u0, &u1);
    emb_ctx ctx;
    REAL *scratch = emb_thread_ctx(&ctx, s, 0, j->ws, tid, j->per, j->eff, j->pf, NULL, j->last);
    ctx.cores = j->cores;
    ctx.gates = j->gates;
    ctx.unpacked = j->unpacked;
    int64_t idx[COMERA_MAX_CORES], prev[COMERA_MAX_CORES];
    for (int64_t u = u0; u < u1; u++) {
        emb_unravel(s, rows->keys[u], idx);
        int l = j->share && u > u0 ? emb_first_diff(d, idx, prev) : 0;
        if (l > d - 1) l = d - 1;
        /* rows of one prefix (sorted, same thread) share R_{d-2}: the
         * transposed last level packs it once for them all */
        ctx.same_prefix = l == d - 1;
        const int64_t *ps = rows->pos + rows->start[u], *pe = rows->pos + rows->start[u + 1];
        REAL *dst = bag ? j->rowbuf + u * dp : inplace ? out + ps[0] * dim : scratch;
        /* output rows are written in no order: fetch the next ones */
        if (!bag && (inplace || copy_mode != COMERA_GEMM_STREAM) && u + 1 < u1)
            prefetch_row(out + rows->pos[rows->start[u + 1]] * dim, dim, 1);
        emb_chain(&ctx, idx, l < 1 ? 1 : l, d - 1, dst);
        if (!bag)
            for (const int64_t *p = ps + inplace; p < pe; p++) {
                if (p + 1 < pe && copy_mode != COMERA_GEMM_STREAM)
                    prefetch_row(out + p[1] * dim, dim, 1);
                gemm_copy(out + *p * dim, dst, dim, copy_mode);
            }
        memcpy(prev, idx, sizeof idx);
    }
    if (copy_mode == COMERA_GEMM_STREAM) comera_gemm_store_fence();
}

/* The bags of a bag-mode forward from the distinct rows, shared among a team. */
typedef struct emb_bag_job {
    const comera_tt_embedding_batch *b;
    const REAL *psw, *rowbuf;
    const int64_t *uid; /* per index position: its distinct row, -1 for padding */
    REAL *out;
    int64_t dim, dp;
} emb_bag_job;

static void emb_bag_sums(void *arg, int tid, int team) {
    const emb_bag_job *j = arg;
    const comera_tt_embedding_batch *b = j->b;
    int64_t dim = j->dim, g0, g1;
    comera_team_rows(b->num_bags, tid, team, &g0, &g1);
    for (int64_t g = g0; g < g1; g++) {
        REAL *o = j->out + g * dim;
        int64_t cnt = 0;
        memset(o, 0, sizeof(REAL) * (size_t)dim);
        for (int64_t p = b->offsets[g]; p < b->offsets[g + 1]; p++) {
            if (j->uid[p] < 0) continue;
            const REAL *row = j->rowbuf + j->uid[p] * j->dp;
            REAL w = j->psw ? j->psw[p] : (REAL)1;
            for (int64_t c = 0; c < dim; c++) o[c] += w * row[c];
            cnt++;
        }
        if (b->mode == COMERA_EMB_MEAN && cnt > 1)
            for (int64_t c = 0; c < dim; c++) o[c] /= (REAL)cnt;
    }
}

static int emb_fwd(const emb_shape *s, const comera_tt_embedding_batch *b,
                   const REAL *psw, int reuse, const REAL *const *cores,
                   const REAL *const *gates, REAL *out, int nthreads) {
    int d = s->d, bag = b->mode != COMERA_EMB_PLAIN, share = reuse == COMERA_REUSE_PREFIX;
    int64_t dim = s->dim, dp = s->dim_pad, used = comera_emb_used(b);
    emb_rows rows;
    int rc = comera_emb_rows_build(s, b, reuse != COMERA_REUSE_NONE, &rows);
    if (rc) return rc;
    int nt = comera_threads_for_work(nthreads, rows.count, s->row_flops + 2.0 * (double)dp);
    int direct = !bag && dim == dp; /* rows land straight in the output */
    /* a row's further positions of an output larger than the cache are
     * copied with streaming stores: no read of lines about to be overwritten */
    int copy_mode = bag ? COMERA_GEMM_STORE
                        : comera_gemm_store_mode(b->n * dim * (int64_t)sizeof(REAL));
    /* sorted rows land at positions in no order: in such an output every
     * row is made in the thread's scratch row and streamed to all its
     * positions (the product writing a random row in place first reads its
     * lines: 30522 x 768 rank 16 Zipf, 1 thread, 0.1 to 0.4 ms of 14);
     * unsorted rows (NONE) go in position order, in place */
    int inplace = direct && !(rows.sorted && copy_mode == COMERA_GEMM_STREAM);
    emb_ctx ctx0;
    int64_t per = emb_ctx_init(&ctx0, s, NULL, 0) + dp;
    /* few rows (the slices they read flagged): each reads its slices in
     * place, and only those of core 0 are gated */
    unsigned char *slice_used = comera_emb_used_slices(s, &rows);
    int unpacked = slice_used != NULL;
    /* one reused block: gated core 0, the threads' scratch, packed slices */
    int64_t eff_n = (s->core_off[1] + 15) / 16 * 16, ws_n = per * nt;
    int cached = 0;
    REAL *eff = comera_ws_acquire(
        sizeof(REAL) * (size_t)(eff_n + ws_n + (unpacked ? 0 : s->pf_off[d]) + 1), &cached);
    REAL *ws = eff ? eff + eff_n : NULL, *pf = eff && !unpacked ? ws + ws_n : NULL;
    REAL *rowbuf = bag ? malloc(sizeof(REAL) * (size_t)(rows.count * dp + 1)) : NULL;
    int64_t *uid = bag ? malloc(sizeof(int64_t) * (size_t)(used + 1)) : NULL;
    if (!eff || (bag && (!rowbuf || !uid))) {
        rc = COMERA_ERR_NOMEM;
        goto done;
    }
    emb_gated_core0(s, cores, gates, slice_used, eff);
    if (!unpacked) rc = emb_pack(s, cores, gates, NULL, pf, NULL, nthreads);
    if (rc) goto done;
    if (!bag && s->padding_idx >= 0)
        for (int64_t p = 0; p < b->n; p++)
            if (b->indices[p] == s->padding_idx) memset(out + p * dim, 0, sizeof(REAL) * (size_t)dim);
    emb_fwd_job job = {.s = s, .rows = &rows, .ws = ws, .per = per, .eff = eff, .pf = pf,
                       .last = cores[d - 1], .cores = cores, .gates = gates, .out = out,
                       .rowbuf = rowbuf, .share = share, .bag = bag, .inplace = inplace,
                       .copy_mode = copy_mode, .unpacked = unpacked};
    comera_run_team(nt, emb_fwd_rows, &job);
    if (bag) {
        for (int64_t p = 0; p < used; p++) uid[p] = -1;
        for (int64_t u = 0; u < rows.count; u++)
            for (int64_t j = rows.start[u]; j < rows.start[u + 1]; j++) uid[rows.pos[j]] = u;
        double per_bag = 2.0 * (double)dim * (double)(b->n / (b->num_bags > 0 ? b->num_bags : 1) + 1);
        int ntb = comera_threads_for_work(nthreads, b->num_bags, per_bag);
        emb_bag_job bj = {.b = b, .psw = psw, .rowbuf = rowbuf, .uid = uid, .out = out,
                          .dim = dim, .dp = dp};
        comera_run_team(ntb, emb_bag_sums, &bj);
    }
done:
    if (eff) comera_ws_release(eff, cached);
    free(slice_used); free(rowbuf); free(uid);
    comera_emb_rows_free(&rows);
    return rc;
}
