/* Tests of the bfloat16 / float16 kernels, run once per micro-kernel
 * variant like the rest (make test): the scalar conversions of
 * common/half.h against known values and round trips, the vector
 * conversions of every variant (widening of A, rounding in the tile
 * stores) bit for bit against the scalar ones, the 16-bit products
 * (common/gemm_half.h) against a float64 triple loop, and the TT linear
 * entry points comera_tt_linear_fwd_half / _bwd_half against the dense
 * float64 reference of the same (rounded) values, for 16-bit and float32
 * parameters. */
#include "reference.h"
#include "comera/tt_linear.h"
#include "common/gemm.h"
#include "common/gemm_half.h"
#include "common/half.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Largest relative error (max |a - ref| / max |ref|) of the TT outputs:
 * several roundings to the 16-bit type (V, U, t, dy U^T, the output) */
#define TOL_BF16 3e-2
#define TOL_F16 4e-3
#define TOL_GEMM_BF16 1e-2
#define TOL_GEMM_F16 1.5e-3

static const char *TNAME[4] = {"f32", "f64", "bf16", "f16"};

static void test_scalar_conversions(void) {
    group_begin("half: scalar conversions");
    /* known roundings, ties to even */
    check(comera_f32_to_bf16(1.0f) == 0x3f80, "bf16(1)");
    check(comera_f32_to_bf16(1.0f / 3.0f) == 0x3eab, "bf16(1/3) = %#x",
          comera_f32_to_bf16(1.0f / 3.0f));
    check(comera_f32_to_bf16(comera_f32_from_bits(0x3f808000u)) == 0x3f80, "bf16 tie to even down");
    check(comera_f32_to_bf16(comera_f32_from_bits(0x3f818000u)) == 0x3f82, "bf16 tie to even up");
    check(comera_f32_to_bf16(comera_f32_from_bits(0x7f7fffffu)) == 0x7f80, "bf16 overflow to inf");
    check(isnan(comera_bf16_to_f32(comera_f32_to_bf16(NAN))), "bf16 NaN stays NaN");
    check(comera_f32_to_f16(1.0f) == 0x3c00, "f16(1)");
    check(comera_f32_to_f16(65504.0f) == 0x7bff, "f16(65504)");
    check(comera_f32_to_f16(65519.0f) == 0x7bff, "f16(65519)");
    check(comera_f32_to_f16(65520.0f) == 0x7c00, "f16(65520) = inf");
    check(comera_f32_to_f16(-1e10f) == 0xfc00, "f16(-1e10) = -inf");
    check(comera_f32_to_f16(ldexpf(1.0f, -24)) == 0x0001, "f16 smallest subnormal");
    check(comera_f32_to_f16(ldexpf(1.0f, -25)) == 0x0000, "f16 2^-25 ties to even (0)");
    check(comera_f32_to_f16(ldexpf(3.0f, -26)) == 0x0001, "f16 3 * 2^-26 rounds up");
    check(comera_f32_to_f16(ldexpf(3.0f, -25)) == 0x0002, "f16 3 * 2^-25 ties to even (2)");
    check(comera_f32_to_f16(1.0f + ldexpf(1.0f, -11)) == 0x3c00, "f16 tie to even down");
    check(comera_f32_to_f16(1.0f + ldexpf(3.0f, -11)) == 0x3c02, "f16 tie to even up");
    check(isnan(comera_f16_to_f32(comera_f32_to_f16(NAN))), "f16 NaN stays NaN");
    /* every 16-bit value survives widening and rounding back (NaNs as NaNs) */
    int bad_bf = 0, bad_f16 = 0;
    for (uint32_t v = 0; v < 65536; v++) {
        uint16_t h = (uint16_t)v;
        float fb = comera_bf16_to_f32(h), fh = comera_f16_to_f32(h);
        bad_bf += isnan(fb) ? !isnan(comera_bf16_to_f32(comera_f32_to_bf16(fb)))
                            : comera_f32_to_bf16(fb) != h;
        bad_f16 += isnan(fh) ? !isnan(comera_f16_to_f32(comera_f32_to_f16(fh)))
                             : comera_f32_to_f16(fh) != h;
    }
    check(bad_bf == 0 && bad_f16 == 0, "round trips: %d bf16 and %d f16 values changed", bad_bf,
          bad_f16);
    /* float16 widening is exact: compare with ldexp of the fields */
    int bad = 0;
    for (uint32_t v = 0; v < 0x7c00; v++) {
        double want = (v >> 10) ? ldexp(1.0 + (v & 0x3ff) / 1024.0, (int)(v >> 10) - 15)
                                : ldexp((double)v, -24);
        bad += comera_f16_to_f32((uint16_t)v) != (float)want;
    }
    check(bad == 0, "f16 widening: %d of the finite positive values wrong", bad);
    group_end();
}

/* The variant's vector paths, bit for bit against the scalar conversions:
 * C (M x 32, 16-bit) = A (M x 1, 16-bit) times a row of scales 2^e (1,
 * 1 + 2^-9 or 1 + 2^-8): every product is exact in float32, and the store
 * rounds it, ties included. */
static void vector_conversion_case(int h, int mode) {
    const int64_t N = 32;
    int64_t M = 0;
    uint16_t *A = xmalloc(sizeof(uint16_t) * 65536);
    for (uint32_t v = 0; v < 65536; v++) {
        float f = comera_half_to_f32(h, (uint16_t)v);
        /* finite, not -0 (a product's sum starts at +0), and (bfloat16) far
         * from float32's subnormals: AVX512-BF16 rounding takes those as 0 */
        if (isfinite(f) && v != 0x8000 && (h == COMERA_DT_F16 || f == 0.0f || fabsf(f) > 1e-30f))
            A[M++] = (uint16_t)v;
    }
    M -= M % 12;
    float scale[32];
    for (int j = 0; j < N; j++)
        scale[j] = ldexpf(1.0f + (float)(j % 3) * ldexpf(1.0f, -10 + j % 3), j % 5 - 2);
    void *Bp = xmalloc((size_t)comera_hgemm_packed_bytes(h, 1, N));
    float *scr = falloc(comera_hgemm_scratch(h, 1));
    uint16_t *C = xmalloc(sizeof(uint16_t) * (size_t)(M * N) + 64);
    uint16_t *Ca = (uint16_t *)(((uintptr_t)C + 63) / 64 * 64); /* for streaming stores */
    comera_hgemm_pack_f32(h, 1, N, scale, N, 1, Bp);
    comera_hgemm(h, M, N, 1, A, h, 1, Bp, Ca, h, N, mode, scr);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            uint16_t want = comera_f32_to_half(h, comera_half_to_f32(h, A[i]) * scale[j]);
            if (Ca[i * N + j] != want) {
                if (first < 0) first = i * N + j;
                bad++;
            }
        }
    check(bad == 0, "%s vector rounding (mode %d): %lld of %lld values differ from the scalar "
          "rounding, first at %lld", TNAME[h], mode, (long long)bad, (long long)(M * N),
          (long long)first);
    free(A); free(Bp); free(scr); free(C);
}

static void test_vector_conversions(void) {
    group_begin("half: vector widening and rounding");
    for (int h = COMERA_DT_BF16; h <= COMERA_DT_F16; h++) {
        vector_conversion_case(h, COMERA_GEMM_STORE);
        vector_conversion_case(h, COMERA_GEMM_STREAM);
    }
    group_end();
}

/* One 16-bit product against a float64 triple loop on the same values:
 * B packed from float32 (src 0) or from the 16-bit type (src 1), A 16-bit
 * or float32 (a32; values the 16-bit type holds), C float32 (stored or
 * added to) or 16-bit; ldc wider than N with sentinels that must survive. */
static void hgemm_case(lcg_t *g, int h, int64_t M, int64_t N, int64_t K, int ct, int mode,
                       int src, int a32) {
    int64_t lda = K + 3, ldc = N + 5;
    uint16_t *A = xmalloc(sizeof(uint16_t) * (size_t)(M * lda + 1));
    float *Af = falloc(M * lda + 1);
    uint16_t *Bh = xmalloc(sizeof(uint16_t) * (size_t)(K * N + 1));
    float *Bf = falloc(K * N + 1), *Cf = falloc(M * ldc + 1);
    uint16_t *Ch = xmalloc(sizeof(uint16_t) * (size_t)(M * ldc + 1));
    double *R = dalloc(M * ldc + 1);
    for (int64_t i = 0; i < M * lda; i++) {
        A[i] = comera_f32_to_half(h, (float)lcg_uniform(g));
        Af[i] = comera_half_to_f32(h, A[i]);
    }
    for (int64_t i = 0; i < K * N; i++) {
        Bh[i] = comera_f32_to_half(h, (float)lcg_uniform(g));
        /* AMX rounds a float32 B to bfloat16: give it values it keeps */
        Bf[i] = comera_half_to_f32(h, Bh[i]);
    }
    for (int64_t i = 0; i < M * ldc; i++) {
        Cf[i] = (float)lcg_uniform(g);
        Ch[i] = 0xfbff;
        R[i] = mode == COMERA_GEMM_ADD ? Cf[i] : 0.0;
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++)
            for (int64_t k = 0; k < K; k++)
                R[i * ldc + j] += (double)comera_half_to_f32(h, A[i * lda + k]) * Bf[k * N + j];
    void *Bp = xmalloc((size_t)comera_hgemm_packed_bytes(h, K, N) + 1);
    float *scr = falloc(comera_hgemm_scratch(h, K));
    if (src) comera_hgemm_pack_half(h, K, N, Bh, N, Bp);
    else comera_hgemm_pack_f32(h, K, N, Bf, N, 1, Bp);
    float *Cw = falloc(M * ldc + 1);
    memcpy(Cw, Cf, sizeof(float) * (size_t)(M * ldc));
    comera_hgemm(h, M, N, K, a32 ? (const void *)Af : (const void *)A,
                 a32 ? COMERA_DT_F32 : h, lda, Bp, ct == COMERA_DT_F32 ? (void *)Cw : (void *)Ch,
                 ct, ldc, mode, scr);
    double worst = 0.0, scale = sqrt((double)K) + 1.0;
    int untouched = 1;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < ldc; j++) {
            int64_t at = i * ldc + j;
            if (j >= N) {
                untouched &= ct == COMERA_DT_F32 ? Cw[at] == Cf[at] : Ch[at] == 0xfbff;
                continue;
            }
            double got = ct == COMERA_DT_F32 ? Cw[at] : comera_half_to_f32(h, Ch[at]);
            double e = fabs(got - R[at]) / scale;
            if (!(e <= worst)) worst = e;
        }
    double tol = h == COMERA_DT_BF16 ? TOL_GEMM_BF16 : TOL_GEMM_F16;
    group_note_err(worst);
    check(worst <= tol && untouched,
          "%s %lldx%lldx%lld A %s C %s mode %d B from %s: error %.3g (tolerance %.3g), past N %s",
          TNAME[h], (long long)M, (long long)N, (long long)K, a32 ? "f32" : TNAME[h], TNAME[ct],
          mode, src ? "16-bit" : "float32", worst, tol, untouched ? "untouched" : "WRITTEN");
    free(A); free(Af); free(Bh); free(Bf); free(Cf); free(Ch); free(R); free(Bp); free(scr); free(Cw);
}

/* COMERA_GEMM_STREAM writes what COMERA_GEMM_STORE writes, bit for bit, in
 * 64-byte-aligned rows of a float32 and of a 16-bit C (the streaming stores
 * run there). */
static void stream_case(lcg_t *g, int h, int ct) {
    const int64_t M = 40, N = 64, K = 40;
    int64_t es = ct == COMERA_DT_F32 ? 4 : 2;
    uint16_t *A = xmalloc(sizeof(uint16_t) * (size_t)(M * K));
    float *B = falloc(K * N);
    for (int64_t i = 0; i < M * K; i++) A[i] = comera_f32_to_half(h, (float)lcg_uniform(g));
    for (int64_t i = 0; i < K * N; i++) B[i] = comera_half_to_f32(h, comera_f32_to_half(h, (float)lcg_uniform(g)));
    void *Bp = xmalloc((size_t)comera_hgemm_packed_bytes(h, K, N));
    float *scr = falloc(comera_hgemm_scratch(h, K));
    char *C0 = aligned_alloc(64, (size_t)(M * N * es)), *C1 = aligned_alloc(64, (size_t)(M * N * es));
    comera_hgemm_pack_f32(h, K, N, B, N, 1, Bp);
    comera_hgemm(h, M, N, K, A, h, K, Bp, C0, ct, N, COMERA_GEMM_STORE, scr);
    comera_hgemm(h, M, N, K, A, h, K, Bp, C1, ct, N, COMERA_GEMM_STREAM, scr);
    check(memcmp(C0, C1, (size_t)(M * N * es)) == 0, "%s C %s: streamed differs from stored",
          TNAME[h], TNAME[ct]);
    free(A); free(B); free(Bp); free(scr); free(C0); free(C1);
}

static void test_hgemm(void) {
    group_begin("half: 16-bit products");
    static const int64_t MS[] = {1, 5, 12, 17, 32, 33, 100};
    static const int64_t NS[] = {1, 15, 16, 17, 31, 32, 33, 64, 100};
    static const int64_t KS[] = {0, 1, 7, 31, 32, 33, 64, 100};
    lcg_t g;
    lcg_seed(&g, 4242);
    for (int h = COMERA_DT_BF16; h <= COMERA_DT_F16; h++)
        for (int mi = 0; mi < 7; mi++)
            for (int ni = 0; ni < 9; ni++)
                for (int ki = 0; ki < 8; ki++) {
                    /* a rotating subset of the output kinds keeps the group quick */
                    int pick = (mi + ni + ki) % 5;
                    int ct = pick < 2 || pick == 4 ? COMERA_DT_F32 : h;
                    int mode = pick == 1 ? COMERA_GEMM_ADD
                               : pick >= 3 ? COMERA_GEMM_STREAM : COMERA_GEMM_STORE;
                    hgemm_case(&g, h, MS[mi], NS[ni], KS[ki], ct, mode, (mi + ki) % 2,
                               (ni + ki) % 3 == 0);
                }
    for (int h = COMERA_DT_BF16; h <= COMERA_DT_F16; h++) {
        stream_case(&g, h, COMERA_DT_F32);
        stream_case(&g, h, h);
    }
    group_end();
}

/* ---- the TT linear entry points ---- */

/* An array of type pt (a parameter, or x) holding `n` values rounded to
 * it; vals gets the values as doubles.  A float32 x is rounded to the
 * 16-bit type by the kernels: the reference reads its float32 values. */
static void *param_array(lcg_t *g, int pt, int64_t n, double lo, double hi, double *vals) {
    void *p = xmalloc((size_t)(n > 0 ? n : 1) * (pt == COMERA_DT_F32 ? 4 : 2));
    for (int64_t i = 0; i < n; i++) {
        float v = (float)(lo + (hi - lo) * 0.5 * (lcg_uniform(g) + 1.0));
        if (pt == COMERA_DT_F32) {
            ((float *)p)[i] = v;
            vals[i] = v;
        } else {
            ((uint16_t *)p)[i] = comera_f32_to_half(pt, v);
            vals[i] = comera_half_to_f32(pt, ((uint16_t *)p)[i]);
        }
    }
    return p;
}

static double param_value(const void *p, int pt, int64_t i) {
    return pt == COMERA_DT_F32 ? ((const float *)p)[i] : comera_half_to_f32(pt, ((const uint16_t *)p)[i]);
}

static double err_half(const uint16_t *a, int h, const double *ref, int64_t n, double *tmp) {
    for (int64_t i = 0; i < n; i++) tmp[i] = comera_half_to_f32(h, a[i]);
    return rel_err(tmp, ref, n);
}

static double err_param(const void *a, int pt, const double *ref, int64_t n, double *tmp) {
    for (int64_t i = 0; i < n; i++) tmp[i] = param_value(a, pt, i);
    return rel_err(tmp, ref, n);
}

static void half_tt_case(const tt_case *c, int h, int pt, int xt, int64_t B, int nt,
                         int use_bias, int use_dx, uint64_t seed) {
    int D = tt_D(c);
    int64_t rm = c->ranks[c->p], in = c->in_f, out = c->out_f;
    lcg_t g;
    lcg_seed(&g, seed);
    double *cd[TT_MAXD], *gd[TT_MAXD], *dcr[TT_MAXD], *dgr[TT_MAXD];
    void *cp[TT_MAXD], *gp[TT_MAXD], *dcp[TT_MAXD], *dgp[TT_MAXD];
    for (int k = 0; k < D; k++) {
        int64_t n = tt_core_size(c, k), r = c->ranks[k + 1];
        double s = 1.0 / sqrt((double)c->ranks[k]);
        cd[k] = dalloc(n);
        cp[k] = param_array(&g, pt, n, -s, s, cd[k]);
        dcr[k] = dalloc(n);
        dcp[k] = xmalloc((size_t)n * 4);
        gd[k] = dgr[k] = NULL;
        gp[k] = dgp[k] = NULL;
        if (k < D - 1) {
            gd[k] = dalloc(r);
            gp[k] = param_array(&g, pt, r, 0.5, 1.5, gd[k]);
            dgr[k] = dalloc(r);
            dgp[k] = xmalloc((size_t)r * 4);
        }
    }
    double *bd = dalloc(out), *dbr = dalloc(out);
    void *bp = param_array(&g, pt, out, -1, 1, bd), *dbp = xmalloc((size_t)out * 4);
    if (!use_bias) memset(bd, 0, sizeof(double) * (size_t)out);
    int64_t nx = B * in, ny = B * out, ntt = B * rm;
    uint16_t *dy = xmalloc(2 * (size_t)(ny + 1));
    uint16_t *y = xmalloc(2 * (size_t)(ny + 1)), *t = xmalloc(2 * (size_t)(ntt + 1));
    void *dx = xmalloc(4 * (size_t)(nx + 1));
    double *xd = dalloc(nx), *dyd = dalloc(ny), *yr = dalloc(ny), *tr = dalloc(ntt);
    double *dxr = dalloc(nx);
    /* x of type xt: 16-bit, or float32 (then the kernels round it) */
    void *x = param_array(&g, xt, nx, -1, 1, xd);
    for (int64_t i = 0; i < ny; i++) {
        dy[i] = comera_f32_to_half(h, (float)lcg_uniform(&g));
        dyd[i] = comera_half_to_f32(h, dy[i]);
    }
    double *wt = dalloc(tt_in_pad(c) * tt_out_pad(c)), *v = dalloc(tt_in_pad(c) * rm);
    ref_dense_wt(c, (const double *const *)cd, (const double *const *)gd, wt);
    ref_v(c, (const double *const *)cd, (const double *const *)gd, v);
    ref_forward(c, B, xd, wt, v, bd, yr, tr);
    ref_backward(c, B, dyd, xd, wt, (const double *const *)cd, (const double *const *)gd, dxr,
                 dbr, dcr, dgr);

    comera_tt_linear_desc d = {c->p, c->q, c->in_modes, c->out_modes, c->ranks, in, out};
    comera_tt_linear_prep prep;
    comera_tt_half_types ty = {h, xt, pt};
    int rc = comera_tt_linear_prepare(&d, B, COMERA_PATH_AUTO, &prep);
    if (!rc)
        rc = comera_tt_linear_fwd_half(&prep, &ty, x, (const void *const *)cp,
                                       (const void *const *)gp, use_bias ? bp : NULL, y, t, nt);
    if (!rc)
        rc = comera_tt_linear_bwd_half(&prep, &ty, dy, x, t, (const void *const *)cp,
                                       (const void *const *)gp, use_dx ? dx : NULL, dcp, dgp,
                                       use_dx ? dbp : NULL, nt);
    int64_t most = nx > ny ? nx : ny;
    for (int k = 0; k < D; k++)
        if (tt_core_size(c, k) > most) most = tt_core_size(c, k);
    double *tmp = dalloc(most + out);
    double worst = 0.0, e;
    const char *what = "-";
#define HALF_CMP(label, expr) \
    do { e = (expr); if (!(e <= worst)) { worst = e; what = label; } } while (0)
    if (B > 0) {
        HALF_CMP("y", err_half(y, h, yr, ny, tmp));
        HALF_CMP("t", err_half(t, h, tr, ntt, tmp));
    }
    if (use_dx) {
        if (B > 0) HALF_CMP("dx", err_param(dx, xt, dxr, nx, tmp));
        HALF_CMP("dbias", err_param(dbp, pt, dbr, out, tmp));
    }
    for (int k = 0; k < D; k++) {
        HALF_CMP("dcore", err_param(dcp[k], pt, dcr[k], tt_core_size(c, k), tmp));
        if (k < D - 1) HALF_CMP("dgate", err_param(dgp[k], pt, dgr[k], c->ranks[k + 1], tmp));
    }
#undef HALF_CMP
    double tol = h == COMERA_DT_BF16 ? TOL_BF16 : TOL_F16;
    group_note_err(worst);
    check(rc == 0 && worst <= tol,
          "%s %s params %s x %s batch %lld nt %d%s%s: rc %d, %s rel err %.3g (tolerance %.3g)",
          c->name, TNAME[h], TNAME[pt], TNAME[xt], (long long)B, nt, use_bias ? "" : " no bias",
          use_dx ? "" : " no dx", rc, what, worst, tol);
    for (int k = 0; k < D; k++) {
        free(cd[k]); free(cp[k]); free(dcr[k]); free(dcp[k]);
        free(gd[k]); free(gp[k]); free(dgr[k]); free(dgp[k]);
    }
    free(bd); free(dbr); free(bp); free(dbp); free(x); free(dy); free(y); free(t); free(dx);
    free(xd); free(dyd); free(yr); free(tr); free(dxr); free(wt); free(v); free(tmp);
}

static void test_half_tt(const tt_case *cases, int ncases) {
    static const int64_t BATCHES[] = {0, 1, 3, 300};
    static const int NTS[] = {1, 2, 5};
    for (int ci = 0; ci < ncases; ci++) {
        char name[96];
        snprintf(name, sizeof name, "half tt %s", cases[ci].name);
        group_begin(name);
        for (int h = COMERA_DT_BF16; h <= COMERA_DT_F16; h++)
            for (int bi = 0; bi < 4; bi++)
                for (int ni = 0; ni < 3; ni++) {
                    /* parameters and x of type h or float32, in turn */
                    int pt = (bi + ni) % 2 ? COMERA_DT_F32 : h;
                    int xt = (bi + ni + h) % 3 == 0 ? COMERA_DT_F32 : h;
                    half_tt_case(&cases[ci], h, pt, xt, BATCHES[bi], NTS[ni], ni != 1, ni != 2,
                                 7000 + (uint64_t)(ci * 100 + h * 10 + bi));
                }
        group_end();
    }
}

void test_half(const tt_case *cases, int ncases) {
    test_scalar_conversions();
    test_vector_conversions();
    test_hgemm();
    test_half_tt(cases, ncases);
    group_begin("half: wrong types refused");
    comera_tt_linear_desc d = {cases[0].p, cases[0].q, cases[0].in_modes, cases[0].out_modes,
                               cases[0].ranks, cases[0].in_f, cases[0].out_f};
    comera_tt_linear_prep prep;
    int rc = comera_tt_linear_prepare(&d, 1, COMERA_PATH_AUTO, &prep);
    comera_tt_half_types f32 = {COMERA_DT_F32, COMERA_DT_F32, COMERA_DT_F32};
    comera_tt_half_types mixed = {COMERA_DT_BF16, COMERA_DT_BF16, COMERA_DT_F16};
    comera_tt_half_types x64 = {COMERA_DT_BF16, COMERA_DT_F64, COMERA_DT_BF16};
    check(rc == 0 && comera_tt_linear_fwd_half(&prep, &f32, NULL, NULL, NULL, NULL, NULL, NULL,
                                               1) == COMERA_ERR_ARG,
          "float32 activations refused");
    check(comera_tt_linear_fwd_half(&prep, &mixed, NULL, NULL, NULL, NULL, NULL, NULL, 1) ==
              COMERA_ERR_ARG,
          "float16 parameters with bfloat16 activations refused");
    check(comera_tt_linear_bwd_half(&prep, &x64, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                    NULL, 1) == COMERA_ERR_ARG,
          "a float64 x refused");
    group_end();
}
