/* The fused gate proximal step (comera_gate_prox_f32/_f64) against a naive
 * per-entry transcription of the rule in comera/gate_prox.h: dead entries
 * re-zeroed, deaths by dead zone and by zero crossing, the min_live rescue,
 * kill = 0, NaN (nothing modified), argument errors, many gates on threads.
 * The whole gate step (comera_gate_step_f64) on worked cases: saliency,
 * shrink, the rescue of the earlier of two tied entries, frozen, NaN.
 * (tests/adapt/test_gate_step.py checks it against the tensor code.) */
#include "reference.h"
#include "comera/gate_prox.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int sgn(double v) { return (v > 0) - (v < 0); }

/* naive rule for one gate, in double; returns the live count */
static int64_t naive(double *g, int8_t *s, int64_t n, double thr, int64_t min_live, int kill) {
    int64_t live = 0;
    if (!kill) {
        for (int64_t i = 0; i < n; i++) {
            if (s[i] == 0) g[i] = 0;
            else {
                if (sgn(g[i])) s[i] = (int8_t)sgn(g[i]);
                live++;
            }
        }
        return live;
    }
    int *doomed = xmalloc((size_t)(n > 0 ? n : 1) * sizeof(int));
    for (int64_t i = 0; i < n; i++) {
        doomed[i] = s[i] != 0 && (fabs(g[i]) <= thr || sgn(g[i]) != s[i]);
        live += s[i] != 0 && !doomed[i];
    }
    while (live < min_live) { /* rescue the largest non-zero doomed entry */
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++)
            if (doomed[i] && g[i] != 0 && (best < 0 || fabs(g[i]) > fabs(g[best]))) best = i;
        if (best < 0) break;
        doomed[best] = 0;
        live++;
    }
    for (int64_t i = 0; i < n; i++) {
        if (s[i] == 0 || doomed[i]) {
            g[i] = 0;
            s[i] = 0;
        } else {
            s[i] = (int8_t)sgn(g[i]);
        }
    }
    free(doomed);
    return live;
}

static void random_gate(lcg_t *r, double *g, int8_t *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        g[i] = 0.05 * lcg_uniform(r);
        double u = lcg_uniform(r);
        s[i] = (int8_t)(u < -0.6 ? 0 : u < 0.2 ? 1 : -1); /* some dead, some crossed */
        if (lcg_uniform(r) > 0.9) g[i] = 0;               /* some exact zeros */
    }
}

static void one_config(int64_t num, const int64_t *sizes, double thr, int64_t min_live,
                       int kill, int nthreads, uint64_t seed) {
    lcg_t r;
    lcg_seed(&r, seed);
    double *gd[64], *gref[64];
    float *gf[64];
    int8_t *sd[64], *sf[64], *sref[64];
    int64_t live_d[64], live_f[64];
    for (int64_t k = 0; k < num; k++) {
        int64_t n = sizes[k];
        gd[k] = dalloc(n);
        gref[k] = dalloc(n);
        gf[k] = falloc(n);
        sd[k] = xmalloc((size_t)(n > 0 ? n : 1));
        sf[k] = xmalloc((size_t)(n > 0 ? n : 1));
        sref[k] = xmalloc((size_t)(n > 0 ? n : 1));
        random_gate(&r, gd[k], sd[k], n);
        to_float(gd[k], gf[k], n);
        to_double(gf[k], gd[k], n); /* identical values in both types */
        memcpy(gref[k], gd[k], (size_t)n * sizeof(double));
        memcpy(sf[k], sd[k], (size_t)n);
        memcpy(sref[k], sd[k], (size_t)n);
    }
    int rc_d = comera_gate_prox_f64(num, gd, sd, sizes, thr, min_live, kill, live_d, nthreads);
    int rc_f = comera_gate_prox_f32(num, gf, sf, sizes, thr, min_live, kill, live_f, nthreads);
    check(rc_d == COMERA_OK && rc_f == COMERA_OK, "rc %d %d", rc_d, rc_f);
    int bad = 0;
    for (int64_t k = 0; k < num; k++) {
        int64_t live = naive(gref[k], sref[k], sizes[k], thr, min_live, kill);
        bad += live != live_d[k] || live != live_f[k];
        for (int64_t i = 0; i < sizes[k]; i++) {
            bad += gd[k][i] != gref[k][i] || sd[k][i] != sref[k][i];
            bad += (double)gf[k][i] != gref[k][i] || sf[k][i] != sref[k][i];
        }
        free(gd[k]);
        free(gref[k]);
        free(gf[k]);
        free(sd[k]);
        free(sf[k]);
        free(sref[k]);
    }
    check(bad == 0, "thr %g min_live %lld kill %d threads %d: %d mismatches", thr,
          (long long)min_live, kill, nthreads, bad);
}

static void test_nan_and_args(void) {
    float g0[3] = {0.5f, 1e-5f, -0.3f}, g1[2] = {1e-5f, NAN};
    int8_t s0[3] = {1, 1, 1}, s1[2] = {1, 1};
    float *g[2] = {g0, g1};
    int8_t *s[2] = {s0, s1};
    int64_t sizes[2] = {3, 2}, live[2] = {7, 7};
    int rc = comera_gate_prox_f32(2, g, s, sizes, 1e-3, 1, 1, live, 1);
    check(rc == COMERA_GATE_NAN, "NaN: rc %d", rc);
    check(live[0] == 0 && live[1] == -1, "NaN: live %lld %lld", (long long)live[0],
          (long long)live[1]);
    check(g0[1] == 1e-5f && g1[0] == 1e-5f && s0[1] == 1 && s0[2] == 1,
          "NaN: a gate was modified");
    check(comera_gate_prox_f32(2, g, s, sizes, NAN, 1, 1, live, 1) == COMERA_ERR_ARG,
          "NaN threshold accepted");
    check(comera_gate_prox_f32(-1, g, s, sizes, 0.1, 1, 1, live, 1) == COMERA_ERR_ARG,
          "negative count accepted");
    check(comera_gate_prox_f32(2, g, s, sizes, 0.1, -1, 1, live, 1) == COMERA_ERR_ARG,
          "negative min_live accepted");
    int64_t neg[2] = {3, -2};
    check(comera_gate_prox_f32(2, g, s, neg, 0.1, 1, 1, live, 1) == COMERA_ERR_ARG,
          "negative size accepted");
    check(comera_gate_prox_f32(2, g, s, sizes, 0.1, 1, 1, NULL, 1) == COMERA_ERR_ARG,
          "NULL live accepted");
    check(comera_gate_prox_f64(0, NULL, NULL, NULL, 0.1, 1, 1, NULL, 1) == COMERA_OK,
          "no gates is fine");
}

static void test_gate_step(void); /* below */

void test_gate_prox(void) {
    group_begin("gate prox f32/f64 vs naive rule");
    static const int64_t small[] = {0, 1, 2, 7, 16, 33};
    for (int kill = 0; kill <= 1; kill++)
        for (int64_t ml = 0; ml <= 3; ml++) {
            one_config(6, small, 0.02, ml, kill, 1, 11 + (uint64_t)(kill * 10 + ml));
            one_config(6, small, -1.0, ml, kill, 2, 31 + (uint64_t)(kill * 10 + ml));
        }
    static int64_t big[40];
    for (int k = 0; k < 40; k++) big[k] = 1000 + 17 * k; /* over the parallel cut-off */
    one_config(40, big, 0.01, 1, 1, 2, 99);
    one_config(40, big, 0.01, 2, 0, 2, 98);
    group_end();
    group_begin("gate prox NaN and argument errors");
    test_nan_and_args();
    group_end();
    group_begin("gate step: saliency, shrink, tied rescue, frozen, NaN");
    test_gate_step();
    group_end();
}

/* One gate [0.3, -0.3, 0.1, 0.0] (signs 1, -1, 1, 0), gradient all 1,
 * saliency 1, shrunk by 0.5 with min_live 1: every entry would die, so the
 * earlier of the two largest (|0.3| tied) keeps its value and lives. */
static void test_gate_step(void) {
    double g[4] = {0.3, -0.3, 0.1, 0.0}, grad[4] = {1, 1, 1, 1}, sal[4] = {1, 1, 1, 1};
    double amount = 0.5;
    int8_t s[4] = {1, -1, 1, 0};
    void *gp[1] = {g};
    const void *grp[1] = {grad};
    int8_t *sp[1] = {s};
    double *salp[1] = {sal};
    int64_t size = 4, live = 7;
    uint8_t frozen = 0, nan_seen = 0, nan_gates = 0;
    comera_gate_step_args a = {1, gp, sp, grp, salp, &size, &amount, &frozen, &nan_seen,
                               &nan_gates, &live, 1e-3, 1, 1};
    int rc = comera_gate_step_f64(&a, 1);
    check(rc == COMERA_OK && live == 1, "gate step: rc %d live %lld", rc, (long long)live);
    check(g[0] == 0.3 && g[1] == 0 && g[2] == 0 && g[3] == 0 && s[0] == 1 && s[1] == 0 &&
              s[2] == 0 && s[3] == 0,
          "gate step: rescue %g %g %g %g", g[0], g[1], g[2], g[3]);
    check(sal[0] == fma(1.0 - 0.9, 0.3, 0.9) && sal[3] == 0.9, "gate step: saliency %.17g %.17g",
          sal[0], sal[3]);
    /* frozen: no shrink, only the rule (entry 0 lives on) */
    frozen = 1;
    g[0] = 0.2;
    rc = comera_gate_step_f64(&a, 1);
    check(rc == COMERA_OK && live == 1 && g[0] == 0.2, "gate step frozen: live %lld g %g",
          (long long)live, g[0]);
    /* NaN: nothing changes, the gate is recorded once */
    g[1] = NAN;
    s[1] = 1;
    rc = comera_gate_step_f64(&a, 1);
    check(rc == COMERA_GATE_NAN && live == -1 && nan_seen == 1 && nan_gates == 1 &&
              g[0] == 0.2 && sal[3] == 0.81,
          "gate step NaN: rc %d live %lld seen %d", rc, (long long)live, nan_seen);
    a.threshold = NAN;
    check(comera_gate_step_f64(&a, 1) == COMERA_ERR_ARG, "gate step: NaN threshold accepted");
    check(comera_gate_step_f32(NULL, 1) == COMERA_ERR_ARG, "gate step: NULL arguments accepted");
}
