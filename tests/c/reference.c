/* Naive references for test_kernels.c: see reference.h. */
#include "reference.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_pass, n_fail, g_pass, g_fail;
static double g_err, g_err32;
static const char *g_name;

void group_begin(const char *name) {
    g_name = name;
    g_pass = g_fail = 0;
    g_err = g_err32 = 0.0;
}
void group_note_err(double err) {
    if (!(err <= g_err)) g_err = err;
}
void group_note_err32(double err) {
    if (!(err <= g_err32)) g_err32 = err;
}
void skipped(const char *what) {
    printf("  SKIPPED (known kernel bug): %s\n", what);
}
void group_end(void) {
    printf("%-44s %6d passed, %d failed", g_name, g_pass, g_fail);
    if (g_err > 0.0 && g_err32 > 0.0)
        printf("  (max rel err f64 %.2e, f32 %.2e)", g_err, g_err32);
    else if (g_err > 0.0)
        printf("  (max rel err %.2e)", g_err);
    printf("\n");
    fflush(stdout);
}
void check(int ok, const char *fmt, ...) {
    if (ok) {
        n_pass++;
        g_pass++;
        return;
    }
    n_fail++;
    if (g_fail++ < 25) {
        va_list ap;
        va_start(ap, fmt);
        printf("  FAIL [%s] ", g_name);
        vprintf(fmt, ap);
        printf("\n");
        va_end(ap);
    }
}
int total_passed(void) { return n_pass; }
int total_failed(void) { return n_fail; }

void lcg_seed(lcg_t *g, uint64_t seed) { g->s = seed * 2862933555777941757ULL + 3037000493ULL; }

double lcg_uniform(lcg_t *g) {
    g->s = g->s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(g->s >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
        abort();
    }
    return p;
}
double *dalloc(int64_t n) { return xmalloc(sizeof(double) * (size_t)(n > 0 ? n : 1)); }
float *falloc(int64_t n) { return xmalloc(sizeof(float) * (size_t)(n > 0 ? n : 1)); }

void fill_uniform(lcg_t *g, double *a, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) a[i] = lo + (hi - lo) * 0.5 * (lcg_uniform(g) + 1.0);
}
void to_float(const double *a, float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) f[i] = (float)a[i];
}
void to_double(const float *f, double *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = (double)f[i];
}
void fill_nan_d(double *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = NAN;
}
void fill_nan_f(float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = NAN;
}

double rel_err(const double *a, const double *ref, int64_t n) {
    double scale = 0.0, err = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        double d = fabs(a[i] - ref[i]);
        if (d > err) err = d;
        if (fabs(ref[i]) > scale) scale = fabs(ref[i]);
    }
    return err / (scale > 0.0 ? scale : 1.0);
}

void ref_gemm(int64_t M, int64_t N, int64_t K, const double *A, int64_t rsa,
              int64_t csa, const double *B, int64_t rsb, int64_t csb, double *C,
              int64_t ldc, int accumulate, double *absC) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0.0, sa = 0.0;
            for (int64_t k = 0; k < K; k++) {
                double prod = A[i * rsa + k * csa] * B[k * rsb + j * csb];
                s += prod;
                sa += fabs(prod);
            }
            if (accumulate) {
                sa += fabs(C[i * ldc + j]);
                s += C[i * ldc + j];
            }
            C[i * ldc + j] = s;
            if (absC) absC[i * ldc + j] = sa;
        }
}

int tt_D(const tt_case *c) { return c->p + c->q; }
int64_t tt_dim(const tt_case *c, int k) {
    return k < c->p ? c->in_modes[k] : c->out_modes[k - c->p];
}
int64_t tt_in_pad(const tt_case *c) {
    int64_t n = 1;
    for (int k = 0; k < c->p; k++) n *= c->in_modes[k];
    return n;
}
int64_t tt_out_pad(const tt_case *c) {
    int64_t n = 1;
    for (int k = 0; k < c->q; k++) n *= c->out_modes[k];
    return n;
}
int64_t tt_core_size(const tt_case *c, int k) {
    return c->ranks[k] * tt_dim(c, k) * c->ranks[k + 1];
}
int64_t tt_num_params(const tt_case *c) {
    int64_t n = 0;
    for (int k = 0; k < tt_D(c); k++) n += tt_core_size(c, k) + (k < tt_D(c) - 1 ? c->ranks[k + 1] : 0);
    return n;
}

/* digits of the row-major multi-index: flat input index I and output index
 * J -> mode index per core, most significant digit first */
static void multi_index(const tt_case *c, int64_t I, int64_t J, int64_t *m) {
    for (int k = c->p - 1; k >= 0; k--) { m[k] = I % c->in_modes[k]; I /= c->in_modes[k]; }
    for (int k = c->q - 1; k >= 0; k--) { m[c->p + k] = J % c->out_modes[k]; J /= c->out_modes[k]; }
}

/* gate value of core k on its right rank index b (the last core has none) */
static double gate(const tt_case *c, const double *const *gates, int k, int64_t b) {
    return k < tt_D(c) - 1 ? gates[k][b] : 1.0;
}

/* row vector L (length r[k]) times slice m of core k, times its gate */
static void step_left(const tt_case *c, const double *const *cores,
                      const double *const *gates, int k, int64_t m,
                      const double *L, double *out) {
    int64_t r0 = c->ranks[k], r1 = c->ranks[k + 1], n = tt_dim(c, k);
    for (int64_t b = 0; b < r1; b++) {
        double s = 0.0;
        for (int64_t a = 0; a < r0; a++) s += L[a] * cores[k][(a * n + m) * r1 + b];
        out[b] = s * gate(c, gates, k, b);
    }
}

void ref_dense_wt(const tt_case *c, const double *const *cores,
                  const double *const *gates, double *wt) {
    int64_t inp = tt_in_pad(c), outp = tt_out_pad(c), m[TT_MAXD];
    double L[TT_MAXR], L2[TT_MAXR];
    for (int64_t I = 0; I < inp; I++)
        for (int64_t J = 0; J < outp; J++) {
            multi_index(c, I, J, m);
            L[0] = 1.0;
            for (int k = 0; k < tt_D(c); k++) {
                step_left(c, cores, gates, k, m[k], L, L2);
                memcpy(L, L2, sizeof(double) * (size_t)c->ranks[k + 1]);
            }
            wt[I * outp + J] = L[0];
        }
}

void ref_v(const tt_case *c, const double *const *cores,
           const double *const *gates, double *v) {
    int64_t inp = tt_in_pad(c), rm = c->ranks[c->p], m[TT_MAXD];
    double L[TT_MAXR], L2[TT_MAXR];
    for (int64_t I = 0; I < inp; I++) {
        multi_index(c, I, 0, m);
        L[0] = 1.0;
        for (int k = 0; k < c->p; k++) {
            step_left(c, cores, gates, k, m[k], L, L2);
            memcpy(L, L2, sizeof(double) * (size_t)c->ranks[k + 1]);
        }
        memcpy(v + I * rm, L, sizeof(double) * (size_t)rm);
    }
}

void ref_forward(const tt_case *c, int64_t batch, const double *x,
                 const double *wt, const double *v, const double *bias,
                 double *y, double *t) {
    int64_t in = c->in_f, out = c->out_f, outp = tt_out_pad(c), rm = c->ranks[c->p];
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t j = 0; j < out; j++) {
            double s = bias ? bias[j] : 0.0;
            for (int64_t i = 0; i < in; i++) s += x[b * in + i] * wt[i * outp + j];
            y[b * out + j] = s;
        }
        for (int64_t r = 0; r < rm; r++) {
            double s = 0.0;
            for (int64_t i = 0; i < in; i++) s += x[b * in + i] * v[i * rm + r];
            t[b * rm + r] = s;
        }
    }
}

void ref_backward(const tt_case *c, int64_t batch, const double *dy,
                  const double *x, const double *wt, const double *const *cores,
                  const double *const *gates, double *dx, double *dbias,
                  double *const *dcores, double *const *dgates) {
    int D = tt_D(c);
    int64_t in = c->in_f, out = c->out_f, inp = tt_in_pad(c), outp = tt_out_pad(c);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < in; i++) {
            double s = 0.0;
            for (int64_t j = 0; j < out; j++) s += dy[b * out + j] * wt[i * outp + j];
            dx[b * in + i] = s;
        }
    for (int64_t j = 0; j < out; j++) {
        double s = 0.0;
        for (int64_t b = 0; b < batch; b++) s += dy[b * out + j];
        dbias[j] = s;
    }
    /* G = d loss / d W^T = x^T dy on the real block, zero on the padding */
    double *G = dalloc(inp * outp);
    memset(G, 0, sizeof(double) * (size_t)(inp * outp));
    for (int64_t i = 0; i < in; i++)
        for (int64_t j = 0; j < out; j++) {
            double s = 0.0;
            for (int64_t b = 0; b < batch; b++) s += x[b * in + i] * dy[b * out + j];
            G[i * outp + j] = s;
        }
    for (int k = 0; k < D; k++) {
        memset(dcores[k], 0, sizeof(double) * (size_t)tt_core_size(c, k));
        if (k < D - 1) memset(dgates[k], 0, sizeof(double) * (size_t)c->ranks[k + 1]);
    }
    /* W^T[I,J] = L_k S_k diag(g_k) R_{k+1}, L_k = E_0..E_{k-1} (a row),
     * R_{k+1} = E_{k+1}..E_{D-1} (a column), E_j = S_j diag(g_j). */
    double L[TT_MAXD + 1][TT_MAXR], R[TT_MAXD + 1][TT_MAXR];
    int64_t m[TT_MAXD];
    for (int64_t I = 0; I < inp; I++)
        for (int64_t J = 0; J < outp; J++) {
            double w = G[I * outp + J];
            if (w == 0.0) continue;
            multi_index(c, I, J, m);
            L[0][0] = 1.0;
            for (int k = 0; k < D; k++) step_left(c, cores, gates, k, m[k], L[k], L[k + 1]);
            R[D][0] = 1.0;
            for (int k = D - 1; k >= 0; k--) {
                int64_t r0 = c->ranks[k], r1 = c->ranks[k + 1], n = tt_dim(c, k);
                for (int64_t a = 0; a < r0; a++) {
                    double s = 0.0;
                    for (int64_t b = 0; b < r1; b++)
                        s += cores[k][(a * n + m[k]) * r1 + b] * gate(c, gates, k, b) * R[k + 1][b];
                    R[k][a] = s;
                }
            }
            for (int k = 0; k < D; k++) {
                int64_t r0 = c->ranks[k], r1 = c->ranks[k + 1], n = tt_dim(c, k);
                for (int64_t b = 0; b < r1; b++) {
                    double gr = w * gate(c, gates, k, b) * R[k + 1][b], ls = 0.0;
                    for (int64_t a = 0; a < r0; a++) {
                        dcores[k][(a * n + m[k]) * r1 + b] += L[k][a] * gr;
                        ls += L[k][a] * cores[k][(a * n + m[k]) * r1 + b];
                    }
                    if (k < D - 1) dgates[k][b] += w * ls * R[k + 1][b];
                }
            }
        }
    free(G);
}
