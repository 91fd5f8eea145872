/* Standalone tests of the comera C kernels (csrc/common, csrc/tt_linear,
 * csrc/gate_prox): GEMM (test_gemm.c), TT linear forward/backward on both
 * paths against the naive dense reference (reference.c), finite
 * differences of the float64 kernel, float32 against float64, the bfloat16
 * and float16 kernels (test_half.c), descriptor checks and the planner, the gate proximal step (test_rank_adaptive.c),
 * the page and output-block helpers (test_pages.c, test_outpool.c).
 * Prints one line per group, then "N passed, M failed"; exits 1 on failure. */
#include "isa_guard.h"
#include "reference.h"
#include "comera/tt_linear.h"
#include "one_call.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL64 1e-11
#define TOL32 3e-5
#define TOLFD 1e-9

static const tt_case CASES[] = {
    {"p1q1 5x7 r3", 1, 1, {5}, {7}, {1, 3, 1}, 5, 7},
    {"p1q1 rank1 padded 6->5 8->7", 1, 1, {6}, {8}, {1, 1, 1}, 5, 7},
    {"p2q2 {2,3}->5 {3,3}->7 TT bound", 2, 2, {2, 3}, {3, 3}, {1, 2, 6, 3, 1}, 5, 7},
    {"p2q2 rank1", 2, 2, {2, 3}, {3, 3}, {1, 1, 1, 1, 1}, 6, 9},
    {"p1q3 TT bound", 1, 3, {7}, {2, 3, 2}, {1, 7, 6, 2, 1}, 6, 12},
    {"p3q1 TT bound", 3, 1, {2, 2, 3}, {5}, {1, 2, 4, 5, 1}, 10, 5},
    {"p2q3 primes", 2, 3, {3, 5}, {2, 3, 2}, {1, 3, 4, 4, 2, 1}, 13, 11},
    {"p4q4 {2}^4", 4, 4, {2, 2, 2, 2}, {2, 2, 2, 2}, {1, 2, 3, 3, 3, 3, 3, 2, 1}, 16, 13},
    {"p3q2 with a mode of 1", 3, 2, {3, 1, 5}, {7, 2}, {1, 2, 2, 5, 2, 1}, 15, 13},
    {"p3q3 {4}^3 r16", 3, 3, {4, 4, 4}, {4, 4, 4}, {1, 16, 16, 16, 16, 16, 1}, 64, 64},
    {"p2q1 wide in 1000 (row block 60)", 2, 1, {32, 32}, {8}, {1, 4, 2, 1}, 1000, 8},
    {"p1q2 wide out 1537 (row block 48)", 1, 2, {3}, {40, 40}, {1, 3, 5, 1}, 3, 1537},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

/* ---- a random layer, float64 and float32 copies of identical values ---- */
typedef struct {
    const tt_case *c;
    int D;
    int64_t rm;
    comera_tt_linear_desc desc;
    double *cores[TT_MAXD], *gates[TT_MAXD], *bias, *wt, *v;
    float *cores_f[TT_MAXD], *gates_f[TT_MAXD], *bias_f;
} layer_t;

static void rounded(lcg_t *g, double *a, float *f, int64_t n, double lo, double hi) {
    fill_uniform(g, a, n, lo, hi);
    to_float(a, f, n);
    to_double(f, a, n);
}

static void layer_init(layer_t *L, const tt_case *c, uint64_t seed) {
    lcg_t g;
    lcg_seed(&g, seed);
    memset(L, 0, sizeof *L);
    L->c = c;
    L->D = tt_D(c);
    L->rm = c->ranks[c->p];
    L->desc = (comera_tt_linear_desc){c->p, c->q, c->in_modes, c->out_modes, c->ranks, c->in_f, c->out_f};
    for (int k = 0; k < L->D; k++) {
        int64_t n = tt_core_size(c, k);
        double s = 1.0 / sqrt((double)c->ranks[k]);
        L->cores[k] = dalloc(n);
        L->cores_f[k] = falloc(n);
        rounded(&g, L->cores[k], L->cores_f[k], n, -s, s);
        if (k < L->D - 1) {
            L->gates[k] = dalloc(c->ranks[k + 1]);
            L->gates_f[k] = falloc(c->ranks[k + 1]);
            rounded(&g, L->gates[k], L->gates_f[k], c->ranks[k + 1], 0.5, 1.5);
        }
    }
    L->bias = dalloc(c->out_f);
    L->bias_f = falloc(c->out_f);
    rounded(&g, L->bias, L->bias_f, c->out_f, -1, 1);
    L->wt = dalloc(tt_in_pad(c) * tt_out_pad(c));
    L->v = dalloc(tt_in_pad(c) * L->rm);
    ref_dense_wt(c, (const double *const *)L->cores, (const double *const *)L->gates, L->wt);
    ref_v(c, (const double *const *)L->cores, (const double *const *)L->gates, L->v);
}

static void layer_free(layer_t *L) {
    for (int k = 0; k < L->D; k++) {
        free(L->cores[k]); free(L->cores_f[k]); free(L->gates[k]); free(L->gates_f[k]);
    }
    free(L->bias); free(L->bias_f); free(L->wt); free(L->v);
}

#define CD(a) ((const double *const *)(a))
#define CF(a) ((const float *const *)(a))

/* ---- outputs of one forward + backward (float64 storage) ---- */
typedef struct {
    double *y, *t, *dx, *db, *dc[TT_MAXD], *dg[TT_MAXD];
} result_t;

static void result_alloc(result_t *r, const layer_t *L, int64_t B) {
    const tt_case *c = L->c;
    r->y = dalloc(B * c->out_f); r->t = dalloc(B * L->rm);
    r->dx = dalloc(B * c->in_f); r->db = dalloc(c->out_f);
    fill_nan_d(r->y, B * c->out_f); fill_nan_d(r->t, B * L->rm);
    fill_nan_d(r->dx, B * c->in_f); fill_nan_d(r->db, c->out_f);
    for (int k = 0; k < L->D; k++) {
        r->dc[k] = dalloc(tt_core_size(c, k));
        fill_nan_d(r->dc[k], tt_core_size(c, k));
        r->dg[k] = k < L->D - 1 ? dalloc(c->ranks[k + 1]) : NULL;
        if (r->dg[k]) fill_nan_d(r->dg[k], c->ranks[k + 1]);
    }
}
static void result_free(result_t *r, int D) {
    free(r->y); free(r->t); free(r->dx); free(r->db);
    for (int k = 0; k < D; k++) { free(r->dc[k]); free(r->dg[k]); }
}

/* Largest relative error over the outputs; *what names the worst one. */
static double result_err(const result_t *a, const result_t *ref, const layer_t *L, int64_t B,
                         int fwd, int with_dx, const char **what) {
    const tt_case *c = L->c;
    double e, worst = 0.0;
    static char name[32];
    *what = "-";
#define CMP(label, x, y, n) \
    do { e = rel_err(x, y, n); if (!(e <= worst)) { worst = e; *what = label; } } while (0)
    if (fwd) {
        if (B > 0) { CMP("y", a->y, ref->y, B * c->out_f); CMP("t", a->t, ref->t, B * L->rm); }
        return worst;
    }
    if (with_dx) {
        if (B > 0) CMP("dx", a->dx, ref->dx, B * c->in_f);
        CMP("dbias", a->db, ref->db, c->out_f);
    }
    for (int k = 0; k < L->D; k++) {
        e = rel_err(a->dc[k], ref->dc[k], tt_core_size(c, k));
        if (!(e <= worst)) { worst = e; snprintf(name, sizeof name, "dcore%d", k); *what = name; }
        if (k == L->D - 1) continue;
        e = rel_err(a->dg[k], ref->dg[k], c->ranks[k + 1]);
        if (!(e <= worst)) { worst = e; snprintf(name, sizeof name, "dgate%d", k); *what = name; }
    }
#undef CMP
    return worst;
}

static int run_f64(const layer_t *L, int path, int64_t B, const double *x, const double *dy,
                   int use_bias, int use_dx, int nt, result_t *r) {
    int rc = linear_fwd_f64(&L->desc, path, B, x, CD(L->cores), CD(L->gates),
                                      use_bias ? L->bias : NULL, r->y, r->t, nt);
    if (rc) return rc;
    return linear_bwd_f64(&L->desc, path, B, dy, x, r->t, CD(L->cores), CD(L->gates),
                                    use_dx ? r->dx : NULL, r->dc, r->dg, use_dx ? r->db : NULL, nt);
}

static int run_f32(const layer_t *L, int path, int64_t B, const double *x, const double *dy,
                   int use_bias, int use_dx, int nt, result_t *r) {
    const tt_case *c = L->c;
    int64_t nx = B * c->in_f, ny = B * c->out_f, ntt = B * L->rm;
    float *xf = falloc(nx), *dyf = falloc(ny), *y = falloc(ny), *t = falloc(ntt), *dx = falloc(nx);
    float *db = falloc(c->out_f), *dc[TT_MAXD], *dg[TT_MAXD];
    to_float(x, xf, nx); to_float(dy, dyf, ny);
    fill_nan_f(y, ny); fill_nan_f(t, ntt); fill_nan_f(dx, nx); fill_nan_f(db, c->out_f);
    for (int k = 0; k < L->D; k++) {
        dc[k] = falloc(tt_core_size(c, k));
        fill_nan_f(dc[k], tt_core_size(c, k));
        dg[k] = k < L->D - 1 ? falloc(c->ranks[k + 1]) : NULL;
        if (dg[k]) fill_nan_f(dg[k], c->ranks[k + 1]);
    }
    int rc = linear_fwd_f32(&L->desc, path, B, xf, CF(L->cores_f), CF(L->gates_f),
                                      use_bias ? L->bias_f : NULL, y, t, nt);
    if (!rc)
        rc = linear_bwd_f32(&L->desc, path, B, dyf, xf, t, CF(L->cores_f),
                                      CF(L->gates_f), use_dx ? dx : NULL, dc, dg,
                                      use_dx ? db : NULL, nt);
    to_double(y, r->y, ny); to_double(t, r->t, ntt); to_double(dx, r->dx, nx);
    to_double(db, r->db, c->out_f);
    for (int k = 0; k < L->D; k++) {
        to_double(dc[k], r->dc[k], tt_core_size(c, k));
        if (dg[k]) to_double(dg[k], r->dg[k], c->ranks[k + 1]);
        free(dc[k]); free(dg[k]);
    }
    free(xf); free(dyf); free(y); free(t); free(dx); free(db);
    return rc;
}

/* Reference results for a batch (y with and without bias). */
static void reference(const layer_t *L, int64_t B, const double *x, const double *dy,
                      result_t *ref, double *y_nobias) {
    ref_forward(L->c, B, x, L->wt, L->v, L->bias, ref->y, ref->t);
    ref_forward(L->c, B, x, L->wt, L->v, NULL, y_nobias, ref->t);
    ref_backward(L->c, B, dy, x, L->wt, CD(L->cores), CD(L->gates), ref->dx, ref->db, ref->dc,
                 ref->dg);
}

static const char *PATHNAME[3] = {"auto", "merge", "seq"};

/* Every batch x path x thread count, float64 against the reference and
 * float32 against float64. */
static void test_case(const tt_case *c, uint64_t seed) {
    static const int64_t BATCHES[] = {0, 1, 3, 300};
    char gname[96];
    snprintf(gname, sizeof gname, "tt %s", c->name);
    group_begin(gname);
    layer_t L;
    layer_init(&L, c, seed);
    lcg_t g;
    lcg_seed(&g, seed + 1000);
    for (int bi = 0; bi < 4; bi++) {
        int64_t B = BATCHES[bi];
        double *x = dalloc(B * c->in_f), *dy = dalloc(B * c->out_f), *y_nb = dalloc(B * c->out_f);
        float *tmp = falloc(B * (c->in_f + c->out_f));
        rounded(&g, x, tmp, B * c->in_f, -1, 1);
        rounded(&g, dy, tmp, B * c->out_f, -1, 1);
        free(tmp);
        result_t ref, ref_nb, r64, r32;
        result_alloc(&ref, &L, B);
        reference(&L, B, x, dy, &ref, y_nb);
        ref_nb = ref;
        ref_nb.y = y_nb;
        for (int path = 0; path <= 2; path++)
            for (int nti = 0; nti < 4; nti++) {
                /* 0 means one thread; 5 is more threads than row blocks */
                static const int NTS[] = {1, 2, 0, 5};
                int nt = NTS[nti];
                int use_bias = !(path == 2 && nt == 2);
                int use_dx = !((path == 0 && nt == 2) || (path == 1 && nt == 5));
                const result_t *rr = use_bias ? &ref : &ref_nb;
                const char *what;
                result_alloc(&r64, &L, B);
                result_alloc(&r32, &L, B);
                int rc = run_f64(&L, path, B, x, dy, use_bias, use_dx, nt, &r64);
                double ef = result_err(&r64, rr, &L, B, 1, use_dx, &what);
                group_note_err(ef);
                check(rc == 0 && ef <= TOL64, "f64 fwd %s batch %lld nt %d: rc %d, %s rel err %.3g",
                      PATHNAME[path], (long long)B, nt, rc, what, ef);
                double eb = result_err(&r64, rr, &L, B, 0, use_dx, &what);
                group_note_err(eb);
                check(rc == 0 && eb <= TOL64, "f64 bwd %s batch %lld nt %d: rc %d, %s rel err %.3g",
                      PATHNAME[path], (long long)B, nt, rc, what, eb);
                rc = run_f32(&L, path, B, x, dy, use_bias, use_dx, nt, &r32);
                ef = result_err(&r32, &r64, &L, B, 1, use_dx, &what);
                group_note_err32(ef);
                check(rc == 0 && ef <= TOL32, "f32 fwd %s batch %lld nt %d vs f64: rc %d, %s rel err %.3g",
                      PATHNAME[path], (long long)B, nt, rc, what, ef);
                eb = result_err(&r32, &r64, &L, B, 0, use_dx, &what);
                group_note_err32(eb);
                check(rc == 0 && eb <= TOL32, "f32 bwd %s batch %lld nt %d vs f64: rc %d, %s rel err %.3g",
                      PATHNAME[path], (long long)B, nt, rc, what, eb);
                result_free(&r64, L.D);
                result_free(&r32, L.D);
            }
        result_free(&ref, L.D);
        free(x); free(dy); free(y_nb);
    }
    layer_free(&L);
    group_end();
}

/* loss = sum(y * G) through the float64 kernel's own forward */
static double fd_loss(const layer_t *L, int path, int64_t B, const double *x, const double *G,
                      double *y, double *t) {
    int rc = linear_fwd_f64(&L->desc, path, B, x, CD(L->cores), CD(L->gates), L->bias,
                                      y, t, 1);
    if (rc) return NAN;
    double s = 0.0;
    for (int64_t i = 0; i < B * L->c->out_f; i++) s += y[i] * G[i];
    return s;
}

/* Central differences of every entry of a; the loss is affine in each single
 * entry, so a large step is exact up to rounding. */
static void fd_array(const layer_t *L, int path, int64_t B, double *xx, const double *G,
                     double *a, int64_t n, double *out, double *y, double *t) {
    const double h = 0.125;
    for (int64_t i = 0; i < n; i++) {
        double keep = a[i];
        a[i] = keep + h;
        double lp = fd_loss(L, path, B, xx, G, y, t);
        a[i] = keep - h;
        double lm = fd_loss(L, path, B, xx, G, y, t);
        a[i] = keep;
        out[i] = (lp - lm) / (2 * h);
    }
}

static void test_fd(void) {
    group_begin("tt f64 kernel vs finite differences");
    const int64_t B = 3;
    for (int ci = 0; ci < NCASES; ci++) {
        const tt_case *c = &CASES[ci];
        if (tt_num_params(c) + B * c->in_f > 1500) continue;
        layer_t L;
        layer_init(&L, c, 77 + (uint64_t)ci);
        lcg_t g;
        lcg_seed(&g, 99 + (uint64_t)ci);
        double *x = dalloc(B * c->in_f), *G = dalloc(B * c->out_f);
        double *y = dalloc(B * c->out_f), *t = dalloc(B * L.rm);
        fill_uniform(&g, x, B * c->in_f, -1, 1);
        fill_uniform(&g, G, B * c->out_f, -1, 1);
        for (int path = 1; path <= 2; path++) {
            result_t r, fd;
            result_alloc(&r, &L, B);
            result_alloc(&fd, &L, B);
            int rc = run_f64(&L, path, B, x, G, 1, 1, 1, &r);
            fd_array(&L, path, B, x, G, x, B * c->in_f, fd.dx, y, t);
            fd_array(&L, path, B, x, G, L.bias, c->out_f, fd.db, y, t);
            for (int k = 0; k < L.D; k++) {
                fd_array(&L, path, B, x, G, L.cores[k], tt_core_size(c, k), fd.dc[k], y, t);
                if (k < L.D - 1) fd_array(&L, path, B, x, G, L.gates[k], c->ranks[k + 1], fd.dg[k], y, t);
            }
            const char *what;
            double e = result_err(&r, &fd, &L, B, 0, 1, &what);
            group_note_err(e);
            check(rc == 0 && e <= TOLFD, "%s %s: rc %d, %s differs from finite differences by %.3g",
                  c->name, PATHNAME[path], rc, what, e);
            result_free(&r, L.D);
            result_free(&fd, L.D);
        }
        free(x); free(G); free(y); free(t);
        layer_free(&L);
    }
    group_end();
}

/* Called from inside an active parallel region (nested parallelism off),
 * the kernel's own parallel regions get one thread however many are asked
 * for: results must not depend on that. */
static void test_nested(void) {
    group_begin("tt called inside an omp parallel region");
    int old_levels = omp_get_max_active_levels();
    omp_set_max_active_levels(1);
    static const int CI[] = {2, 10};
    for (int i = 0; i < 2; i++) {
        const tt_case *c = &CASES[CI[i]];
        const int64_t B = 300;
        layer_t L;
        layer_init(&L, c, 5);
        lcg_t g;
        lcg_seed(&g, 6);
        double *x = dalloc(B * c->in_f), *dy = dalloc(B * c->out_f), *y_nb = dalloc(B * c->out_f);
        fill_uniform(&g, x, B * c->in_f, -1, 1);
        fill_uniform(&g, dy, B * c->out_f, -1, 1);
        result_t ref;
        result_alloc(&ref, &L, B);
        reference(&L, B, x, dy, &ref, y_nb);
        for (int path = 1; path <= 2; path++) {
            if (SKIP_KNOWN_BUGS && path == COMERA_PATH_MERGE) {
                skipped("merge-path backward inside an active parallel region (bwd_merge assumes "
                        "it gets all nthreads threads)");
                continue;
            }
            result_t r;
            result_alloc(&r, &L, B);
            int rc = -99, team = 0;
#pragma omp parallel num_threads(2)
            {
#pragma omp single
                {
                    team = omp_get_num_threads();
                    rc = run_f64(&L, path, B, x, dy, 1, 1, 2, &r);
                }
            }
            const char *wf, *wb;
            double ef = result_err(&r, &ref, &L, B, 1, 1, &wf);
            double eb = result_err(&r, &ref, &L, B, 0, 1, &wb);
            check(rc == 0 && ef <= TOL64 && eb <= TOL64,
                  "%s %s nthreads 2 in an outer team of %d: rc %d, fwd %s err %.3g, bwd %s err %.3g",
                  c->name, PATHNAME[path], team, rc, wf, ef, wb, eb);
            result_free(&r, L.D);
        }
        result_free(&ref, L.D);
        free(x); free(dy); free(y_nb);
        layer_free(&L);
    }
    omp_set_max_active_levels(old_levels);
    group_end();
}

void test_check_and_plan(void); /* test_check.c */
void test_half(const tt_case *cases, int ncases); /* test_half.c */
void test_hnarrow(void);                            /* test_hnarrow.c */
void test_hgemm_narrow(void);                       /* test_hnarrow.c */
void test_gate_prox(void);      /* test_rank_adaptive.c */
void test_pages(void);          /* test_pages.c */
void test_outpool(void);        /* test_outpool.c */

int main(void) {
    int guard = isa_guard("test_kernels");
    if (guard) return guard < 0 ? 1 : 0;
    test_gemm();
    test_check_and_plan();
    for (int ci = 0; ci < NCASES; ci++) test_case(&CASES[ci], 1234 + (uint64_t)ci);
    test_half(CASES, NCASES);
    test_hnarrow();
    test_hgemm_narrow();
    test_fd();
    test_nested();
    test_gate_prox();
    test_pages();
    test_outpool();
    printf("%d passed, %d failed\n", total_passed(), total_failed());
    return total_failed() ? 1 : 0;
}
