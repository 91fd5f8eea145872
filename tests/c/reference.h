/* Independent naive references for the comera C kernel tests.
 *
 * Nothing here calls into csrc/: the TT layer is evaluated by explicit loops
 * over multi-indices and rank products (docs/design.md section 2), so a bug shared
 * by the kernels and the reference would need to be made twice. */
#ifndef COMERA_TEST_REFERENCE_H
#define COMERA_TEST_REFERENCE_H

#include <stdint.h>
#include <stddef.h>

/* ---- pass / fail bookkeeping: one line per group, failures listed ---- */
void group_begin(const char *name);
void group_note_err(double err);   /* largest error seen, shown on the line */
void group_note_err32(double err); /* the same for float32 results */
void skipped(const char *what);    /* a known-bug case left out on request */
void group_end(void);
void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int total_passed(void);
int total_failed(void);

/* ---- deterministic random numbers (64-bit LCG, Knuth's MMIX constants) ---- */
typedef struct { uint64_t s; } lcg_t;
void lcg_seed(lcg_t *g, uint64_t seed);
double lcg_uniform(lcg_t *g); /* in [-1, 1) */

/* ---- allocation helpers: exact-size buffers (ASan sees overruns) ---- */
void *xmalloc(size_t bytes);                 /* aborts on failure, never NULL */
double *dalloc(int64_t n);                   /* n doubles (at least one) */
float *falloc(int64_t n);
void fill_uniform(lcg_t *g, double *a, int64_t n, double lo, double hi);
void to_float(const double *a, float *f, int64_t n);
void to_double(const float *f, double *a, int64_t n);
void fill_nan_d(double *a, int64_t n);
void fill_nan_f(float *a, int64_t n);

/* max |a - ref| / scale, scale = max |ref| (1 when ref is all zero); NaN or
 * Inf anywhere in a gives +Inf. */
double rel_err(const double *a, const double *ref, int64_t n);

/* ---- naive GEMM: C (M x N, ldc) (+)= A (rsa, csa) * B (rsb, csb) ---- */
void ref_gemm(int64_t M, int64_t N, int64_t K, const double *A, int64_t rsa,
              int64_t csa, const double *B, int64_t rsb, int64_t csb, double *C,
              int64_t ldc, int accumulate, double *absC /* may be NULL */);

/* ---- TT layer description used by the tests ---- */
#define TT_MAXD 8   /* p + q at most 8 in the tests */
#define TT_MAXR 64  /* largest rank in the tests */
typedef struct tt_case {
    const char *name;
    int p, q;
    int64_t in_modes[4], out_modes[4];
    int64_t ranks[TT_MAXD + 1];
    int64_t in_f, out_f;
} tt_case;

/* derived sizes */
int tt_D(const tt_case *c);
int64_t tt_dim(const tt_case *c, int k);
int64_t tt_in_pad(const tt_case *c);
int64_t tt_out_pad(const tt_case *c);
int64_t tt_core_size(const tt_case *c, int k);
int64_t tt_num_params(const tt_case *c); /* cores + gates */

/* Dense W^T, in_pad x out_pad, row-major (padding rows/columns included). */
void ref_dense_wt(const tt_case *c, const double *const *cores,
                  const double *const *gates, double *wt);
/* V = merge of the input cores with their gates: in_pad x r[p]. */
void ref_v(const tt_case *c, const double *const *cores,
           const double *const *gates, double *v);

/* Forward: y = x W^T[:in, :out] + bias (bias may be NULL), t = x V[:in, :]. */
void ref_forward(const tt_case *c, int64_t batch, const double *x,
                 const double *wt, const double *v, const double *bias,
                 double *y, double *t);

/* Backward of loss = sum(y * dy): dx = dy W[:out, :in], dbias = column sums
 * of dy, and core / gate gradients by explicit prefix and suffix rank
 * products for every (input, output) multi-index pair. */
void ref_backward(const tt_case *c, int64_t batch, const double *dy,
                  const double *x, const double *wt, const double *const *cores,
                  const double *const *gates, double *dx, double *dbias,
                  double *const *dcores, double *const *dgates);

/* Cases that expose known kernel bugs (see the test report) run unless
 * built with -DCOMERA_TEST_SKIP_KNOWN_BUGS (make ... SKIP_KNOWN_BUGS=1). */
#ifdef COMERA_TEST_SKIP_KNOWN_BUGS
#define SKIP_KNOWN_BUGS 1
#else
#define SKIP_KNOWN_BUGS 0
#endif

/* test groups living in other files */
void test_gemm(void);

#endif
