/* TT embedding, CPU kernels: the backward of the body shared by float32
 * and float64 (included after cpu_impl.h, whose top comment says how the
 * two types share it, by cpu_f32.c and cpu_f64.c).
 *
 * Grouped level 1 (three or more cores, a large core 1; every strategy):
 * the level-1 backward of a level-1 prefix (i_0, i_1) is not run when the
 * prefix ends.  Its dR_1 (E[0] x e[1] r[2]) stays in a slot, slots grouped
 * by i_1, and after a window of rows each group runs as two products as
 * deep as the group's stacked rows: the core-1 slice gradient (one product
 * instead of one E[0]-deep product per prefix) and the core-0 slice
 * gradients.  Each i_1's slices are then read and written once per window
 * instead of once per prefix. */

/* Bytes of dR_1 slots one thread keeps before its groups run: bounds the
 * scratch whatever the batch size; a window holds most batches' prefixes.
 * (Both sizes can be set when compiling: the C tests make every case
 * grouped, with windows of a few slots.) */
#ifndef COMERA_EMB_GROUP_BYTES
#define COMERA_EMB_GROUP_BYTES ((int64_t)4 << 20)
#endif
/* Grouped only when core 1 has at least this many bytes: then the core-1
 * slices a prefix touches (its gradient, its packed transpose) fall out of
 * a core's L2 between prefixes, and the per-prefix products wait on them
 * (1M x 64 r32, 1.6 MB: 1.4 ms saved of 11.8 per step); with a smaller core
 * 1 grouping saved nothing (400 KB, 800 KB) or cost 0.3 ms (200 KB, whose
 * 2.9 MB of slots left the cache). */
#ifndef COMERA_EMB_GROUP_MIN_CORE_BYTES
#define COMERA_EMB_GROUP_MIN_CORE_BYTES ((int64_t)1 << 20)
#endif

/* One thread's grouped level 1: the window's events (one per level-1
 * prefix as the traversal meets it), their slots grouped by i_1, and room
 * for the stacked products. */
typedef struct emb_group {
    int64_t cap;          /* slots per window */
    int64_t slot_len;     /* elements of a slot: dR_1, E[0] x e[1] r[2] */
    int64_t count;        /* events in this window */
    int64_t *ev_i0, *ev_i1; /* per event, in traversal order */
    int64_t *slot;        /* per event: its slot */
    int64_t *slot_i0;     /* per slot: i_0 of its event */
    int64_t *bucket;      /* v[1] + 1 group starts (slots of i_1 = j: bucket[j] .. bucket[j+1]-1) */
    REAL *dr1;            /* cap slots of E[0] x e[1] r[2] (a reused workspace block) */
    int dr1_cached;
    REAL *stack, *packed; /* stacked core-0 slices / their gradients; packed stacked dR_1 */
    int64_t chunk;        /* slots per stacked product */
} emb_group;

static void emb_group_free(emb_group *g) {
    free(g->ev_i0); free(g->ev_i1); free(g->slot); free(g->slot_i0); free(g->bucket);
    free(g->stack); free(g->packed);
    if (g->dr1) comera_ws_release(g->dr1, g->dr1_cached);
}

static int emb_group_init(emb_group *g, const emb_shape *s) {
    int64_t M = s->E[0], N = s->e[1] * s->r[2], rk = s->r[1];
    memset(g, 0, sizeof *g);
    g->slot_len = M * N;
    g->cap = COMERA_EMB_GROUP_BYTES / ((int64_t)sizeof(REAL) * g->slot_len);
    if (g->cap < 1) g->cap = 1;
    /* stacked products about 256 deep: deep enough for the micro-kernel,
     * small enough that the packed operand stays in cache */
    g->chunk = 256 / M > 1 ? 256 / M : 1;
    g->ev_i0 = malloc(sizeof(int64_t) * (size_t)g->cap);
    g->ev_i1 = malloc(sizeof(int64_t) * (size_t)g->cap);
    g->slot = malloc(sizeof(int64_t) * (size_t)g->cap);
    g->slot_i0 = malloc(sizeof(int64_t) * (size_t)g->cap);
    g->bucket = malloc(sizeof(int64_t) * (size_t)(s->v[1] + 1));
    g->dr1 = comera_ws_acquire(sizeof(REAL) * (size_t)(g->cap * g->slot_len), &g->dr1_cached);
    g->stack = malloc(sizeof(REAL) * (size_t)(g->chunk * M * rk));
    g->packed = malloc(sizeof(REAL) * (size_t)comera_gemm_packed_size(g->chunk * M, N));
    if (!g->ev_i0 || !g->ev_i1 || !g->slot || !g->slot_i0 || !g->bucket || !g->dr1 ||
        !g->stack || !g->packed) {
        emb_group_free(g);
        return COMERA_ERR_NOMEM;
    }
    return COMERA_OK;
}

/* Rows u0.. of a window: its end (at most cap level-1 prefixes, at least
 * one row), each prefix as an event, and the slots grouped by i_1 (events
 * of one i_1 in traversal order).  A window starts every prefix afresh,
 * as a thread's first row does. */
static int64_t emb_group_window(emb_group *g, const emb_shape *s, const emb_rows *rows,
                                int share, int64_t u0, int64_t u1) {
    int64_t idx[COMERA_MAX_CORES], prev[COMERA_MAX_CORES] = {0}, u = u0;
    g->count = 0;
    for (; u < u1; u++) {
        emb_unravel(s, rows->keys[u], idx);
        int fresh = u == u0 || !share || idx[0] != prev[0] || idx[1] != prev[1];
        if (fresh) {
            if (g->count == g->cap) break;
            g->ev_i0[g->count] = idx[0];
            g->ev_i1[g->count] = idx[1];
            g->count++;
        }
        memcpy(prev, idx, sizeof idx);
    }
    int64_t v1 = s->v[1];
    for (int64_t j = 0; j <= v1; j++) g->bucket[j] = 0;
    for (int64_t e = 0; e < g->count; e++) g->bucket[g->ev_i1[e] + 1]++;
    for (int64_t j = 0; j < v1; j++) g->bucket[j + 1] += g->bucket[j];
    /* bucket[j] is now the first slot of i_1 = j; hand slots out in order */
    for (int64_t e = 0; e < g->count; e++) {
        int64_t sl = g->bucket[g->ev_i1[e]]++;
        g->slot[e] = sl;
        g->slot_i0[sl] = g->ev_i0[e];
    }
    /* the loop above moved every start to the next group's: shift back */
    for (int64_t j = v1; j > 0; j--) g->bucket[j] = g->bucket[j - 1];
    g->bucket[0] = 0;
    return u;
}

/* The window's level-1 backward, one group (i_1) at a time, in stacks of
 * up to `chunk` slots: the core-1 slice gradient += R^T X and the core-0
 * slice gradients += X C_1[:, i_1]^T, R the stacked core-0 slices (gated)
 * and X the stacked dR_1. */
static void emb_group_run(const emb_group *g, const emb_ctx *c) {
    const emb_shape *s = c->s;
    int64_t M = s->E[0], N = s->e[1] * s->r[2], rk = s->r[1], ld = s->v[1] * N, n0 = M * rk;
    for (int64_t j = 0; j < s->v[1]; j++)
        for (int64_t a = g->bucket[j]; a < g->bucket[j + 1]; a += g->chunk) {
            int64_t cnt = g->bucket[j + 1] - a < g->chunk ? g->bucket[j + 1] - a : g->chunk;
            int64_t K = cnt * M;
            const REAL *X = g->dr1 + a * g->slot_len;
            for (int64_t q = 0; q < cnt; q++)
                memcpy(g->stack + q * n0, c->eff + g->slot_i0[a + q] * n0, sizeof(REAL) * (size_t)n0);
            gemm_pack_b(K, N, X, N, 1, g->packed);
            gemm_packed(rk, N, K, g->stack, 1, rk, g->packed, c->deff[1] + j * N, ld,
                        COMERA_GEMM_ADD);
            gemm_packed(K, rk, N, X, N, 1, c->pb + s->pb_off[1] + j * s->pb_size[1],
                        g->stack, rk, COMERA_GEMM_STORE);
            for (int64_t q = 0; q < cnt; q++) {
                REAL *dst = c->deff[0] + g->slot_i0[a + q] * n0;
                const REAL *src = g->stack + q * n0;
                for (int64_t i = 0; i < n0; i++) dst[i] += src[i];
            }
        }
}

/* Per-position weight of the output gradient in bag modes:
 * per_sample_weights times 1 / (non-padding entries of the bag) for the
 * mean; bag_of[p] is the bag that holds position p. */
static void emb_bag_scales(const emb_shape *s, const comera_tt_embedding_batch *b,
                           const REAL *psw, int64_t *bag_of, REAL *scale) {
    for (int64_t g = 0; g < b->num_bags; g++) {
        int64_t cnt = 0;
        for (int64_t p = b->offsets[g]; p < b->offsets[g + 1]; p++)
            cnt += b->indices[p] != s->padding_idx;
        REAL inv = b->mode == COMERA_EMB_MEAN && cnt > 0 ? (REAL)1 / (REAL)cnt : (REAL)1;
        for (int64_t p = b->offsets[g]; p < b->offsets[g + 1]; p++) {
            bag_of[p] = g;
            scale[p] = (psw ? psw[p] : (REAL)1) * inv;
        }
    }
}

/* What the per-row backward reads besides the context. */
typedef struct emb_bwd_in {
    const emb_rows *rows;
    const REAL *grad_out;
    const int64_t *bag_of; /* bag modes: the bag of each position, and its weight */
    const REAL *scale;
    int share, direct, bag;
    int64_t dim, dim_pad;
} emb_bwd_in;

/* Rows u0..u1-1 (one thread's chunk, or a window of it): each row's
 * gradient into the last level, prefixes flushed as they end and all of
 * them at u1.  With grp, each level-1 prefix accumulates its dR_1 in its
 * slot for emb_group_run.  g is the thread's row buffer. */
static void emb_bwd_rows(emb_ctx *c, const emb_bwd_in *in, const emb_group *grp,
                         REAL *g, int64_t u0, int64_t u1) {
    const emb_shape *s = c->s;
    const emb_rows *rows = in->rows;
    int d = s->d;
    int64_t dim = in->dim, idx[COMERA_MAX_CORES], prev[COMERA_MAX_CORES], event = 0;
    for (int64_t u = u0; u < u1; u++) {
        emb_unravel(s, rows->keys[u], idx);
        int l = in->share && u > u0 ? emb_first_diff(d, idx, prev) : 0;
        if (l > d - 1) l = d - 1;
        c->same_prefix = l == d - 1; /* as in emb_fwd */
        /* prefixes of length > l end here: flush with the old path */
        if (u > u0)
            for (int k = d - 2; k >= l; k--)
                emb_flush(c, prev, k);
        if (grp && l <= 1) { /* a new level-1 prefix: the window's next event */
            c->acc1 = grp->dr1 + grp->slot[event++] * grp->slot_len;
            c->acc1_fresh = 1;
        }
        emb_chain(c, idx, l < 1 ? 1 : l, d - 2, NULL);
        /* the row's gradient: at one position of a plain lookup that row
         * of grad_out itself, read in place; else summed over its
         * positions in order */
        int64_t j0 = rows->start[u], j1 = rows->start[u + 1];
        const REAL *X = g;
        if (in->direct && j1 - j0 == 1) {
            if (j1 < rows->start[u1]) prefetch_row(in->grad_out + rows->pos[j1] * dim, dim, 0);
            X = in->grad_out + rows->pos[j0] * dim;
        } else {
            memset(g, 0, sizeof(REAL) * (size_t)in->dim_pad);
            for (int64_t j = j0; j < j1; j++) {
                int64_t p = rows->pos[j];
                const REAL *src = in->grad_out + (in->bag ? in->bag_of[p] : p) * dim;
                REAL w = in->bag ? in->scale[p] : (REAL)1;
                /* positions are in no order, so no hardware prefetcher
                 * follows them: fetch the next row while this one sums
                 * (measured: the loads of this loop were its time) */
                if (j + 1 < rows->start[u1]) {
                    int64_t q = rows->pos[j + 1];
                    prefetch_row(in->grad_out + (in->bag ? in->bag_of[q] : q) * dim, dim, 0);
                }
                for (int64_t k = 0; k < dim; k++) g[k] += w * src[k];
            }
        }
        emb_level_bwd(c, idx, d - 1, X);
        memcpy(prev, idx, sizeof idx);
    }
    if (u1 > u0)
        for (int k = d - 2; k >= 0; k--)
            emb_flush(c, prev, k);
    c->acc1 = NULL;
}


/* The rows of a backward call, shared among a team (comera_run_team):
 * thread 0 adds into dcores, thread t > 0 into its own block of priv. */
typedef struct emb_bwd_job {
    const emb_shape *s;
    const emb_rows *rows;
    REAL *ws;
    int64_t per;
    const REAL *eff, *pf, *pb, *last;
    REAL *const *dcores;
    REAL *priv;
    emb_bwd_in in;
    int grouped, rc;
} emb_bwd_job;

static void emb_bwd_team(void *arg, int tid, int team) {
    emb_bwd_job *j = arg;
    const emb_shape *s = j->s;
    int d = s->d;
    int64_t nc = s->core_off[d], u0, u1;
    comera_team_rows(j->rows->count, tid, team, &u0, &u1);
    emb_ctx ctx;
    REAL *g = emb_thread_ctx(&ctx, s, 1, j->ws, tid, j->per, j->eff, j->pf, j->pb, j->last);
    for (int k = 0; k < d; k++)
        ctx.deff[k] = tid == 0 ? j->dcores[k] : j->priv + nc * (tid - 1) + s->core_off[k];
    if (!j->grouped) {
        emb_bwd_rows(&ctx, &j->in, NULL, g, u0, u1);
        return;
    }
    emb_group grp;
    if (emb_group_init(&grp, s)) {
#pragma omp atomic write
        j->rc = COMERA_ERR_NOMEM;
        return;
    }
    for (int64_t w0 = u0, w1; w0 < u1; w0 = w1) {
        w1 = emb_group_window(&grp, s, j->rows, j->in.share, w0, u1);
        emb_bwd_rows(&ctx, &j->in, &grp, g, w0, w1);
        emb_group_run(&grp, &ctx);
    }
    emb_group_free(&grp);
}

static int emb_bwd(const emb_shape *s, const comera_tt_embedding_batch *b,
                   const REAL *psw, int reuse, const REAL *grad_out,
                   const REAL *const *cores, const REAL *const *gates,
                   REAL *const *dcores, REAL *const *dgates, int nthreads) {
    int d = s->d, bag = b->mode != COMERA_EMB_PLAIN, share = reuse == COMERA_REUSE_PREFIX;
    int64_t dim = s->dim, dp = s->dim_pad, nc = s->core_off[d], used = comera_emb_used(b);
    emb_rows rows;
    int rc = comera_emb_rows_build(s, b, reuse != COMERA_REUSE_NONE, &rows);
    if (rc) return rc;
    int nt = comera_threads_for_work(nthreads, rows.count, 3.0 * s->row_flops + 4.0 * (double)dp);
    int direct = !bag && dim == dp; /* grad_out rows are the rows' gradients */
    /* grouped level 1: see the top of this file */
    int grouped = d >= 3 && (s->core_off[2] - s->core_off[1]) * (int64_t)sizeof(REAL) >=
                                COMERA_EMB_GROUP_MIN_CORE_BYTES;
    /* per thread: states, dR accumulators, the row gradient, a packing
     * buffer.  Thread 0 accumulates the gated-core gradients straight into
     * dcores, the others into private copies (priv) added on in thread
     * order, so the sums do not depend on scheduling. */
    emb_ctx ctx0;
    int64_t per = emb_ctx_init(&ctx0, s, NULL, 1) + dp;
    REAL *eff = malloc(sizeof(REAL) * (size_t)s->core_off[1]); /* gated core 0 */
    unsigned char *slice_used = NULL; /* the slices to pack (NULL: all) */
    /* packed slices and the private gradient copies share one reused block */
    int cached = 0;
    int64_t npriv = nc * (nt - 1);
    REAL *pf = comera_ws_acquire(
        sizeof(REAL) * (size_t)(s->pf_off[d] + s->pb_off[d] + npriv + 1), &cached);
    REAL *pb = pf ? pf + s->pf_off[d] : NULL;
    REAL *priv = pf && nt > 1 ? pb + s->pb_off[d] : NULL;
    if (priv) memset(priv, 0, sizeof(REAL) * (size_t)npriv);
    REAL *ws = calloc((size_t)(per * nt), sizeof(REAL));
    int64_t *bag_of = bag ? malloc(sizeof(int64_t) * (size_t)(used + 1)) : NULL;
    REAL *scale = bag ? malloc(sizeof(REAL) * (size_t)(used + 1)) : NULL;
    if (!eff || !pf || !pb || !ws || (nt > 1 && !priv) || (bag && (!bag_of || !scale))) {
        rc = COMERA_ERR_NOMEM;
        goto done;
    }
    for (int k = 0; k < d; k++)
        memset(dcores[k], 0, sizeof(REAL) * (size_t)(s->core_off[k + 1] - s->core_off[k]));
    slice_used = comera_emb_used_slices(s, &rows);
    emb_gated_core0(s, cores, gates, slice_used, eff);
    rc = emb_pack(s, cores, gates, slice_used, pf, pb, nthreads);
    if (rc) goto done;
    if (bag) emb_bag_scales(s, b, psw, bag_of, scale);
    emb_bwd_job job = {.s = s, .rows = &rows, .ws = ws, .per = per, .eff = eff, .pf = pf,
                       .pb = pb, .last = cores[d - 1], .dcores = dcores, .priv = priv,
                       .in = {&rows, grad_out, bag_of, scale, share, direct, bag, dim, dp},
                       .grouped = grouped, .rc = COMERA_OK};
    comera_run_team(nt, emb_bwd_team, &job);
    rc = job.rc;
    for (int th = 1; th < nt; th++) /* fixed order: reproducible sums */
        for (int k = 0; k < d; k++) {
            const REAL *src = priv + nc * (th - 1) + s->core_off[k];
            REAL *dst = dcores[k];
            for (int64_t i = 0; i < s->core_off[k + 1] - s->core_off[k]; i++) dst[i] += src[i];
        }
    emb_finish_grads(s, cores, gates, dcores, dgates, slice_used);
done:
    if (pf) comera_ws_release(pf, cached);
    free(eff); free(slice_used); free(ws); free(bag_of); free(scale);
    comera_emb_rows_free(&rows);
    return rc;
}
