/* TT embedding kernels for one element type.  Included by tt_embedding.c
 * once per type with REAL (float or double) and FN(name) (adds _f32 / _f64)
 * defined: one text for both types keeps them from drifting apart. */
#include <omp.h>

/* Core k times its gate on the last rank index; the last core has none. */
static void FN(emb_make_eff)(const emb_shape *s, const REAL *const *cores,
                             const REAL *const *gates, REAL *eff) {
    for (int k = 0; k < s->d; k++) {
        const REAL *c = cores[k];
        REAL *out = eff + s->core_off[k];
        int64_t cols = s->r[k + 1], rows = (s->core_off[k + 1] - s->core_off[k]) / cols;
        if (k == s->d - 1) {
            memcpy(out, c, sizeof(REAL) * (size_t)(rows * cols));
            continue;
        }
        const REAL *g = gates[k];
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) out[i * cols + j] = c[i * cols + j] * g[j];
    }
}

/* Core and gate gradients from the gradient of the gated cores. */
static void FN(emb_eff_grads)(const emb_shape *s, const REAL *const *cores,
                              const REAL *const *gates, const REAL *deff,
                              REAL *const *dcores, REAL *const *dgates) {
    for (int k = 0; k < s->d; k++) {
        const REAL *c = cores[k], *de = deff + s->core_off[k];
        REAL *dc = dcores[k];
        int64_t cols = s->r[k + 1], rows = (s->core_off[k + 1] - s->core_off[k]) / cols;
        if (k == s->d - 1) {
            memcpy(dc, de, sizeof(REAL) * (size_t)(rows * cols));
            continue;
        }
        const REAL *g = gates[k];
        REAL *dg = dgates[k];
        for (int64_t j = 0; j < cols; j++) dg[j] = 0;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) {
                dc[i * cols + j] = de[i * cols + j] * g[j];
                dg[j] += de[i * cols + j] * c[i * cols + j];
            }
    }
}

/* Packs every slice C_k[:, i] of cores 1..d-1 once per call, so the per-row
 * products run on the micro-kernel without packing: pf as the forward B
 * operand (r[k] x e[k] r[k+1]), pb (if not NULL) transposed for the
 * backward. */
static void FN(emb_pack)(const emb_shape *s, const REAL *eff, REAL *pf, REAL *pb, int nthreads) {
    for (int k = 1; k < s->d; k++) {
        int64_t N = s->e[k] * s->r[k + 1], rs = s->v[k] * N;
        const REAL *core = eff + s->core_off[k];
        int nt = threads_for(nthreads, s->v[k], (double)(s->pf_size[k] + (pb ? s->pb_size[k] : 0)));
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t i = 0; i < s->v[k]; i++) {
            const REAL *slice = core + i * N;
            FN(comera_gemm_pack_b)(s->r[k], N, slice, rs, 1, pf + s->pf_off[k] + i * s->pf_size[k]);
            if (pb)
                FN(comera_gemm_pack_b)(N, s->r[k], slice, 1, rs, pb + s->pb_off[k] + i * s->pb_size[k]);
        }
    }
}

/* R_{k-1} of the row with multi-index idx: a slice of core 0, or a state. */
static const REAL *FN(emb_prev_state)(const emb_shape *s, const REAL *eff, const int64_t *idx,
                                      const REAL *state, int k) {
    return k == 1 ? eff + idx[0] * s->e[0] * s->r[1] : state + s->state_off[k - 1];
}

/* Levels from..to of the chain for row idx: R_k = R_{k-1} C_k[:, i_k];
 * level d-1 writes the row (dim_pad entries) to dst. */
static void FN(emb_chain)(const emb_shape *s, const REAL *eff, const REAL *pf,
                          const int64_t *idx, int from, int to, REAL *state, REAL *dst) {
    for (int k = from; k <= to; k++) {
        const REAL *A = FN(emb_prev_state)(s, eff, idx, state, k);
        REAL *C = k == s->d - 1 ? dst : state + s->state_off[k];
        int64_t N = s->e[k] * s->r[k + 1];
        FN(comera_gemm_packed)(s->E[k - 1], N, s->r[k], A, s->r[k], 1,
                               pf + s->pf_off[k] + idx[k] * s->pf_size[k], C, N, 0);
    }
}

/* Backward of level k >= 1 given X = d(R_{k-1} C_k[:, i_k]) (E[k-1] x
 * e[k] r[k+1]): the slice gradient += R_{k-1}^T X, dR_{k-1} += X C_k^T. */
static void FN(emb_level_bwd)(const emb_shape *s, const REAL *eff, const REAL *pb,
                              const int64_t *idx, int k, const REAL *state, const REAL *X,
                              REAL *acc, REAL *deff, REAL *pack) {
    int64_t N = s->e[k] * s->r[k + 1], K = s->E[k - 1], rk = s->r[k];
    const REAL *R = FN(emb_prev_state)(s, eff, idx, state, k);
    FN(comera_gemm_pack_b)(K, N, X, N, 1, pack);
    FN(comera_gemm_packed)(rk, N, K, R, 1, rk, pack,
                           deff + s->core_off[k] + idx[k] * N, s->v[k] * N, 1);
    FN(comera_gemm_packed)(K, rk, N, X, N, 1, pb + s->pb_off[k] + idx[k] * s->pb_size[k],
                           acc + s->acc_off[k - 1], rk, 1);
}

/* The prefix (i_0..i_k) ends: push its accumulated dR_k one level down. */
static void FN(emb_flush)(const emb_shape *s, const REAL *eff, const REAL *pb,
                          const int64_t *idx, int k, const REAL *state, REAL *acc,
                          REAL *deff, REAL *pack) {
    REAL *X = acc + s->acc_off[k];
    int64_t n = s->acc_off[k + 1] - s->acc_off[k];
    if (k == 0) {
        REAL *slice = deff + idx[0] * n;
        for (int64_t i = 0; i < n; i++) slice[i] += X[i];
    } else {
        FN(emb_level_bwd)(s, eff, pb, idx, k, state, X, acc, deff, pack);
    }
    memset(X, 0, sizeof(REAL) * (size_t)n);
}

static int FN(emb_fwd)(const emb_shape *s, const comera_tt_embedding_batch *b,
                       const REAL *psw, int reuse, const REAL *const *cores,
                       const REAL *const *gates, REAL *out, int nthreads) {
    int d = s->d, bag = b->mode != COMERA_EMB_PLAIN, share = reuse == COMERA_REUSE_PREFIX;
    int64_t dim = s->dim, dp = s->dim_pad, used = comera_emb_used(b);
    emb_rows rows;
    int rc = comera_emb_rows_build(s, b, reuse != COMERA_REUSE_NONE, &rows);
    if (rc) return rc;
    int nt = threads_for(nthreads, rows.count, s->row_flops + 2.0 * (double)dp);
    int direct = !bag && dim == dp; /* rows land straight in the output */
    int64_t per = s->state_off[d - 1] + dp;
    REAL *eff = malloc(sizeof(REAL) * (size_t)s->core_off[d]);
    REAL *pf = malloc(sizeof(REAL) * (size_t)(s->pf_off[d] > 0 ? s->pf_off[d] : 1));
    REAL *ws = malloc(sizeof(REAL) * (size_t)(per * nt));
    REAL *rowbuf = bag ? malloc(sizeof(REAL) * (size_t)(rows.count * dp + 1)) : NULL;
    int64_t *uid = bag ? malloc(sizeof(int64_t) * (size_t)(used + 1)) : NULL;
    if (!eff || !pf || !ws || (bag && (!rowbuf || !uid))) {
        rc = COMERA_ERR_NOMEM;
        goto done;
    }
    FN(emb_make_eff)(s, cores, gates, eff);
    FN(emb_pack)(s, eff, pf, NULL, nthreads);
    if (!bag && s->padding_idx >= 0)
        for (int64_t p = 0; p < b->n; p++)
            if (b->indices[p] == s->padding_idx) memset(out + p * dim, 0, sizeof(REAL) * (size_t)dim);
#pragma omp parallel num_threads(nt)
    {
        /* the team may be smaller than nt (a nested region runs with one
         * thread), so chunk by the team that actually runs */
        int tid = omp_get_thread_num(), team = omp_get_num_threads();
        int64_t u0 = rows.count * tid / team, u1 = rows.count * (tid + 1) / team;
        REAL *state = ws + per * tid, *scratch = state + s->state_off[d - 1];
        int64_t idx[COMERA_MAX_CORES], prev[COMERA_MAX_CORES];
        for (int64_t u = u0; u < u1; u++) {
            unravel(s, rows.keys[u], idx);
            int l = share && u > u0 ? first_diff(d, idx, prev) : 0;
            if (l > d - 1) l = d - 1;
            const int64_t *ps = rows.pos + rows.start[u], *pe = rows.pos + rows.start[u + 1];
            REAL *dst = bag ? rowbuf + u * dp : direct ? out + ps[0] * dim : scratch;
            FN(emb_chain)(s, eff, pf, idx, l < 1 ? 1 : l, d - 1, state, dst);
            if (!bag)
                for (const int64_t *p = ps + direct; p < pe; p++)
                    memcpy(out + *p * dim, dst, sizeof(REAL) * (size_t)dim);
            memcpy(prev, idx, sizeof idx);
        }
    }
    if (bag) {
        for (int64_t p = 0; p < used; p++) uid[p] = -1;
        for (int64_t u = 0; u < rows.count; u++)
            for (int64_t j = rows.start[u]; j < rows.start[u + 1]; j++) uid[rows.pos[j]] = u;
        double per_bag = 2.0 * (double)dim * (double)(b->n / (b->num_bags > 0 ? b->num_bags : 1) + 1);
        int ntb = threads_for(nthreads, b->num_bags, per_bag);
#pragma omp parallel for num_threads(ntb) schedule(static)
        for (int64_t g = 0; g < b->num_bags; g++) {
            REAL *o = out + g * dim;
            int64_t cnt = 0;
            memset(o, 0, sizeof(REAL) * (size_t)dim);
            for (int64_t p = b->offsets[g]; p < b->offsets[g + 1]; p++) {
                if (uid[p] < 0) continue;
                const REAL *row = rowbuf + uid[p] * dp;
                REAL w = psw ? psw[p] : (REAL)1;
                for (int64_t j = 0; j < dim; j++) o[j] += w * row[j];
                cnt++;
            }
            if (b->mode == COMERA_EMB_MEAN && cnt > 1)
                for (int64_t j = 0; j < dim; j++) o[j] /= (REAL)cnt;
        }
    }
done:
    free(eff); free(pf); free(ws); free(rowbuf); free(uid);
    comera_emb_rows_free(&rows);
    return rc;
}

/* Per-position weight of the output gradient in bag modes:
 * per_sample_weights times 1 / (non-padding entries of the bag) for the
 * mean; bag_of[p] is the bag that holds position p. */
static void FN(emb_bag_scales)(const emb_shape *s, const comera_tt_embedding_batch *b,
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

static int FN(emb_bwd)(const emb_shape *s, const comera_tt_embedding_batch *b,
                       const REAL *psw, int reuse, const REAL *grad_out,
                       const REAL *const *cores, const REAL *const *gates,
                       REAL *const *dcores, REAL *const *dgates, int nthreads) {
    int d = s->d, bag = b->mode != COMERA_EMB_PLAIN, share = reuse == COMERA_REUSE_PREFIX;
    int64_t dim = s->dim, dp = s->dim_pad, nc = s->core_off[d], used = comera_emb_used(b);
    emb_rows rows;
    int rc = comera_emb_rows_build(s, b, reuse != COMERA_REUSE_NONE, &rows);
    if (rc) return rc;
    int nt = threads_for(nthreads, rows.count, 3.0 * s->row_flops + 4.0 * (double)dp);
    /* per thread: core-gradient accumulator, states, dR accumulators, the
     * row gradient, a packing buffer */
    int64_t per = nc + s->state_off[d - 1] + s->acc_off[d - 1] + dp + s->pack_scratch;
    REAL *eff = malloc(sizeof(REAL) * (size_t)nc);
    REAL *pf = malloc(sizeof(REAL) * (size_t)(s->pf_off[d] > 0 ? s->pf_off[d] : 1));
    REAL *pb = malloc(sizeof(REAL) * (size_t)(s->pb_off[d] > 0 ? s->pb_off[d] : 1));
    REAL *ws = calloc((size_t)(per * nt), sizeof(REAL));
    REAL *dsum = calloc((size_t)nc, sizeof(REAL));
    int64_t *bag_of = bag ? malloc(sizeof(int64_t) * (size_t)(used + 1)) : NULL;
    REAL *scale = bag ? malloc(sizeof(REAL) * (size_t)(used + 1)) : NULL;
    if (!eff || !pf || !pb || !ws || !dsum || (bag && (!bag_of || !scale))) {
        rc = COMERA_ERR_NOMEM;
        goto done;
    }
    FN(emb_make_eff)(s, cores, gates, eff);
    FN(emb_pack)(s, eff, pf, pb, nthreads);
    if (bag) FN(emb_bag_scales)(s, b, psw, bag_of, scale);
#pragma omp parallel num_threads(nt)
    {
        /* chunk by the team that actually runs (see emb_fwd); accumulators
         * of threads that never ran stay zero */
        int tid = omp_get_thread_num(), team = omp_get_num_threads();
        int64_t u0 = rows.count * tid / team, u1 = rows.count * (tid + 1) / team;
        REAL *deff = ws + per * tid, *state = deff + nc;
        REAL *acc = state + s->state_off[d - 1], *g = acc + s->acc_off[d - 1], *pack = g + dp;
        int64_t idx[COMERA_MAX_CORES], prev[COMERA_MAX_CORES];
        for (int64_t u = u0; u < u1; u++) {
            unravel(s, rows.keys[u], idx);
            int l = share && u > u0 ? first_diff(d, idx, prev) : 0;
            if (l > d - 1) l = d - 1;
            /* prefixes of length > l end here: flush with the old path */
            if (u > u0)
                for (int k = d - 2; k >= l; k--)
                    FN(emb_flush)(s, eff, pb, prev, k, state, acc, deff, pack);
            FN(emb_chain)(s, eff, pf, idx, l < 1 ? 1 : l, d - 2, state, NULL);
            /* the row's gradient, summed over its positions in order */
            memset(g, 0, sizeof(REAL) * (size_t)dp);
            for (int64_t j = rows.start[u]; j < rows.start[u + 1]; j++) {
                int64_t p = rows.pos[j];
                const REAL *src = grad_out + (bag ? bag_of[p] : p) * dim;
                REAL w = bag ? scale[p] : (REAL)1;
                for (int64_t c = 0; c < dim; c++) g[c] += w * src[c];
            }
            FN(emb_level_bwd)(s, eff, pb, idx, d - 1, state, g, acc, deff, pack);
            memcpy(prev, idx, sizeof idx);
        }
        if (u1 > u0)
            for (int k = d - 2; k >= 0; k--)
                FN(emb_flush)(s, eff, pb, prev, k, state, acc, deff, pack);
    }
    for (int th = 0; th < nt; th++) { /* fixed order: reproducible sums */
        const REAL *deff = ws + per * th;
        for (int64_t i = 0; i < nc; i++) dsum[i] += deff[i];
    }
    FN(emb_eff_grads)(s, cores, gates, dsum, dcores, dgates);
done:
    free(eff); free(pf); free(pb); free(ws); free(dsum); free(bag_of); free(scale);
    comera_emb_rows_free(&rows);
    return rc;
}

static int FN(emb_prepare)(const comera_tt_embedding_desc *d, const comera_tt_embedding_batch *b,
                           int *reuse, emb_shape *s) {
    int rc = comera_tt_embedding_check_batch(d, b, NULL);
    if (rc) return rc;
    comera_emb_shape_build(d, s);
    *reuse = comera_emb_resolve_reuse(s, *reuse);
    return *reuse < 0 ? COMERA_ERR_ARG : COMERA_OK;
}

int FN(comera_tt_embedding_fwd)(const comera_tt_embedding_desc *d,
                                const comera_tt_embedding_batch *b, const REAL *psw,
                                int reuse, const REAL *const *cores,
                                const REAL *const *gates, REAL *out, int nthreads) {
    emb_shape s;
    int rc = FN(emb_prepare)(d, b, &reuse, &s);
    if (rc) return rc;
    return FN(emb_fwd)(&s, b, psw, reuse, cores, gates, out, nthreads);
}

int FN(comera_tt_embedding_bwd)(const comera_tt_embedding_desc *d,
                                const comera_tt_embedding_batch *b, const REAL *psw,
                                int reuse, const REAL *grad_out,
                                const REAL *const *cores, const REAL *const *gates,
                                REAL *const *dcores, REAL *const *dgates, int nthreads) {
    emb_shape s;
    int rc = FN(emb_prepare)(d, b, &reuse, &s);
    if (rc) return rc;
    return FN(emb_bwd)(&s, b, psw, reuse, grad_out, cores, gates, dcores, dgates, nthreads);
}
