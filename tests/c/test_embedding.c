/* Standalone tests of the TT embedding kernels (csrc/tt_embedding/cpu_*),
 * no torch needed: forward and backward in plain and bag modes, every reuse
 * strategy, 1 and 3 threads, against a naive reference that builds the
 * table entry by entry and pushes gradients back entry by entry; float32
 * against float64; batch and descriptor checks; the planner.
 * Prints one line per group, then "N passed, M failed"; exits 1 on failure. */
#include "isa_guard.h"
#include "comera/tt_embedding.h"
#include "one_call.h"
#include "common/workspace.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXD 6
#define TOL64 1e-11
#define TOL32 3e-5

static int passed, failed;

static void check(int ok, const char *what, const char *name) {
    if (ok) {
        passed++;
    } else {
        failed++;
        printf("  FAIL %s: %s\n", name, what);
    }
}

static uint64_t rng = 88172645463325252ULL;
static double uniform(double lo, double hi) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return lo + (hi - lo) * (double)(rng >> 11) / 9007199254740992.0;
}

typedef struct {
    const char *name;
    int d;
    int64_t v[MAXD], e[MAXD], r[MAXD + 1];
    int64_t num, dim;
} emb_case;

static const emb_case CASES[] = {
    {"d2 6x4", 2, {2, 3}, {2, 2}, {1, 2, 1}, 6, 4},
    {"d3 padded rows and dims 23x10", 3, {2, 3, 4}, {2, 3, 2}, {1, 2, 5, 1}, 23, 10},
    {"d3 dim mode 1", 3, {3, 2, 4}, {3, 1, 3}, {1, 3, 3, 1}, 20, 9},
    {"d4 TT bound", 4, {2, 2, 2, 2}, {2, 2, 1, 2}, {1, 4, 8, 4, 1}, 16, 8},
    {"d3 r16 wide", 3, {4, 5, 3}, {4, 2, 4}, {1, 16, 12, 1}, 60, 32},
    /* 64 x 16 states, 12-wide last slices (30522 x 768's last level): the
     * forward straight, the backward's slice gradient transposed */
    {"d3 backward-only transposed", 3, {2, 3, 2}, {8, 8, 12}, {1, 16, 16, 1}, 12, 768},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

typedef struct {
    const emb_case *c;
    comera_tt_embedding_desc desc;
    int64_t size[MAXD];
    double *core[MAXD], *gate[MAXD];
    float *core_f[MAXD], *gate_f[MAXD];
} model;

static void model_init(model *m, const emb_case *c, int64_t padding_idx) {
    memset(m, 0, sizeof *m);
    m->c = c;
    m->desc = (comera_tt_embedding_desc){c->d, c->v, c->e, c->r, c->num, c->dim, padding_idx};
    for (int k = 0; k < c->d; k++) {
        m->size[k] = c->r[k] * c->v[k] * c->e[k] * c->r[k + 1];
        m->core[k] = malloc(sizeof(double) * (size_t)m->size[k]);
        m->core_f[k] = malloc(sizeof(float) * (size_t)m->size[k]);
        for (int64_t i = 0; i < m->size[k]; i++) {
            m->core_f[k][i] = (float)uniform(-1, 1);
            m->core[k][i] = m->core_f[k][i];
        }
        if (k < c->d - 1) {
            m->gate[k] = malloc(sizeof(double) * (size_t)c->r[k + 1]);
            m->gate_f[k] = malloc(sizeof(float) * (size_t)c->r[k + 1]);
            for (int64_t i = 0; i < c->r[k + 1]; i++) {
                m->gate_f[k][i] = (float)uniform(0.5, 1.5);
                m->gate[k][i] = m->gate_f[k][i];
            }
        }
    }
}

static void model_free(model *m) {
    for (int k = 0; k < m->c->d; k++) {
        free(m->core[k]); free(m->core_f[k]); free(m->gate[k]); free(m->gate_f[k]);
    }
}

/* Multi-indices of row t and column j. */
static void unravel(const int64_t *modes, int d, int64_t t, int64_t *idx) {
    for (int k = d - 1; k >= 0; k--) {
        idx[k] = t % modes[k];
        t /= modes[k];
    }
}

/* One entry as a product of gated slices; also the left vectors
 * left[k] (1 x r[k]) before core k and right vectors right[k] (r[k+1] x 1)
 * after it, for the gradient.  r <= 16 in every case. */
static double entry(const model *m, int64_t t, int64_t j, double left[MAXD][16],
                    double right[MAXD][16]) {
    const emb_case *c = m->c;
    int64_t ii[MAXD], jj[MAXD];
    unravel(c->v, c->d, t, ii);
    unravel(c->e, c->d, j, jj);
    /* slice (a, b) of gated core k */
#define SL(k, a, b)                                                                         \
    (m->core[k][(((a) * c->v[k] + ii[k]) * c->e[k] + jj[k]) * c->r[(k) + 1] + (b)] *        \
     ((k) < c->d - 1 ? m->gate[k][b] : 1.0))
    left[0][0] = 1.0;
    for (int k = 0; k < c->d - 1; k++)
        for (int64_t b = 0; b < c->r[k + 1]; b++) {
            double s = 0;
            for (int64_t a = 0; a < c->r[k]; a++) s += left[k][a] * SL(k, a, b);
            left[k + 1][b] = s;
        }
    right[c->d - 1][0] = 1.0;
    for (int k = c->d - 1; k > 0; k--)
        for (int64_t a = 0; a < c->r[k]; a++) {
            double s = 0;
            for (int64_t b = 0; b < c->r[k + 1]; b++) s += SL(k, a, b) * right[k][b];
            right[k - 1][a] = s;
        }
    double val = 0;
    for (int64_t a = 0; a < c->r[c->d - 1]; a++) val += left[c->d - 1][a] * SL(c->d - 1, a, 0);
#undef SL
    return val;
}

/* Reference table (num x dim), padding row zero. */
static double *ref_table(const model *m) {
    double L[MAXD][16], R[MAXD][16];
    double *T = malloc(sizeof(double) * (size_t)(m->c->num * m->c->dim));
    for (int64_t t = 0; t < m->c->num; t++)
        for (int64_t j = 0; j < m->c->dim; j++)
            T[t * m->c->dim + j] = t == m->desc.padding_idx ? 0.0 : entry(m, t, j, L, R);
    return T;
}

/* Reference core and gate gradients from the table gradient dT. */
static void ref_grads(const model *m, const double *dT, double **dc, double **dg) {
    const emb_case *c = m->c;
    double L[MAXD][16], R[MAXD][16];
    double *deff[MAXD];
    for (int k = 0; k < c->d; k++) deff[k] = calloc((size_t)m->size[k], sizeof(double));
    for (int64_t t = 0; t < c->num; t++) {
        if (t == m->desc.padding_idx) continue;
        int64_t ii[MAXD], jj[MAXD];
        unravel(c->v, c->d, t, ii);
        for (int64_t j = 0; j < c->dim; j++) {
            double g = dT[t * c->dim + j];
            if (g == 0) continue;
            entry(m, t, j, L, R);
            unravel(c->e, c->d, j, jj);
            for (int k = 0; k < c->d; k++)
                for (int64_t a = 0; a < c->r[k]; a++)
                    for (int64_t b = 0; b < c->r[k + 1]; b++)
                        deff[k][((a * c->v[k] + ii[k]) * c->e[k] + jj[k]) * c->r[k + 1] + b] +=
                            g * L[k][a] * R[k][b];
        }
    }
    for (int k = 0; k < c->d; k++) {
        int64_t cols = c->r[k + 1];
        if (k < c->d - 1) memset(dg[k], 0, sizeof(double) * (size_t)cols);
        for (int64_t i = 0; i < m->size[k]; i++) {
            double gk = k < c->d - 1 ? m->gate[k][i % cols] : 1.0;
            dc[k][i] = deff[k][i] * gk;
            if (k < c->d - 1) dg[k][i % cols] += deff[k][i] * m->core[k][i];
        }
        free(deff[k]);
    }
}

static double max_rel_err(const double *a, const double *b, int64_t n) {
    double scale = 1e-30, err = 0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(b[i]));
    for (int64_t i = 0; i < n; i++) err = fmax(err, fabs(a[i] - b[i]));
    return err / scale;
}

/* One batch: random indices with repetition (some padding), random bags. */
typedef struct {
    comera_tt_embedding_batch b;
    int64_t idx[4096], off[12];
    double psw[4096];
    float psw_f[4096];
    int weighted;
} batch_t;

static void make_batch(batch_t *B, const emb_case *c, int mode, int64_t n, int weighted) {
    memset(B, 0, sizeof *B);
    for (int64_t p = 0; p < n; p++) {
        int64_t pick = (int64_t)uniform(0, 4);
        B->idx[p] = pick == 0 ? c->num - 1 : pick == 1 ? 1 : (int64_t)uniform(0, (double)c->num);
        if (B->idx[p] >= c->num) B->idx[p] = c->num - 1;
        B->psw_f[p] = (float)uniform(-1, 1);
        B->psw[p] = B->psw_f[p];
    }
    int64_t bags = 0;
    if (mode != COMERA_EMB_PLAIN) {
        bags = 6;
        int64_t cuts[] = {0, 0, n / 3, n / 3, n / 2, n - 2, n}; /* empty bags among them */
        memcpy(B->off, cuts, sizeof cuts);
    }
    B->weighted = weighted;
    B->b = (comera_tt_embedding_batch){mode, n, B->idx, bags, B->off};
}

static int64_t out_rows(const batch_t *B) {
    return B->b.mode == COMERA_EMB_PLAIN ? B->b.n : B->b.num_bags;
}

/* Reference forward from the table, and the table gradient of sum(G * out). */
static void ref_forward(const model *m, const double *T, const batch_t *B, double *out,
                        const double *G, double *dT) {
    int64_t dim = m->c->dim;
    const comera_tt_embedding_batch *b = &B->b;
    if (dT) memset(dT, 0, sizeof(double) * (size_t)(m->c->num * dim));
    if (b->mode == COMERA_EMB_PLAIN) {
        for (int64_t p = 0; p < b->n; p++)
            for (int64_t j = 0; j < dim; j++) {
                out[p * dim + j] = T[b->indices[p] * dim + j];
                if (dT) dT[b->indices[p] * dim + j] += G[p * dim + j];
            }
        return;
    }
    for (int64_t g = 0; g < b->num_bags; g++) {
        int64_t cnt = 0;
        for (int64_t p = b->offsets[g]; p < b->offsets[g + 1]; p++)
            cnt += b->indices[p] != m->desc.padding_idx;
        double inv = b->mode == COMERA_EMB_MEAN && cnt > 0 ? 1.0 / (double)cnt : 1.0;
        for (int64_t j = 0; j < dim; j++) out[g * dim + j] = 0;
        for (int64_t p = b->offsets[g]; p < b->offsets[g + 1]; p++) {
            if (b->indices[p] == m->desc.padding_idx) continue;
            double w = (B->weighted ? B->psw[p] : 1.0) * inv;
            for (int64_t j = 0; j < dim; j++) {
                out[g * dim + j] += w * T[b->indices[p] * dim + j];
                if (dT) dT[b->indices[p] * dim + j] += w * G[g * dim + j];
            }
        }
    }
}

/* When set, every kernel call below starts from a reused workspace block
 * full of NaN: a packed slice the call reads but did not pack this time
 * (a small batch packs only its rows' slices) shows in the results instead
 * of reading what an earlier call left there. */
static int poison_ws;

static void poison_workspace(void) {
    if (!poison_ws) return;
    int cached = 0;
    size_t n = (size_t)1 << 18;
    float *w = comera_ws_acquire(sizeof(float) * n, &cached);
    if (!w) return;
    for (size_t i = 0; i < n; i++) w[i] = NAN;
    comera_ws_release(w, cached);
}

/* n indices; large batches make the kernels use several threads. */
static void test_case(const emb_case *c, int mode, int64_t padding_idx, int weighted, int64_t n) {
    char name[160];
    snprintf(name, sizeof name, "%s mode %d pad %lld%s n %lld", c->name, mode,
             (long long)padding_idx, weighted ? " weighted" : "", (long long)n);
    model m;
    model_init(&m, c, padding_idx);
    static batch_t B;
    make_batch(&B, c, mode, n, weighted);
    int64_t rows = out_rows(&B), dim = c->dim, ok = 1;
    double *T = ref_table(&m);
    double *G = malloc(sizeof(double) * (size_t)(rows * dim));
    float *G_f = malloc(sizeof(float) * (size_t)(rows * dim));
    for (int64_t i = 0; i < rows * dim; i++) {
        G_f[i] = (float)uniform(-1, 1);
        G[i] = G_f[i];
    }
    double *out_ref = malloc(sizeof(double) * (size_t)(rows * dim));
    double *dT = malloc(sizeof(double) * (size_t)(c->num * dim));
    ref_forward(&m, T, &B, out_ref, G, dT);
    double *dc_ref[MAXD], *dg_ref[MAXD], *dc[MAXD], *dg[MAXD];
    float *dc_f[MAXD], *dg_f[MAXD];
    double *dc_f64[MAXD];
    for (int k = 0; k < c->d; k++) {
        dc_ref[k] = malloc(sizeof(double) * (size_t)m.size[k]);
        dc[k] = malloc(sizeof(double) * (size_t)m.size[k]);
        dc_f[k] = malloc(sizeof(float) * (size_t)m.size[k]);
        dc_f64[k] = malloc(sizeof(double) * (size_t)m.size[k]);
        dg_ref[k] = malloc(sizeof(double) * 16);
        dg[k] = malloc(sizeof(double) * 16);
        dg_f[k] = malloc(sizeof(float) * 16);
    }
    ref_grads(&m, dT, dc_ref, dg_ref);
    double *out = malloc(sizeof(double) * (size_t)(rows * dim));
    float *out_f = malloc(sizeof(float) * (size_t)(rows * dim));
    double *out_f64 = malloc(sizeof(double) * (size_t)(rows * dim));
    const double *psw = weighted ? B.psw : NULL;
    const float *psw_f = weighted ? B.psw_f : NULL;
    for (int reuse = COMERA_REUSE_AUTO; reuse <= COMERA_REUSE_PREFIX; reuse++)
        for (int nt = 1; nt <= 3; nt += 2) {
            poison_workspace();
            int rc = embedding_fwd_f64(&m.desc, &B.b, psw, reuse,
                                                 (const double *const *)m.core,
                                                 (const double *const *)m.gate, out, nt);
            ok &= rc == COMERA_OK && max_rel_err(out, out_ref, rows * dim) < TOL64;
            poison_workspace();
            rc = embedding_bwd_f64(&m.desc, &B.b, psw, reuse, G,
                                             (const double *const *)m.core,
                                             (const double *const *)m.gate, dc, dg, nt);
            ok &= rc == COMERA_OK;
            for (int k = 0; k < c->d; k++) {
                ok &= max_rel_err(dc[k], dc_ref[k], m.size[k]) < TOL64;
                if (k < c->d - 1) ok &= max_rel_err(dg[k], dg_ref[k], c->r[k + 1]) < TOL64;
            }
            poison_workspace();
            rc = embedding_fwd_f32(&m.desc, &B.b, psw_f, reuse,
                                             (const float *const *)m.core_f,
                                             (const float *const *)m.gate_f, out_f, nt);
            for (int64_t i = 0; i < rows * dim; i++) out_f64[i] = out_f[i];
            ok &= rc == COMERA_OK && max_rel_err(out_f64, out_ref, rows * dim) < TOL32;
            poison_workspace();
            rc = embedding_bwd_f32(&m.desc, &B.b, psw_f, reuse, G_f,
                                             (const float *const *)m.core_f,
                                             (const float *const *)m.gate_f, dc_f, dg_f, nt);
            ok &= rc == COMERA_OK;
            for (int k = 0; k < c->d; k++) {
                for (int64_t i = 0; i < m.size[k]; i++) dc_f64[k][i] = dc_f[k][i];
                ok &= max_rel_err(dc_f64[k], dc_ref[k], m.size[k]) < TOL32;
            }
        }
    check((int)ok, "forward/backward against the naive reference", name);
    for (int k = 0; k < c->d; k++) {
        free(dc_ref[k]); free(dc[k]); free(dc_f[k]); free(dc_f64[k]);
        free(dg_ref[k]); free(dg[k]); free(dg_f[k]);
    }
    free(T); free(G); free(G_f); free(out_ref); free(dT); free(out); free(out_f); free(out_f64);
    model_free(&m);
}

static void test_checks_and_plan(void) {
    const emb_case *c = &CASES[1];
    model m;
    model_init(&m, c, -1);
    int64_t idx[] = {3, 22, 23, 0}, bad = -1;
    comera_tt_embedding_batch b = {COMERA_EMB_PLAIN, 4, idx, 0, NULL};
    check(embedding_check_batch(&m.desc, &b, &bad) == COMERA_ERR_INDEX && bad == 2,
          "index 23 >= num_embeddings found at position 2", "checks");
    idx[2] = -1;
    check(embedding_check_batch(&m.desc, &b, &bad) == COMERA_ERR_INDEX && bad == 2,
          "negative index rejected", "checks");
    idx[2] = 5;
    int64_t off[] = {0, 3, 2};
    b = (comera_tt_embedding_batch){COMERA_EMB_SUM, 4, idx, 2, off};
    check(embedding_check_batch(&m.desc, &b, &bad) == COMERA_ERR_OFFSETS && bad == 2,
          "decreasing offsets rejected", "checks");
    off[0] = 1;
    check(embedding_check_batch(&m.desc, &b, &bad) == COMERA_ERR_OFFSETS && bad == 0,
          "offsets[0] != 0 rejected", "checks");
    off[0] = 0, off[1] = 2, off[2] = 3;
    check(embedding_check_batch(&m.desc, &b, &bad) == COMERA_ERR_OFFSETS && bad == 2,
          "last offset != n rejected", "checks");
    off[2] = 4;
    check(embedding_check_batch(&m.desc, &b, &bad) == COMERA_OK, "CSR offsets accepted",
          "checks");
    comera_tt_embedding_desc d = m.desc;
    d.padding_idx = 23;
    check(comera_tt_embedding_check(&d) == COMERA_ERR_ARG, "padding_idx out of range", "checks");
    d = m.desc;
    d.num_embeddings = 25;
    check(comera_tt_embedding_check(&d) == COMERA_ERR_ARG, "num_embeddings > prod(v)", "checks");
    int64_t huge_v[] = {1LL << 40, 1LL << 40}, e2[] = {2, 2}, r2[] = {1, 1, 1};
    comera_tt_embedding_desc h = {2, huge_v, e2, r2, 5, 4, -1};
    check(comera_tt_embedding_check(&h) == COMERA_ERR_OVERFLOW, "overflow detected", "checks");
    float out[4 * 10];
    const float *const *cf = (const float *const *)m.core_f;
    const float *const *gf = (const float *const *)m.gate_f;
    b = (comera_tt_embedding_batch){COMERA_EMB_PLAIN, 4, idx, 0, NULL};
    check(embedding_fwd_f32(&m.desc, &b, NULL, 7, cf, gf, out, 1) == COMERA_ERR_ARG,
          "unknown reuse rejected", "checks");
    b.n = 0;
    check(embedding_fwd_f32(&m.desc, &b, NULL, 0, cf, gf, out, 2) == COMERA_OK,
          "empty batch", "checks");

    int64_t pi[] = {5, 5, 7, 22, 21, 3, 5};
    comera_tt_embedding_plan plan;
    b = (comera_tt_embedding_batch){COMERA_EMB_PLAIN, 7, pi, 0, NULL};
    int rc = comera_tt_embedding_make_plan(&m.desc, &b, &plan);
    /* v = {2, 3, 4}: rows 3 5 7 21 22 -> i_0 {0, 1}: 2; (i_0, i_1) {00, 01, 12}: 3 */
    check(rc == COMERA_OK && plan.rows == 7 && plan.unique == 5 && plan.prefixes[0] == 2 &&
              plan.prefixes[1] == 3 && plan.prefixes[2] == 5,
          "plan counts rows, distinct rows and prefixes", "plan");
    check(plan.flops[COMERA_REUSE_PREFIX] < plan.flops[COMERA_REUSE_DEDUP] &&
              plan.flops[COMERA_REUSE_DEDUP] < plan.flops[COMERA_REUSE_NONE],
          "prefix < dedup < none in flops", "plan");
    model_free(&m);
}

/* A caller that is itself inside an OpenMP team: nested regions get one
 * thread, and the kernels must still cover every row. */
static void test_inside_parallel_region(void) {
    const emb_case *c = &CASES[4];
    model m;
    model_init(&m, c, -1);
    static batch_t B;
    make_batch(&B, c, COMERA_EMB_PLAIN, 4000, 0);
    int64_t n = B.b.n, dim = c->dim;
    double *T = ref_table(&m), *G = malloc(sizeof(double) * (size_t)(n * dim));
    double *dT = malloc(sizeof(double) * (size_t)(c->num * dim));
    double *ref = malloc(sizeof(double) * (size_t)(n * dim));
    for (int64_t i = 0; i < n * dim; i++) G[i] = uniform(-1, 1);
    ref_forward(&m, T, &B, ref, G, dT);
    double *dc_ref[MAXD], *dg_ref[MAXD];
    for (int k = 0; k < c->d; k++) {
        dc_ref[k] = malloc(sizeof(double) * (size_t)m.size[k]);
        dg_ref[k] = malloc(sizeof(double) * 16);
    }
    ref_grads(&m, dT, dc_ref, dg_ref);
    int ok = 1;
#pragma omp parallel num_threads(2) reduction(&& : ok)
    {
        double *out = malloc(sizeof(double) * (size_t)(n * dim)), *dc[MAXD], *dg[MAXD];
        for (int k = 0; k < c->d; k++) {
            dc[k] = malloc(sizeof(double) * (size_t)m.size[k]);
            dg[k] = malloc(sizeof(double) * 16);
        }
        ok = embedding_fwd_f64(&m.desc, &B.b, NULL, COMERA_REUSE_PREFIX,
                                         (const double *const *)m.core,
                                         (const double *const *)m.gate, out, 2) == COMERA_OK &&
             max_rel_err(out, ref, n * dim) < TOL64;
        ok = ok && embedding_bwd_f64(&m.desc, &B.b, NULL, COMERA_REUSE_PREFIX, G,
                                               (const double *const *)m.core,
                                               (const double *const *)m.gate, dc, dg, 2) == COMERA_OK;
        for (int k = 0; k < c->d; k++) {
            ok = ok && max_rel_err(dc[k], dc_ref[k], m.size[k]) < TOL64;
            free(dc[k]); free(dg[k]);
        }
        free(out);
    }
    check(ok, "nthreads 2 inside an outer team of 2", "nested");
    for (int k = 0; k < c->d; k++) { free(dc_ref[k]); free(dg_ref[k]); }
    free(T); free(G); free(dT); free(ref);
    model_free(&m);
}

int main(void) {
    int guard = isa_guard("test_embedding");
    if (guard) return guard < 0 ? 1 : 0;
    printf("test_embedding: TT embedding kernels\n");
    for (int i = 0; i < NCASES; i++) {
        int64_t pads[] = {-1, 1};
        for (int pi = 0; pi < 2; pi++) {
            test_case(&CASES[i], COMERA_EMB_PLAIN, pads[pi], 0, 40);
            test_case(&CASES[i], COMERA_EMB_SUM, pads[pi], 0, 40);
            test_case(&CASES[i], COMERA_EMB_SUM, pads[pi], 1, 40);
            test_case(&CASES[i], COMERA_EMB_MEAN, pads[pi], 0, 40);
        }
    }
    /* 4000 indices of the widest case: worth 2-3 threads, chunk borders */
    test_case(&CASES[4], COMERA_EMB_PLAIN, 7, 0, 4000);
    test_case(&CASES[4], COMERA_EMB_MEAN, -1, 0, 4000);
    test_case(&CASES[4], COMERA_EMB_SUM, 2, 1, 4000);
    /* a few indices: only their slices are packed (workspace poisoned) */
    poison_ws = 1;
    for (int i = 0; i < NCASES; i++) {
        test_case(&CASES[i], COMERA_EMB_PLAIN, -1, 0, 3);
        test_case(&CASES[i], COMERA_EMB_SUM, 1, 1, 6);
    }
    poison_ws = 0;
    test_checks_and_plan();
    test_inside_parallel_region();
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
