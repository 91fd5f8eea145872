/* Fuzz target for the C library's argument handling: the TT linear and TT
 * embedding planners and kernels, and the gate proximal step.
 *
 * One input (any bytes) decodes into a descriptor, a batch and the scalar
 * arguments, drawn mostly from small valid sizes (so the kernels really run)
 * and from values at the edges: 0, negatives, INT32/INT64 limits, sizes
 * whose products overflow int64, ranks far above the TT bound.  Properties
 * checked (abort() on violation, so the fuzzer and the driver both see it):
 *
 *   - no crash, no sanitizer report, no hang (every call returns);
 *   - a descriptor or batch that the check functions reject is rejected by
 *     every kernel entry point with the same code, before any allocation
 *     (malloc/calloc are counted through the linker's --wrap);
 *   - a size whose products overflow int64 is rejected with
 *     COMERA_ERR_OVERFLOW (or COMERA_ERR_ARG when another field is invalid);
 *   - an accepted small problem runs with COMERA_OK on every path / reuse
 *     strategy, and the paths agree with each other in float64.
 *
 * Entry point LLVMFuzzerTestOneInput: built with clang -fsanitize=fuzzer it
 * is a libFuzzer target; driver.c runs it over files or a deterministic
 * random corpus (gcc, ASan + UBSan). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comera/gate_prox.h"
#include "comera/tt_embedding.h"
#include "comera/tt_linear.h"
#include "common/half.h"
#include "../c/one_call.h"
#include "fuzz_alloc.h"

#define FAIL(...)                                                   \
    do {                                                            \
        fprintf(stderr, "fuzz_kernels: " __VA_ARGS__);              \
        fprintf(stderr, "  (%s:%d)\n", __FILE__, __LINE__);         \
        abort();                                                    \
    } while (0)

typedef struct {
    const uint8_t *p;
    size_t n;
    int tame; /* mostly valid sizes, so that the kernels really run */
} reader;

static uint8_t rd_u8(reader *r) {
    if (!r->n) return 0;
    r->n--;
    return *r->p++;
}

static uint64_t rd_u64(reader *r) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | rd_u8(r);
    return v;
}

/* Edge values for sizes: limits, overflow thresholds of products of two and
 * three factors, and the int32 boundaries (the glue casts through int). */
static const int64_t SPECIAL[] = {
    0, -1, -2, 1, 2, 3, 7, 16, 17, 64,
    INT64_MAX, INT64_MIN, INT64_MAX - 1, INT64_MIN + 1,
    (int64_t)INT32_MAX, (int64_t)INT32_MAX + 1, (int64_t)INT32_MIN, (int64_t)UINT32_MAX,
    (int64_t)1 << 32, (int64_t)1 << 40, (int64_t)1 << 62, (int64_t)1 << 59,
    3037000499, 3037000500, /* floor/ceil of sqrt(INT64_MAX) */
    2097151, 2097152,       /* about cbrt(INT64_MAX) */
    (int64_t)1 << 20, 65536, 1000003,
};
#define NSPECIAL ((int)(sizeof SPECIAL / sizeof SPECIAL[0]))

/* Mostly small positive sizes (1..5), sometimes an edge value, rarely raw. */
static int64_t rd_size(reader *r) {
    uint8_t sel = rd_u8(r);
    if (sel < (r->tame ? 252 : 176)) return 1 + sel % 5;
    if (sel < 248) return SPECIAL[sel % NSPECIAL];
    return (int64_t)rd_u64(r);
}

static int rd_count(reader *r, int lo, int hi) { /* in [lo, hi] */
    return lo + (int)(rd_u8(r) % (unsigned)(hi - lo + 1));
}

static int rd_threads(reader *r) {
    static const int T[] = {1, 2, 0, -3, 3, 1 << 30};
    return T[rd_u8(r) % 6];
}

static double rd_real(reader *r) {
    uint8_t sel = rd_u8(r);
    if (sel < 250) return ((double)sel - 125.0) / 64.0;
    if (sel == 250) return NAN;
    if (sel == 251) return INFINITY;
    if (sel == 252) return -INFINITY;
    return 0.0;
}

/* A copy of n int64 values in a heap block of exactly n entries, so ASan
 * sees any read past what the descriptor claims. */
static int64_t *heap_i64(const int64_t *v, int n) {
    int64_t *p = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (n > 0) memcpy(p, v, sizeof(int64_t) * (size_t)n);
    return p;
}

/* product of n sizes, saturating at a cap (all >= 1 assumed) */
static int64_t capped_prod(const int64_t *v, int n, int64_t cap) {
    int64_t p = 1;
    for (int i = 0; i < n; i++) {
        if (v[i] < 1) return -1;
        if (v[i] > cap || p > cap / v[i]) return cap + 1;
        p *= v[i];
    }
    return p;
}

static double *rand_buf(reader *r, int64_t n) {
    double *b = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) b[i] = ((double)rd_u8(r) - 127.5) / 128.0;
    return b;
}

static float *to_f32(const double *b, int64_t n) {
    float *f = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) f[i] = (float)b[i];
    return f;
}

static void expect_close(const char *what, const double *a, const double *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double tol = 1e-9 * (1.0 + fabs(a[i]) + fabs(b[i]));
        if (!(fabs(a[i] - b[i]) <= tol)) FAIL("%s: entry %lld differs: %.17g vs %.17g\n", what,
                                              (long long)i, a[i], b[i]);
    }
}

/* ------------------------------------------------------------------ linear */

#define SMALL_ELEMS 4096

static void fuzz_linear(reader *r) {
    int p = r->tame ? rd_count(r, 1, 3) : rd_count(r, -1, 10);
    int q = r->tame ? rd_count(r, 1, 3) : rd_count(r, -1, 10);
    if (rd_u8(r) == 255) p = INT32_MAX; /* num_in + num_out must not overflow int */
    int D = (int64_t)p + q <= 18 && p >= 0 && q >= 0 ? p + q : 18;
    int64_t modes[20], ranks[20];
    for (int k = 0; k < 20; k++) modes[k] = rd_size(r);
    for (int k = 0; k < 20; k++) ranks[k] = rd_size(r);
    if (rd_u8(r) < 200) ranks[0] = 1;
    if (rd_u8(r) < 200) ranks[D] = 1;
    int np = p > 0 && p <= 18 ? p : 0, nq = q > 0 && q <= 18 ? q : 0;
    int64_t *in_modes = heap_i64(modes, np), *out_modes = heap_i64(modes + np, nq);
    int64_t *rk = heap_i64(ranks, D + 1);
    int64_t in_pad = capped_prod(in_modes, np, 1 << 20);
    int64_t out_pad = capped_prod(out_modes, nq, 1 << 20);
    int64_t in_f = rd_u8(r) < 220 && in_pad > 0 ? in_pad - rd_count(r, 0, 2) : rd_size(r);
    int64_t out_f = rd_u8(r) < 220 && out_pad > 0 ? out_pad - rd_count(r, 0, 2) : rd_size(r);
    int64_t batch = rd_u8(r) < 200 ? rd_count(r, 0, 9) : rd_size(r);
    int nthreads = rd_threads(r);
    int path = rd_u8(r) < 240 ? rd_count(r, 0, 2) : rd_count(r, -2, 9);
    comera_tt_linear_desc d = {p, q, in_modes, out_modes, rk, in_f, out_f};

    int rc = comera_tt_linear_check(&d, batch);
    comera_tt_linear_plan plan;
    int rcp = comera_tt_linear_make_plan(&d, batch, &plan);
    if (rcp != rc) FAIL("linear: make_plan %d but check %d\n", rcp, rc);
    if (rc != COMERA_OK && rc != COMERA_ERR_ARG && rc != COMERA_ERR_OVERFLOW)
        FAIL("linear: check returned %d\n", rc);
    if (rc == COMERA_OK) {
        if (plan.path != COMERA_PATH_MERGE && plan.path != COMERA_PATH_SEQUENTIAL)
            FAIL("linear: plan path %d\n", plan.path);
        for (int k = 1; k <= 2; k++)
            if (!(plan.seconds[k] >= 0) || !(plan.flops[k] >= 0) || isinf(plan.seconds[k]))
                FAIL("linear: plan cost %g s, %g flops\n", plan.seconds[k], plan.flops[k]);
    }
    /* sizes of an accepted problem, to decide whether to run it */
    int64_t cores_elems = 0, rmid = 1;
    int small = rc == COMERA_OK && in_pad <= 512 && out_pad <= 512 && batch <= 16;
    for (int k = 0; small && k < D; k++) {
        int64_t n = k < p ? in_modes[k] : out_modes[k - p];
        if (rk[k] > 64 || rk[k + 1] > 64) small = 0;
        else cores_elems += rk[k] * n * rk[k + 1];
    }
    if (small) rmid = rk[p];
    if (small && cores_elems > SMALL_ELEMS) small = 0;

    if (rc != COMERA_OK || (!small && path >= 0 && path <= 2)) {
        /* the entry points must refuse before touching memory or allocating;
         * an accepted but large problem with a bad path must fail on the path */
        float one[1] = {0};
        const float *cp[COMERA_MAX_CORES + 2];
        float *dp[COMERA_MAX_CORES + 2];
        for (int k = 0; k < COMERA_MAX_CORES + 2; k++) cp[k] = one, dp[k] = one;
        if (rc == COMERA_OK) { /* large and valid: not run here */
            free(in_modes), free(out_modes), free(rk);
            return;
        }
        long before = comera_fuzz_allocs();
        int rf = linear_fwd_f32(&d, path, batch, one, cp, cp, one, one, one, nthreads);
        int rb = linear_bwd_f32(&d, path, batch, one, one, one, cp, cp, one, dp, dp,
                                          one, nthreads);
        if (rf != rc || rb != rc) FAIL("linear: check %d but fwd %d, bwd %d\n", rc, rf, rb);
        if (comera_fuzz_allocs() != before) FAIL("linear: allocation before rejecting (%d)\n", rc);
        comera_fuzz_stats[0]++;
        free(in_modes), free(out_modes), free(rk);
        return;
    }
    if (!small) { /* valid sizes, invalid path */
        float one[1] = {0};
        const float *cp[COMERA_MAX_CORES];
        for (int k = 0; k < COMERA_MAX_CORES; k++) cp[k] = one;
        long before = comera_fuzz_allocs();
        int rf = linear_fwd_f32(&d, path, batch, one, cp, cp, one, one, one, nthreads);
        if (rf != COMERA_ERR_ARG) FAIL("linear: path %d accepted (%d)\n", path, rf);
        if (comera_fuzz_allocs() != before) FAIL("linear: allocation before rejecting path\n");
        free(in_modes), free(out_modes), free(rk);
        return;
    }

    /* accepted and small: run float64 on both paths (they must agree), and
     * float32 on the requested path */
    double *cores[COMERA_MAX_CORES], *gates[COMERA_MAX_CORES], *dcores[2][COMERA_MAX_CORES],
        *dgates[2][COMERA_MAX_CORES];
    for (int k = 0; k < D; k++) {
        int64_t n = k < p ? in_modes[k] : out_modes[k - p];
        cores[k] = rand_buf(r, rk[k] * n * rk[k + 1]);
        for (int s = 0; s < 2; s++) dcores[s][k] = rand_buf(r, rk[k] * n * rk[k + 1]);
        if (k < D - 1) {
            gates[k] = rand_buf(r, rk[k + 1]);
            for (int s = 0; s < 2; s++) dgates[s][k] = rand_buf(r, rk[k + 1]);
        }
    }
    double *x = rand_buf(r, batch * in_f), *dy = rand_buf(r, batch * out_f);
    double *bias = rand_buf(r, out_f);
    double *y[2], *t[2], *dx[2], *db[2];
    for (int s = 0; s < 2; s++) {
        y[s] = rand_buf(r, batch * out_f), t[s] = rand_buf(r, batch * rmid);
        dx[s] = rand_buf(r, batch * in_f), db[s] = rand_buf(r, out_f);
        int pth = s + 1;
        int a = linear_fwd_f64(&d, pth, batch, x, (const double *const *)cores,
                                         (const double *const *)gates, bias, y[s], t[s], nthreads);
        int b = linear_bwd_f64(&d, pth, batch, dy, x, t[s],
                                         (const double *const *)cores,
                                         (const double *const *)gates, dx[s], dcores[s],
                                         dgates[s], db[s], nthreads);
        if (a || b) FAIL("linear: valid problem failed: fwd %d bwd %d (path %d)\n", a, b, pth);
    }
    comera_fuzz_stats[1]++;
    expect_close("linear y merge vs sequential", y[0], y[1], batch * out_f);
    expect_close("linear dx merge vs sequential", dx[0], dx[1], batch * in_f);
    expect_close("linear dbias merge vs sequential", db[0], db[1], out_f);
    for (int k = 0; k < D; k++) {
        int64_t n = k < p ? in_modes[k] : out_modes[k - p];
        expect_close("linear dcore merge vs sequential", dcores[0][k], dcores[1][k],
                     rk[k] * n * rk[k + 1]);
        if (k < D - 1) expect_close("linear dgate merge vs sequential", dgates[0][k],
                                    dgates[1][k], rk[k + 1]);
    }
    /* float32, requested path (incl. auto), dx skipped and no bias */
    {
        float *fc[COMERA_MAX_CORES], *fg[COMERA_MAX_CORES], *fdc[COMERA_MAX_CORES],
            *fdg[COMERA_MAX_CORES];
        for (int k = 0; k < D; k++) {
            int64_t n = k < p ? in_modes[k] : out_modes[k - p];
            fc[k] = to_f32(cores[k], rk[k] * n * rk[k + 1]);
            fdc[k] = to_f32(cores[k], rk[k] * n * rk[k + 1]);
            if (k < D - 1) fg[k] = to_f32(gates[k], rk[k + 1]), fdg[k] = to_f32(gates[k], rk[k + 1]);
        }
        float *fx = to_f32(x, batch * in_f), *fy = to_f32(y[0], batch * out_f);
        float *ft = to_f32(t[0], batch * rmid), *fdy = to_f32(dy, batch * out_f);
        int a = linear_fwd_f32(&d, path, batch, fx, (const float *const *)fc,
                                         (const float *const *)fg, NULL, fy, ft, nthreads);
        int b = linear_bwd_f32(&d, path, batch, fdy, fx, ft, (const float *const *)fc,
                                         (const float *const *)fg, NULL, fdc, fdg, NULL, nthreads);
        int want = path >= 0 && path <= 2 ? COMERA_OK : COMERA_ERR_ARG;
        if (a != want || b != want)
            FAIL("linear f32: fwd %d bwd %d, expected %d (path %d)\n", a, b, want, path);
        double ymax = 0;
        if (want != COMERA_OK) batch = 0; /* nothing was computed: skip the comparison */
        for (int64_t i = 0; i < batch * out_f; i++)
            if (fabs(y[0][i] - bias[i % out_f]) > ymax) ymax = fabs(y[0][i] - bias[i % out_f]);
        for (int64_t i = 0; i < batch * out_f; i++)
            if (!(fabs((double)fy[i] - (y[0][i] - bias[i % out_f])) <= 2e-3 * (1.0 + ymax)))
                FAIL("linear f32: y[%lld] %g vs %g\n", (long long)i, fy[i],
                     y[0][i] - bias[i % out_f]);
        for (int k = 0; k < D; k++) {
            free(fc[k]), free(fdc[k]);
            if (k < D - 1) free(fg[k]), free(fdg[k]);
        }
        free(fx), free(fy), free(ft), free(fdy);
    }
    /* bfloat16 activations with float32 parameters (a float32 layer under
     * autocast), with the bias and dx: y against float64 within bfloat16's
     * rounding */
    if (path >= 0 && path <= 2) {
        float *fc[COMERA_MAX_CORES], *fg[COMERA_MAX_CORES], *fdc[COMERA_MAX_CORES],
            *fdg[COMERA_MAX_CORES];
        for (int k = 0; k < D; k++) {
            int64_t n = k < p ? in_modes[k] : out_modes[k - p];
            fc[k] = to_f32(cores[k], rk[k] * n * rk[k + 1]);
            fdc[k] = to_f32(cores[k], rk[k] * n * rk[k + 1]);
            if (k < D - 1) fg[k] = to_f32(gates[k], rk[k + 1]), fdg[k] = to_f32(gates[k], rk[k + 1]);
        }
        float *fb = to_f32(bias, out_f), *fdb = to_f32(bias, out_f);
        uint16_t *hx = malloc(2 * (size_t)(batch * in_f + 1)), *hy = malloc(2 * (size_t)(batch * out_f + 1));
        uint16_t *ht = malloc(2 * (size_t)(batch * rmid + 1)), *hdy = malloc(2 * (size_t)(batch * out_f + 1));
        uint16_t *hdx = malloc(2 * (size_t)(batch * in_f + 1));
        for (int64_t i = 0; i < batch * in_f; i++) hx[i] = comera_f32_to_bf16((float)x[i]);
        for (int64_t i = 0; i < batch * out_f; i++) hdy[i] = comera_f32_to_bf16((float)dy[i]);
        comera_tt_linear_prep prep;
        comera_tt_half_types ty = {COMERA_DT_BF16, COMERA_DT_BF16, COMERA_DT_F32};
        int a = comera_tt_linear_prepare(&d, batch, path, &prep);
        if (!a)
            a = comera_tt_linear_fwd_half(&prep, &ty, hx,
                                          (const void *const *)fc, (const void *const *)fg, fb,
                                          hy, ht, nthreads);
        int b = a ? a
                  : comera_tt_linear_bwd_half(&prep, &ty, hdy, hx, ht,
                                              (const void *const *)fc, (const void *const *)fg,
                                              hdx, (void *const *)fdc, (void *const *)fdg, fdb,
                                              nthreads);
        if (a || b) FAIL("linear bf16: fwd %d bwd %d on a valid problem\n", a, b);
        double ymax = 0;
        for (int64_t i = 0; i < batch * out_f; i++)
            if (fabs(y[0][i]) > ymax) ymax = fabs(y[0][i]);
        /* x rounded to bfloat16 as well: a few roundings of 2^-9 each */
        for (int64_t i = 0; i < batch * out_f; i++)
            if (!(fabs((double)comera_bf16_to_f32(hy[i]) - y[0][i]) <= 5e-2 * (1.0 + ymax)))
                FAIL("linear bf16: y[%lld] %g vs %g\n", (long long)i,
                     (double)comera_bf16_to_f32(hy[i]), y[0][i]);
        for (int k = 0; k < D; k++) {
            free(fc[k]), free(fdc[k]);
            if (k < D - 1) free(fg[k]), free(fdg[k]);
        }
        free(fb), free(fdb), free(hx), free(hy), free(ht), free(hdy), free(hdx);
    }
    for (int k = 0; k < D; k++) {
        free(cores[k]), free(dcores[0][k]), free(dcores[1][k]);
        if (k < D - 1) free(gates[k]), free(dgates[0][k]), free(dgates[1][k]);
    }
    for (int s = 0; s < 2; s++) free(y[s]), free(t[s]), free(dx[s]), free(db[s]);
    free(x), free(dy), free(bias);
    free(in_modes), free(out_modes), free(rk);
}

/* --------------------------------------------------------------- embedding */

static void fuzz_embedding(reader *r) {
    int d = r->tame ? rd_count(r, 2, 3) : rd_count(r, -1, 17);
    if (rd_u8(r) == 255) d = INT32_MAX;
    int nd = d > 0 && d <= 17 ? d : 0;
    int64_t vv[17], ee[17], rr[18];
    for (int k = 0; k < 17; k++) vv[k] = rd_size(r), ee[k] = rd_size(r);
    for (int k = 0; k < 18; k++) rr[k] = rd_size(r);
    if (rd_u8(r) < 200) rr[0] = 1;
    if (rd_u8(r) < 200) rr[nd] = 1;
    int64_t *v = heap_i64(vv, nd), *e = heap_i64(ee, nd), *rk = heap_i64(rr, nd + 1);
    int64_t num_pad = capped_prod(v, nd, 1 << 20), dim_pad = capped_prod(e, nd, 1 << 20);
    int64_t num = rd_u8(r) < 220 && num_pad > 0 ? num_pad - rd_count(r, 0, 2) : rd_size(r);
    int64_t dim = rd_u8(r) < 220 && dim_pad > 0 ? dim_pad - rd_count(r, 0, 2) : rd_size(r);
    uint8_t ps = rd_u8(r);
    int64_t pad = ps < 160 ? -1 : ps < 240 && num > 0 ? (int64_t)rd_u8(r) % num : rd_size(r);
    comera_tt_embedding_desc desc = {d, v, e, rk, num, dim, pad};

    uint8_t ms = rd_u8(r);
    int mode = ms < 240 ? ms % 3 : (ms % 2 ? -1 : 3);
    /* n: small (the arrays hold exactly n), or so large that the output size
     * overflows (then nothing may be read: the arrays hold one entry) */
    int huge_n = rd_u8(r) >= 240;
    int64_t n = huge_n ? (rd_u8(r) % 2 ? INT64_MAX : -1 - (int64_t)rd_u8(r) % 3)
                       : rd_count(r, 0, 12);
    int64_t nn = huge_n ? 1 : n;
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(nn > 0 ? nn : 1));
    for (int64_t i = 0; i < nn; i++) {
        uint8_t sel = rd_u8(r);
        idx[i] = sel < 245 && num > 0 ? (int64_t)rd_u8(r) % num
                 : sel < 250          ? SPECIAL[rd_u8(r) % NSPECIAL]
                                      : num;
    }
    int huge_b = rd_u8(r) >= 245;
    int64_t nb = huge_b ? (rd_u8(r) % 2 ? INT64_MAX : -1) : rd_count(r, 0, 5);
    int64_t nbb = huge_b ? 1 : nb + 1;
    int64_t *off = malloc(sizeof(int64_t) * (size_t)nbb);
    for (int64_t i = 0; i < nbb; i++) /* valid CSR offsets, sometimes corrupted */
        off[i] = i == nbb - 1 ? nn : i == 0 ? 0 : (nn * i) / (nbb - 1) + (rd_u8(r) % 2 ? 0 : -1) * (i > 1);
    if (rd_u8(r) >= 240 && nbb > 0) off[rd_u8(r) % nbb] = rd_size(r);
    int use_psw = mode == COMERA_EMB_SUM && rd_u8(r) % 2;
    double *psw = use_psw ? rand_buf(r, nn) : NULL;
    int reuse = rd_u8(r) < 240 ? rd_count(r, 0, 3) : rd_count(r, -2, 7);
    int nthreads = rd_threads(r);
    comera_tt_embedding_batch b = {mode, n, idx, nb, off};

    int rcd = comera_tt_embedding_check(&desc);
    int64_t bad = -7;
    int rc = embedding_check_batch(&desc, &b, &bad);
    if (rcd && rc != rcd) FAIL("embedding: check %d but check_batch %d\n", rcd, rc);
    if (huge_n && rcd == COMERA_OK && rc != COMERA_ERR_OVERFLOW && rc != COMERA_ERR_ARG)
        FAIL("embedding: n = %lld accepted (%d)\n", (long long)n, rc);
    if (rc == COMERA_ERR_INDEX && (bad < 0 || bad >= n || (idx[bad] >= 0 && idx[bad] < num)))
        FAIL("embedding: index error at %lld\n", (long long)bad);
    comera_tt_embedding_plan plan;
    int rcp = comera_tt_embedding_make_plan(&desc, &b, &plan);
    if (rcp != rc) FAIL("embedding: make_plan %d but check_batch %d\n", rcp, rc);

    int64_t cores_elems = 0;
    int small = rc == COMERA_OK && num_pad <= 4096 && dim_pad <= 256;
    for (int k = 0; small && k < d; k++) {
        if (rk[k] > 32 || rk[k + 1] > 32) small = 0;
        else cores_elems += rk[k] * v[k] * e[k] * rk[k + 1];
    }
    if (cores_elems > SMALL_ELEMS) small = 0;
    int reuse_ok = reuse >= 0 && reuse <= 3;
    if (rc != COMERA_OK || (small && !reuse_ok)) {
        float one[1] = {0};
        const float *cp[COMERA_MAX_CORES + 2];
        float *dp[COMERA_MAX_CORES + 2];
        for (int k = 0; k < COMERA_MAX_CORES + 2; k++) cp[k] = one, dp[k] = one;
        long before = comera_fuzz_allocs();
        int rf = embedding_fwd_f32(&desc, &b, NULL, reuse, cp, cp, one, nthreads);
        int rb = embedding_bwd_f32(&desc, &b, NULL, reuse, one, cp, cp, dp, dp,
                                             nthreads);
        int want = rc != COMERA_OK ? rc : COMERA_ERR_ARG;
        if (rf != want || rb != want)
            FAIL("embedding: expected %d, fwd %d, bwd %d (reuse %d)\n", want, rf, rb, reuse);
        if (comera_fuzz_allocs() != before) FAIL("embedding: allocation before rejecting\n");
        comera_fuzz_stats[2]++;
    } else if (small) {
        int64_t rows = mode == COMERA_EMB_PLAIN ? n : nb;
        comera_fuzz_stats[3]++;
        double *cores[COMERA_MAX_CORES], *gates[COMERA_MAX_CORES];
        double *dc[4][COMERA_MAX_CORES], *dg[4][COMERA_MAX_CORES], *out[4];
        for (int k = 0; k < d; k++) {
            cores[k] = rand_buf(r, rk[k] * v[k] * e[k] * rk[k + 1]);
            if (k < d - 1) gates[k] = rand_buf(r, rk[k + 1]);
        }
        double *gout = rand_buf(r, rows * dim);
        for (int s = 0; s < 4; s++) { /* AUTO, NONE, DEDUP, PREFIX must agree */
            out[s] = rand_buf(r, rows * dim);
            for (int k = 0; k < d; k++) {
                dc[s][k] = rand_buf(r, rk[k] * v[k] * e[k] * rk[k + 1]);
                if (k < d - 1) dg[s][k] = rand_buf(r, rk[k + 1]);
            }
            int a = embedding_fwd_f64(&desc, &b, psw, s, (const double *const *)cores,
                                                (const double *const *)gates, out[s], nthreads);
            int c = embedding_bwd_f64(&desc, &b, psw, s, gout,
                                                (const double *const *)cores,
                                                (const double *const *)gates, dc[s], dg[s],
                                                nthreads);
            if (a || c) FAIL("embedding: valid batch failed: fwd %d bwd %d (reuse %d)\n", a, c, s);
            if (s == 0) continue;
            expect_close("embedding out vs reuse none", out[1], out[s], rows * dim);
            for (int k = 0; k < d && s > 1; k++) {
                expect_close("embedding dcore vs reuse none", dc[1][k], dc[s][k],
                             rk[k] * v[k] * e[k] * rk[k + 1]);
                if (k < d - 1) expect_close("embedding dgate", dg[1][k], dg[s][k], rk[k + 1]);
            }
        }
        if (rc == COMERA_OK && reuse_ok) { /* float32 on the requested strategy */
            float *fc[COMERA_MAX_CORES], *fg[COMERA_MAX_CORES];
            for (int k = 0; k < d; k++) {
                fc[k] = to_f32(cores[k], rk[k] * v[k] * e[k] * rk[k + 1]);
                if (k < d - 1) fg[k] = to_f32(gates[k], rk[k + 1]);
            }
            float *fo = to_f32(out[0], rows * dim), *fpsw = psw ? to_f32(psw, nn) : NULL;
            int a = embedding_fwd_f32(&desc, &b, fpsw, reuse, (const float *const *)fc,
                                                (const float *const *)fg, fo, nthreads);
            if (a) FAIL("embedding f32: valid batch failed: %d\n", a);
            double mx = 0;
            for (int64_t i = 0; i < rows * dim; i++) mx = fmax(mx, fabs(out[1][i]));
            for (int64_t i = 0; i < rows * dim; i++)
                if (!(fabs((double)fo[i] - out[1][i]) <= 2e-3 * (1.0 + mx)))
                    FAIL("embedding f32: out[%lld] %g vs %g\n", (long long)i, fo[i], out[1][i]);
            for (int k = 0; k < d; k++) {
                free(fc[k]);
                if (k < d - 1) free(fg[k]);
            }
            free(fo), free(fpsw);
        }
        for (int k = 0; k < d; k++) {
            free(cores[k]);
            if (k < d - 1) free(gates[k]);
            for (int s = 0; s < 4; s++) {
                free(dc[s][k]);
                if (k < d - 1) free(dg[s][k]);
            }
        }
        for (int s = 0; s < 4; s++) free(out[s]);
        free(gout);
    }
    free(psw), free(idx), free(off), free(v), free(e), free(rk);
}

/* --------------------------------------------------------------- gate prox */

static void fuzz_gate_prox(reader *r) {
    int ng = rd_count(r, -2, 6);
    if (rd_u8(r) == 255) ng = (int)INT32_MIN;
    int n = ng > 0 ? ng : 0;
    static const double TH[] = {0.0, 1e-3, 0.25, -1.0, NAN, INFINITY, -INFINITY, 1e308};
    static const int64_t ML[] = {0, 1, 2, 3, -1, INT64_MAX, INT64_MIN, 100};
    double th = TH[rd_u8(r) % 8];
    int64_t min_live = ML[rd_u8(r) % 8];
    int kill = rd_u8(r) % 2, nthreads = rd_threads(r);
    int f64 = rd_u8(r) % 2;
    int64_t sizes[6];
    void *g[6];
    int8_t *s[6], *s0[6];
    double *g0[6];
    int any_neg = 0, any_nan = 0, nan_at[6] = {0};
    for (int k = 0; k < n; k++) {
        uint8_t sel = rd_u8(r);
        sizes[k] = sel < 250 ? sel % 10 : sel % 2 ? -1 : INT64_MIN;
        int64_t m = sizes[k] > 0 ? sizes[k] : 0;
        any_neg |= sizes[k] < 0;
        g0[k] = malloc(sizeof(double) * (size_t)(m ? m : 1));
        s0[k] = malloc((size_t)(m ? m : 1));
        s[k] = malloc((size_t)(m ? m : 1));
        g[k] = malloc((f64 ? sizeof(double) : sizeof(float)) * (size_t)(m ? m : 1));
        for (int64_t i = 0; i < m; i++) {
            g0[k][i] = rd_real(r);
            if (isnan(g0[k][i])) any_nan = nan_at[k] = 1;
            s0[k][i] = (int8_t)(rd_u8(r) % 3) - 1;
            s[k][i] = s0[k][i];
            if (f64) ((double *)g[k])[i] = g0[k][i];
            else ((float *)g[k])[i] = (float)g0[k][i];
        }
    }
    int64_t *sz = heap_i64(sizes, n), live[6] = {0};
    comera_fuzz_stats[4]++;
    int rc = f64 ? comera_gate_prox_f64(ng, (double *const *)g, s, sz, th, min_live, kill, live,
                                        nthreads)
                 : comera_gate_prox_f32(ng, (float *const *)g, s, sz, th, min_live, kill, live,
                                        nthreads);
    int arg_bad = ng < 0 || isnan(th) || min_live < 0 || (ng > 0 && any_neg);
    int want = arg_bad ? COMERA_ERR_ARG : any_nan ? COMERA_GATE_NAN : COMERA_OK;
    if (rc != want) FAIL("gate_prox: returned %d, expected %d\n", rc, want);
    for (int k = 0; k < n; k++) {
        int64_t m = sizes[k] > 0 ? sizes[k] : 0, alive = 0, before_nonzero = 0;
        for (int64_t i = 0; i < m; i++) {
            double gi = f64 ? ((double *)g[k])[i] : (double)((float *)g[k])[i];
            double g0i = f64 ? g0[k][i] : (double)(float)g0[k][i];
            if (rc != COMERA_OK) {
                if (s[k][i] != s0[k][i] || !(gi == g0i || (isnan(gi) && isnan(g0i))))
                    FAIL("gate_prox: gate %d entry %lld modified on error %d\n", k, (long long)i,
                         rc);
                continue;
            }
            before_nonzero += s0[k][i] != 0 && g0i != 0;
            if (s[k][i] == 0 && gi != 0) FAIL("gate_prox: dead entry not zero\n");
            if (s0[k][i] == 0 && s[k][i] != 0) FAIL("gate_prox: dead entry revived\n");
            if (s[k][i] != 0) {
                alive++;
                if (gi != 0 && s[k][i] != (gi > 0 ? 1 : -1)) FAIL("gate_prox: sign mismatch\n");
            }
        }
        if (rc == COMERA_GATE_NAN && live[k] != (nan_at[k] ? -1 : 0))
            FAIL("gate_prox: live[%d] = %lld on NaN\n", k, (long long)live[k]);
        if (rc == COMERA_OK) {
            if (live[k] != alive) FAIL("gate_prox: live[%d] %lld, counted %lld\n", k,
                                       (long long)live[k], (long long)alive);
            int64_t floor = min_live < before_nonzero ? min_live : before_nonzero;
            if (kill && alive < floor) FAIL("gate_prox: gate %d below min_live\n", k);
        }
        free(g0[k]), free(s0[k]), free(s[k]), free(g[k]);
    }
    free(sz);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size, 0};
    r.tame = rd_u8(&r) < 192;
    switch (rd_u8(&r) % 3) {
    case 0: fuzz_linear(&r); break;
    case 1: fuzz_embedding(&r); break;
    default: fuzz_gate_prox(&r); break;
    }
    return 0;
}
