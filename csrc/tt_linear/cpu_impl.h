/* TT linear layer, CPU kernels: the body shared by float32 and float64.
 *
 * C has no templates, and one text for both element types keeps them from
 * drifting apart, so this file is compiled twice: cpu_f32.c defines REAL as
 * float and includes it, cpu_f64.c as double.  Every function here is
 * static and has its plain name (make_eff, fwd_merge, ...): a name means
 * the same in both units, and grep finds each definition and call.  The
 * GEMM is called through the short names of common/gemm_real.h (gemm,
 * gemm_packed, ...), which resolve to comera_gemm_*_f32 or _f64 with REAL.
 * The public entry points (comera_tt_linear_fwd_f32, ...) are written out
 * by name in cpu_f32.c and cpu_f64.c, as thin wrappers of linear_fwd and
 * linear_bwd at the end of this file.  Checks and planning: plan.c. */
#ifndef REAL
#error "define REAL (float or double) before including tt_linear/cpu_impl.h"
#endif

#include "tt_linear/shape.h"
#include "common/gemm_real.h"
#include "common/threads.h"
#include "common/workspace.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Carves consecutive pieces of n[i] elements, each starting on a 64-byte
 * boundary, out of one workspace block; returns the elements needed when
 * block is NULL. */
static int64_t carve(REAL *block, int count, const int64_t *n, REAL **piece) {
    int64_t off = 0, line = 64 / (int64_t)sizeof(REAL);
    for (int i = 0; i < count; i++) {
        if (block) piece[i] = block + off;
        off += (n[i] + line - 1) / line * line;
    }
    return off;
}

/* core k times its gate on the last rank index; the last core has none.
 * Restrict-qualified locals: the build keeps -fno-strict-aliasing, under
 * which the compiler would otherwise check for overlap on every row. */
static void make_eff(const tt_shape *s, const REAL *const *cores,
                     const REAL *const *gates, REAL *eff) {
    for (int k = 0; k < s->D; k++) {
        const REAL *restrict c = cores[k];
        REAL *restrict e = eff + s->core_off[k];
        int64_t rows = s->r[k] * s->dims[k], cols = s->r[k + 1];
        if (k == s->D - 1) {
            memcpy(e, c, sizeof(REAL) * (size_t)(rows * cols));
            continue;
        }
        const REAL *restrict g = gates[k];
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) e[i * cols + j] = c[i * cols + j] * g[j];
    }
}

/* Gradients of the cores and gates from the gradient of the scaled cores. */
static void eff_grads(const tt_shape *s, const REAL *const *cores,
                      const REAL *const *gates, const REAL *deff,
                      REAL *const *dcores, REAL *const *dgates) {
    for (int k = 0; k < s->D; k++) {
        const REAL *restrict c = cores[k], *restrict de = deff + s->core_off[k];
        REAL *restrict dc = dcores[k];
        int64_t rows = s->r[k] * s->dims[k], cols = s->r[k + 1];
        if (k == s->D - 1) {
            memcpy(dc, de, sizeof(REAL) * (size_t)(rows * cols));
            continue;
        }
        const REAL *restrict g = gates[k];
        REAL *restrict dg = dgates[k];
        for (int64_t j = 0; j < cols; j++) dg[j] = 0;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) {
                dc[i * cols + j] = de[i * cols + j] * g[j];
                dg[j] += de[i * cols + j] * c[i * cols + j];
            }
    }
}

/* P_first = core first; P_k = P_{k-1} (X x r_k) times core k (r_k x n_k r_{k+1}).
 * The last P of the V chain is V (in_pad x r_mid); of the U chain, U
 * (r_mid x out_pad). */
static int merge_chain(const tt_shape *s, int first, int last,
                       const REAL *eff, REAL *P) {
    int64_t n0 = s->P_off[first + 1] - s->P_off[first];
    memcpy(P + s->P_off[first], eff + s->core_off[first], sizeof(REAL) * (size_t)n0);
    for (int k = first + 1; k <= last; k++) {
        int64_t X = (s->P_off[k] - s->P_off[k - 1]) / s->r[k];
        int64_t N = s->dims[k] * s->r[k + 1];
        int rc = gemm(X, N, s->r[k], P + s->P_off[k - 1], s->r[k], 1,
                      eff + s->core_off[k], N, 1, P + s->P_off[k], N, 0);
        if (rc) return rc;
    }
    return COMERA_OK;
}

/* Back through merge_chain: dP holds d(P_last) at its offset on entry and
 * is used as scratch; writes d(eff) of cores first..last. */
static int merge_chain_bwd(const tt_shape *s, int first, int last,
                           const REAL *eff, const REAL *P, REAL *dP,
                           REAL *deff) {
    for (int k = last; k > first; k--) {
        int64_t X = (s->P_off[k] - s->P_off[k - 1]) / s->r[k];
        int64_t N = s->dims[k] * s->r[k + 1];
        const REAL *Pprev = P + s->P_off[k - 1];
        const REAL *dPk = dP + s->P_off[k];
        int rc = gemm(s->r[k], N, X, Pprev, 1, s->r[k], dPk, N, 1,
                      deff + s->core_off[k], N, 0);
        if (rc) return rc;
        rc = gemm(X, s->r[k], N, dPk, N, 1, eff + s->core_off[k], 1, N,
                  dP + s->P_off[k - 1], s->r[k], 0);
        if (rc) return rc;
    }
    int64_t n0 = s->P_off[first + 1] - s->P_off[first];
    memcpy(deff + s->core_off[first], dP + s->P_off[first], sizeof(REAL) * (size_t)n0);
    return COMERA_OK;
}

static int build_merges(const tt_shape *s, const REAL *const *cores,
                        const REAL *const *gates, REAL *eff, REAL *P) {
    make_eff(s, cores, gates, eff);
    int rc = merge_chain(s, 0, s->p - 1, eff, P);
    if (rc) return rc;
    return merge_chain(s, s->p, s->D - 1, eff, P);
}

/* One row block of the merge forward: T = x V, then y = [T | 1] [U; bias],
 * the bias folded into the product as one more row of U (no second pass
 * over y).  Te is a rb x (r + 1) scratch; without a bias y = T U.  Vk is V
 * packed, or V^T (r x in) when dot: a rank where the packed panels would
 * be mostly padding (comera_gemm_dot_wins). */
static void fwd_block(const tt_shape *s, int64_t nr, const REAL *xb, const REAL *Vk,
                      int dot, const REAL *Up, int has_bias, REAL *tb, REAL *yb, REAL *Te,
                      int ymode) {
    int64_t in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    if (dot) gemm_dot(nr, rm, in, xb, in, Vk, in, tb, rm, NULL);
    else gemm_packed(nr, rm, in, xb, in, 1, Vk, tb, rm, 0);
    if (!has_bias) {
        gemm_packed(nr, out, rm, tb, rm, 1, Up, yb, out, ymode);
        return;
    }
    for (int64_t i = 0; i < nr; i++) {
        memcpy(Te + i * re, tb + i * rm, sizeof(REAL) * (size_t)rm);
        Te[i * re + rm] = 1;
    }
    gemm_packed(nr, out, re, Te, re, 1, Up, yb, out, ymode);
}

static int fwd_merge(const tt_shape *s, int64_t batch, const REAL *x,
                     const REAL *const *cores, const REAL *const *gates,
                     const REAL *bias, REAL *y, REAL *t, int nthreads) {
    int64_t in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    int64_t rb = comera_tt_row_block(s);
    int64_t blocks = (batch + rb - 1) / rb;
    int nt = comera_threads_for_items(nthreads, blocks);
    /* eff, P, Vp, Up, Te (per thread), Ub: one reused block */
    int64_t n[6] = {s->core_off[s->D], s->P_off[s->D], comera_gemm_packed_size(in, rm),
                    comera_gemm_packed_size(re, out), rb * re * nt, bias ? re * out : 0};
    REAL *part[6];
    int cached = 0;
    REAL *block = comera_ws_acquire(sizeof(REAL) * (size_t)carve(NULL, 6, n, part), &cached);
    if (!block) return COMERA_ERR_NOMEM;
    carve(block, 6, n, part);
    REAL *eff = part[0], *P = part[1], *Vp = part[2], *Up = part[3], *Te = part[4], *Ub = part[5];
    int rc = build_merges(s, cores, gates, eff, P);
    if (!rc) {
        const REAL *V = P + s->P_off[s->p - 1], *U = P + s->P_off[s->D - 1];
        int dot = gemm_dot_wins(rm);
        if (dot)
            for (int64_t c = 0; c < rm; c++)
                for (int64_t i = 0; i < in; i++) Vp[c * in + i] = V[i * rm + c];
        else
            gemm_pack_b(in, rm, V, rm, 1, Vp);
        if (bias) {
            /* [U; bias]: U's rows are the panel rows 0..rm-1, the bias row rm */
            for (int64_t c = 0; c < rm; c++)
                memcpy(Ub + c * out, U + c * s->out_pad, sizeof(REAL) * (size_t)out);
            memcpy(Ub + rm * out, bias, sizeof(REAL) * (size_t)out);
            gemm_pack_b(re, out, Ub, out, 1, Up);
        } else {
            gemm_pack_b(rm, out, U, s->out_pad, 1, Up);
        }
        int ymode = comera_gemm_store_mode(batch * out * (int64_t)sizeof(REAL));
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r0 = b * rb, nr = batch - r0 < rb ? batch - r0 : rb;
            fwd_block(s, nr, x + r0 * in, Vp, dot, Up, bias != NULL, t + r0 * rm,
                      y + r0 * out, Te + rb * re * omp_get_thread_num(), ymode);
        }
    }
    comera_ws_release(block, cached);
    return rc;
}

/* One row block of the merge backward, on one thread's workspace:
 *   S = dy U^T, dx = S V^T, dU += [T | 1]^T dy, dV^T += S^T x.
 * The column of ones turns the bias gradient (column sums of dy) into one
 * more row of the dU product.  The weight-gradient products read the dy
 * and x blocks in place, as rows of B (comera_gemm_rows_*): the blocks are
 * still in L2 from the S product, and packing them into panels first was a
 * pass of its own (docs/design.md section 5). */
typedef struct {
    REAL *dUe; /* (r + 1) x out: d(U), last row d(bias) */
    REAL *dVt; /* r x in: d(V)^T */
    REAL *S;   /* rb x r */
    REAL *Te;  /* rb x (r + 1): [T | 1] */
    REAL *Bp;  /* the last N % 16 columns of a dy or x block, packed */
    int dxmode; /* how dx is stored (comera_gemm_store_mode) */
    const REAL *U; /* when not NULL: S by the dot kernel from U (r x out) */
} bwd_ws;

static void bwd_block(const tt_shape *s, int64_t nr, const REAL *dyb, const REAL *xb,
                      const REAL *tb, const REAL *UTp, const REAL *VTp, REAL *dxb,
                      const bwd_ws *w) {
    int64_t in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    if (w->U) gemm_dot(nr, rm, out, dyb, out, w->U, s->out_pad, w->S, rm, NULL);
    else gemm_packed(nr, rm, out, dyb, out, 1, UTp, w->S, rm, 0);
    if (dxb) gemm_packed(nr, in, rm, w->S, rm, 1, VTp, dxb, in, w->dxmode);
    for (int64_t i = 0; i < nr; i++) {
        memcpy(w->Te + i * re, tb + i * rm, sizeof(REAL) * (size_t)rm);
        w->Te[i * re + rm] = 1;
    }
    /* dy and x rows read in place: packing them was a pass of its own */
    gemm_rows(re, out, nr, w->Te, 1, re, dyb, out, w->dUe, out, 1, w->Bp);
    gemm_rows(rm, in, nr, w->S, 1, rm, xb, in, w->dVt, in, 1, w->Bp);
}

static int bwd_merge(const tt_shape *s, int64_t batch, const REAL *dy,
                     const REAL *x, const REAL *t, const REAL *const *cores,
                     const REAL *const *gates, REAL *dx, REAL *const *dcores,
                     REAL *const *dgates, REAL *dbias, int nthreads) {
    int64_t in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    int64_t rb = comera_tt_row_block(s);
    int64_t blocks = (batch + rb - 1) / rb;
    int nt = comera_threads_for_items(nthreads, blocks);
    int64_t per = out * re + in * rm + rb * rm + rb * re + comera_gemm_packed_size(rb, 1);
    /* S by the dot kernel reads U itself: no packed U^T then */
    int dot = gemm_dot_wins(rm);
    /* eff, deff, P, dP, UTp, VTp, per-thread ws: one reused block */
    int64_t n[7] = {s->core_off[s->D], s->core_off[s->D], s->P_off[s->D], s->P_off[s->D],
                    dot ? 0 : comera_gemm_packed_size(out, rm), comera_gemm_packed_size(rm, in),
                    per * nt};
    REAL *part[7];
    int cached = 0;
    REAL *block = comera_ws_acquire(sizeof(REAL) * (size_t)carve(NULL, 7, n, part), &cached);
    if (!block) return COMERA_ERR_NOMEM;
    carve(block, 7, n, part);
    REAL *eff = part[0], *deff = part[1], *P = part[2], *dP = part[3];
    REAL *UTp = part[4], *VTp = part[5], *ws = part[6];
    /* the sums start at zero: d(P) (read at the chain ends) and each
     * thread's d(U) and d(V)^T; its S, [T | 1] and packed block are written
     * before they are read */
    memset(dP, 0, sizeof(REAL) * (size_t)n[3]);
    for (int th = 0; th < nt; th++)
        memset(ws + per * th, 0, sizeof(REAL) * (size_t)(out * re + in * rm));
    int rc = build_merges(s, cores, gates, eff, P);
    if (!rc) {
        const REAL *V = P + s->P_off[s->p - 1], *U = P + s->P_off[s->D - 1];
        if (!dot) gemm_pack_b(out, rm, U, 1, s->out_pad, UTp);
        gemm_pack_b(rm, in, V, 1, rm, VTp);
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            int tid = omp_get_thread_num();
            bwd_ws w;
            w.dUe = ws + per * tid;
            w.dVt = w.dUe + re * out;
            w.S = w.dVt + rm * in;
            w.Te = w.S + rb * rm;
            w.Bp = w.Te + rb * re;
            w.dxmode = comera_gemm_store_mode(batch * in * (int64_t)sizeof(REAL));
            w.U = dot ? U : NULL;
            /* stride by the team actually granted: inside another parallel
             * region (or with OMP_DYNAMIC) it may be smaller than nt; unused
             * per-thread sums stay zero */
            int team = omp_get_num_threads();
            for (int64_t b = tid; b < blocks; b += team) {
                int64_t r0 = b * rb, nr = batch - r0 < rb ? batch - r0 : rb;
                bwd_block(s, nr, dy + r0 * out, x + r0 * in, t + r0 * rm, UTp, VTp,
                          dx ? dx + r0 * in : NULL, &w);
            }
        }
        /* reduce the per-thread sums into d(V) and d(U) at the chain ends */
        REAL *dVall = dP + s->P_off[s->p - 1], *dUall = dP + s->P_off[s->D - 1];
        if (dbias)
            for (int64_t j = 0; j < out; j++) dbias[j] = 0;
        for (int th = 0; th < nt; th++) {
            const REAL *dUe = ws + per * th, *dVt = dUe + re * out;
            for (int64_t c = 0; c < rm; c++)
                for (int64_t j = 0; j < out; j++) dUall[c * s->out_pad + j] += dUe[c * out + j];
            for (int64_t i = 0; i < in; i++)
                for (int64_t c = 0; c < rm; c++) dVall[i * rm + c] += dVt[c * in + i];
            if (dbias)
                for (int64_t j = 0; j < out; j++) dbias[j] += dUe[rm * out + j];
        }
        rc = merge_chain_bwd(s, 0, s->p - 1, eff, P, dP, deff);
        if (!rc) rc = merge_chain_bwd(s, s->p, s->D - 1, eff, P, dP, deff);
        if (!rc) eff_grads(s, cores, gates, deff, dcores, dgates);
    }
    comera_ws_release(block, cached);
    return rc;
}

/* One row through the cores; fills the row's Z and Y states in st. */
static int seq_row_fwd(const tt_shape *s, const REAL *xr, const REAL *eff, REAL *st) {
    REAL *Z0 = st + s->Z_off[0];
    memcpy(Z0, xr, sizeof(REAL) * (size_t)s->in);
    for (int64_t i = s->in; i < s->in_pad; i++) Z0[i] = 0;
    for (int k = 0; k < s->p; k++) {
        int rc = gemm(s->r[k + 1], s->R[k + 1], s->r[k] * s->dims[k],
                      eff + s->core_off[k], 1, s->r[k + 1],
                      st + s->Z_off[k], s->R[k + 1], 1,
                      st + s->Z_off[k + 1], s->R[k + 1], 0);
        if (rc) return rc;
    }
    for (int l = 1; l <= s->D - s->p; l++) {
        int c = s->p + l - 1;
        int64_t N = s->dims[c] * s->r[c + 1];
        int rc = gemm(s->M[l - 1], N, s->r[c], st + s->Y_off[l - 1], s->r[c], 1,
                      eff + s->core_off[c], N, 1, st + s->Y_off[l], N, 0);
        if (rc) return rc;
    }
    return COMERA_OK;
}

/* The rows of a sequential call, shared among a team (comera_run_team). */
typedef struct seq_job {
    const tt_shape *s;
    int64_t batch, per;    /* rows; workspace elements per thread */
    const REAL *x, *dy, *eff, *bias;
    REAL *ws, *y, *t, *dx; /* y, t: forward; dx (or NULL): backward */
    int rc;
} seq_job;

static void fwd_seq_rows(void *arg, int tid, int team) {
    seq_job *j = arg;
    const tt_shape *s = j->s;
    REAL *st = j->ws + j->per * tid;
    int q = s->D - s->p;
    int64_t b0, b1;
    comera_team_rows(j->batch, tid, team, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) {
        if (seq_row_fwd(s, j->x + b * s->in, j->eff, st)) {
#pragma omp atomic write
            j->rc = COMERA_ERR_NOMEM;
            continue;
        }
        memcpy(j->t + b * s->rmid, st + s->Z_off[s->p], sizeof(REAL) * (size_t)s->rmid);
        /* locals: under -fno-strict-aliasing a store to y would reload s and j */
        const REAL *restrict yq = st + s->Y_off[q], *restrict bias = j->bias;
        REAL *restrict yr = j->y + b * s->out;
        int64_t out = s->out;
        if (bias)
            for (int64_t c = 0; c < out; c++) yr[c] = yq[c] + bias[c];
        else
            memcpy(yr, yq, sizeof(REAL) * (size_t)out);
    }
}

static int fwd_seq(const tt_shape *s, int64_t batch, const REAL *x,
                   const REAL *const *cores, const REAL *const *gates,
                   const REAL *bias, REAL *y, REAL *t, int nthreads) {
    int nt = comera_threads_for_items(nthreads, batch);
    /* eff, then one state block per thread: one reused workspace block (a
     * few-row call is mostly overhead, and malloc/free was a third of it) */
    int64_t n[2] = {s->core_off[s->D], s->seq_total * nt};
    REAL *part[2];
    int cached = 0;
    REAL *block = comera_ws_acquire(sizeof(REAL) * (size_t)carve(NULL, 2, n, part), &cached);
    if (!block) return COMERA_ERR_NOMEM;
    carve(block, 2, n, part);
    make_eff(s, cores, gates, part[0]);
    seq_job job = {.s = s, .batch = batch, .per = s->seq_total, .x = x, .eff = part[0],
                   .bias = bias, .ws = part[1], .y = y, .t = t, .rc = COMERA_OK};
    comera_run_team(nt, fwd_seq_rows, &job);
    comera_ws_release(block, cached);
    return job.rc;
}

/* One row of the sequential backward on one thread's states st: the
 * gradients of its scaled cores and bias are added into de and db, dx's
 * row written (when dx is not NULL). */
static int seq_row_bwd(const tt_shape *s, const REAL *xr, const REAL *dyr, const REAL *eff,
                       REAL *st, REAL *dxr) {
    REAL *ga = st + s->seq_total, *gb = ga + s->seq_state_max;
    REAL *de = gb + s->seq_state_max, *db = de + s->core_off[s->D];
    int err = seq_row_fwd(s, xr, eff, st);
    int q = s->D - s->p;
    int64_t out = s->out, out_pad = s->out_pad;
    for (int64_t j = 0; j < out; j++) { ga[j] = dyr[j]; db[j] += dyr[j]; }
    for (int64_t j = out; j < out_pad; j++) ga[j] = 0;
    for (int l = q; l >= 1 && !err; l--) {
        int c = s->p + l - 1;
        int64_t N = s->dims[c] * s->r[c + 1], Mp = s->M[l - 1];
        err |= gemm(s->r[c], N, Mp, st + s->Y_off[l - 1], 1, s->r[c],
                    ga, N, 1, de + s->core_off[c], N, 1);
        err |= gemm(Mp, s->r[c], N, ga, N, 1, eff + s->core_off[c], 1, N,
                    gb, s->r[c], 0);
        REAL *tmp = ga; ga = gb; gb = tmp;
    }
    for (int k = s->p - 1; k >= 0 && !err; k--) {
        int64_t Rn = s->R[k + 1], rows = s->r[k] * s->dims[k];
        err |= gemm(rows, s->r[k + 1], Rn, st + s->Z_off[k], Rn, 1,
                    ga, 1, Rn, de + s->core_off[k], s->r[k + 1], 1);
        err |= gemm(rows, Rn, s->r[k + 1], eff + s->core_off[k], s->r[k + 1], 1,
                    ga, Rn, 1, gb, Rn, 0);
        REAL *tmp = ga; ga = gb; gb = tmp;
    }
    if (!err && dxr) memcpy(dxr, ga, sizeof(REAL) * (size_t)s->in);
    return err;
}

static void bwd_seq_rows(void *arg, int tid, int team) {
    seq_job *j = arg;
    const tt_shape *s = j->s;
    REAL *st = j->ws + j->per * tid;
    int64_t b0, b1;
    comera_team_rows(j->batch, tid, team, &b0, &b1);
    for (int64_t b = b0; b < b1; b++)
        if (seq_row_bwd(s, j->x + b * s->in, j->dy + b * s->out, j->eff, st,
                        j->dx ? j->dx + b * s->in : NULL)) {
#pragma omp atomic write
            j->rc = COMERA_ERR_NOMEM;
        }
}

static int bwd_seq(const tt_shape *s, int64_t batch, const REAL *dy,
                   const REAL *x, const REAL *const *cores,
                   const REAL *const *gates, REAL *dx, REAL *const *dcores,
                   REAL *const *dgates, REAL *dbias, int nthreads) {
    int nt = comera_threads_for_items(nthreads, batch);
    int64_t nc = s->core_off[s->D];
    /* eff; per thread: states, two gradient scratch states, d(eff), dbias;
     * with several threads their sum of d(eff) and dbias: one reused
     * workspace block */
    int64_t per = s->seq_total + 2 * s->seq_state_max + nc + s->out;
    int64_t n[3] = {nc, per * nt, nt > 1 ? nc + s->out : 0};
    REAL *part[3];
    int cached = 0;
    REAL *block = comera_ws_acquire(sizeof(REAL) * (size_t)carve(NULL, 3, n, part), &cached);
    if (!block) return COMERA_ERR_NOMEM;
    carve(block, 3, n, part);
    REAL *eff = part[0], *ws = part[1], *dsum = part[2];
    memset(ws, 0, sizeof(REAL) * (size_t)(per * nt));
    make_eff(s, cores, gates, eff);
    seq_job job = {.s = s, .batch = batch, .per = per, .x = x, .dy = dy, .eff = eff,
                   .ws = ws, .dx = dx, .rc = COMERA_OK};
    comera_run_team(nt, bwd_seq_rows, &job);
    if (!job.rc) {
        /* one thread's sums are the result; several are added up (n_sum a
         * local: under -fno-strict-aliasing a store to the sum reloads s) */
        int64_t n_sum = nc + s->out, de_at = s->seq_total + 2 * s->seq_state_max;
        REAL *restrict sum = nt == 1 ? ws + de_at : dsum;
        if (nt > 1) {
            memset(sum, 0, sizeof(REAL) * (size_t)n_sum);
            for (int th = 0; th < nt; th++) {
                const REAL *restrict de = ws + per * th + de_at;
                for (int64_t i = 0; i < n_sum; i++) sum[i] += de[i];
            }
        }
        if (dbias) memcpy(dbias, sum + nc, sizeof(REAL) * (size_t)s->out);
        eff_grads(s, cores, gates, sum, dcores, dgates);
    }
    comera_ws_release(block, cached);
    return job.rc;
}

/* The entry points behind the public wrappers in cpu_f32.c and cpu_f64.c. */
static int linear_fwd(const comera_tt_linear_prep *p, const REAL *x, const REAL *const *cores,
                      const REAL *const *gates, const REAL *bias, REAL *y, REAL *t,
                      int nthreads) {
    if (p->batch == 0) return COMERA_OK;
    if (p->path == COMERA_PATH_MERGE)
        return fwd_merge(&p->shape, p->batch, x, cores, gates, bias, y, t, nthreads);
    return fwd_seq(&p->shape, p->batch, x, cores, gates, bias, y, t, nthreads);
}

static int linear_bwd(const comera_tt_linear_prep *p, const REAL *dy, const REAL *x,
                      const REAL *t, const REAL *const *cores, const REAL *const *gates,
                      REAL *dx, REAL *const *dcores, REAL *const *dgates, REAL *dbias,
                      int nthreads) {
    if (p->path == COMERA_PATH_MERGE && p->batch > 0)
        return bwd_merge(&p->shape, p->batch, dy, x, t, cores, gates, dx, dcores, dgates,
                         dbias, nthreads);
    return bwd_seq(&p->shape, p->batch, dy, x, cores, gates, dx, dcores, dgates, dbias,
                   nthreads);
}
