/* TT linear layer, CPU kernels for bfloat16 and float16 activations.
 *
 * y, t and dy are 16-bit (type h: COMERA_DT_BF16 or COMERA_DT_F16); x and
 * dx are of type h or float32 (xt); the cores, gates and bias, and their
 * gradients, of type h or float32 (pt).  Under torch.autocast a float32
 * layer keeps its parameters in float32, and its input may be a float32
 * tensor that F.linear would cast: the kernels take both as they are.
 * Every product accumulates in float32 and reads and writes the tensors
 * where they lie (common/gemm_half.h): no copy of x, dy, y or dx in
 * another type is made (a float32 x is rounded block by block on its way
 * to the AMX tiles, or read as it is by the float32 dot kernel for t).
 *
 * The algorithm is the float32 merge path (cpu_impl.h, docs/design.md
 * section 2) with its batch products in 16 bits:
 *   V, U      built in float32 from the gated cores (converted as they are
 *             read), packed once per call for the 16-bit products
 *   forward   t = x V (rounded to h: it is the saved output), then
 *             y = [t 1] [U; bias]
 *   backward  S = dy U^T (rounded to h), dx = S V^T, [dU; dbias] +=
 *             [t 1]^T dy and dV^T += S^T x per thread in float32, then
 *             back through the merges in float32.
 * The rounding points are the CUDA kernels' (cuda.cu).  Every call takes
 * the merge path: the sequential path has no 16-bit form (its per-row
 * products are too small for the 16-bit kernels), and the merge path's
 * batch-independent work is small beside a call's products. */
#include "tt_linear/shape.h"
#include "common/gemm.h"
#include "common/gemm_half.h"
#include "common/gemm_hnarrow.h"
#include "common/half.h"
#include "common/threads.h"
#include "common/workspace.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* A parameter element (cores, gates, bias: float32 or type pt) as float32,
 * and back. */
static float param_get(const void *p, int pt, int64_t i) {
    if (pt == COMERA_DT_F32) return ((const float *)p)[i];
    return comera_half_to_f32(pt, ((const uint16_t *)p)[i]);
}

static void param_put(void *p, int pt, int64_t i, float v) {
    if (pt == COMERA_DT_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = comera_f32_to_half(pt, v);
}

/* The offsets of consecutive pieces of bytes[i] bytes, each on a 64-byte
 * boundary, in one block; returns the block's bytes. */
static int64_t carve_bytes(int count, const int64_t *bytes, int64_t *off) {
    int64_t end = 0;
    for (int i = 0; i < count; i++) {
        off[i] = end;
        end += (bytes[i] + 63) / 64 * 64;
    }
    return end;
}

/* eff (float32) = core k times its gate on the last rank index, from
 * parameters of type pt; the last core has no gate. */
static void eff_from_params(const tt_shape *s, int pt, const void *const *cores,
                            const void *const *gates, float *eff) {
    for (int k = 0; k < s->D; k++) {
        float *e = eff + s->core_off[k];
        int64_t rows = s->r[k] * s->dims[k], cols = s->r[k + 1];
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) {
                float g = k == s->D - 1 ? 1.0f : param_get(gates[k], pt, j);
                e[i * cols + j] = param_get(cores[k], pt, i * cols + j) * g;
            }
    }
}

/* Gradients of the cores and gates (type pt) from d(eff) in float32. */
static void param_grads(const tt_shape *s, int pt, const void *const *cores,
                        const void *const *gates, const float *deff, void *const *dcores,
                        void *const *dgates) {
    for (int k = 0; k < s->D; k++) {
        const float *de = deff + s->core_off[k];
        int64_t rows = s->r[k] * s->dims[k], cols = s->r[k + 1];
        int gated = k < s->D - 1;
        for (int64_t j = 0; j < cols; j++) {
            float g = gated ? param_get(gates[k], pt, j) : 1.0f, dg = 0.0f;
            for (int64_t i = 0; i < rows; i++) {
                float d = de[i * cols + j];
                param_put(dcores[k], pt, i * cols + j, d * g);
                if (gated) dg += d * param_get(cores[k], pt, i * cols + j);
            }
            if (gated) param_put(dgates[k], pt, j, dg);
        }
    }
}

/* Rows [t | 1] of a block in type h, row stride re. */
static void ones_column(int64_t nr, int64_t rm, const uint16_t *t, uint16_t one, uint16_t *Te) {
    for (int64_t i = 0; i < nr; i++) {
        memcpy(Te + i * (rm + 1), t + i * rm, sizeof(uint16_t) * (size_t)rm);
        Te[i * (rm + 1) + rm] = one;
    }
}

/* dst (cols x nr, row stride ld) = src (nr x cols, row stride cols)^T */
static void transpose_half(int64_t nr, int64_t cols, const uint16_t *src, uint16_t *dst,
                           int64_t ld) {
    for (int64_t i = 0; i < nr; i++)
        for (int64_t c = 0; c < cols; c++) dst[c * ld + i] = src[i * cols + c];
}

/* dst (rows x cols, type h, row-major) = src rounded, element (r, c) at
 * src[r * rs + c * cs]: V^T or U as the narrow kernels' bfloat16 rows. */
static void rounded_rows(int h, int64_t rows, int64_t cols, const float *src, int64_t rs,
                         int64_t cs, uint16_t *dst) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            dst[r * cols + c] = comera_f32_to_half(h, src[r * rs + c * cs]);
}

/* Bytes of an element of type dt. */
static int64_t elem_bytes(int dt) {
    return dt == COMERA_DT_F32 ? 4 : 2;
}

/* A rank up to which the narrow bfloat16 kernels (common/gemm_hnarrow.c)
 * run the products whose one side is the rank, where they are usable:
 * measured on an AVX-512 EPYC at 768 -> 768, 4096 rows, one thread, the
 * backward's S and weight-gradient products took 1.2 against 2.8 ms at
 * rank 8, 3.9 against 4.8 at rank 30, and broke even at rank 40. */
#define HNARROW_MAX_RANK 32

static int use_hnarrow(int h, int64_t rm) {
    return rm <= HNARROW_MAX_RANK && comera_hnarrow_usable(h);
}

/* x V and dy U^T as float32 dot products over widened rows of x and dy
 * (comera_hgemm_dot) on a variant without pair kernels for h, at the
 * ranks where the float32 path takes its dot kernel. */
static int use_widened_dot(int h, int64_t rm) {
    return !comera_hgemm_pairs(h) && comera_gemm_dot_wins_f32(rm);
}

static int fwd_half(const comera_tt_linear_prep *p, int h, int pt, int xt, const void *x,
                    const void *const *cores, const void *const *gates, const void *bias,
                    uint16_t *y, uint16_t *t, int nthreads) {
    const tt_shape *s = &p->shape;
    int64_t batch = p->batch, in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    int64_t ku = bias ? re : rm; /* depth of the y product */
    int64_t rb = comera_tt_row_block_half(s);
    int64_t blocks = (batch + rb - 1) / rb;
    int nt = comera_threads_for_items(nthreads, blocks);
    int64_t scratch = comera_hgemm_scratch(h, in > ku ? in : ku);
    /* a float32 x at a rank the dot kernel suits: t = x V in float32 dot
     * products from x as it lies (the 16-bit tiles would round x first and
     * compute 16 or 32 columns for rm), then rounded to h */
    int dot = xt == COMERA_DT_F32 && comera_gemm_dot_wins_f32(rm);
    /* a 16-bit x on the narrow bfloat16 kernel: t = x V^T's rows, read as
     * they lie */
    int hdot = xt == h && use_hnarrow(h, rm);
    /* elsewhere, without pair kernels: x widened a row group at a time and
     * t in float32 dot products, as for a float32 x */
    int wdot = xt == h && !hdot && use_widened_dot(h, rm);
    int64_t te = (rb * re * 2 + 63) / 64 * 64, tf = dot ? (rb * rm * 4 + 63) / 64 * 64 : 0;
    int64_t per = te + tf + scratch * 4;
    /* eff, P, [U; bias] (float32), packed V (or V^T for the dot kernel) and
     * U, per thread [t | 1], float32 t and the products' scratch: one
     * reused block */
    int64_t n[6] = {4 * s->core_off[s->D], 4 * s->P_off[s->D], bias ? 4 * re * out : 0,
                    dot || wdot ? 4 * rm * in
                    : hdot      ? 2 * rm * in
                                : comera_hgemm_packed_bytes(h, in, rm),
                    comera_hgemm_packed_bytes(h, ku, out), per * nt};
    int64_t off[6];
    int cached = 0;
    char *block = comera_ws_acquire((size_t)carve_bytes(6, n, off), &cached);
    if (!block) return COMERA_ERR_NOMEM;
    float *eff = (float *)(block + off[0]), *P = (float *)(block + off[1]);
    float *Ub = (float *)(block + off[2]);
    void *Vp = block + off[3], *Up = block + off[4];
    char *ws = block + off[5];
    eff_from_params(s, pt, cores, gates, eff);
    int rc = comera_tt_merges_f32(s, eff, P);
    if (!rc) {
        const float *V = P + s->P_off[s->p - 1], *U = P + s->P_off[s->D - 1];
        if (dot || wdot)
            for (int64_t c = 0; c < rm; c++)
                for (int64_t i = 0; i < in; i++) ((float *)Vp)[c * in + i] = V[i * rm + c];
        else if (hdot)
            rounded_rows(h, rm, in, V, 1, rm, Vp);
        else
            comera_hgemm_pack_f32(h, in, rm, V, rm, 1, Vp);
        if (bias) {
            /* [U; bias]: U's rows, then the bias as row rm */
            for (int64_t c = 0; c < rm; c++)
                memcpy(Ub + c * out, U + c * s->out_pad, sizeof(float) * (size_t)out);
            for (int64_t j = 0; j < out; j++) Ub[rm * out + j] = param_get(bias, pt, j);
            comera_hgemm_pack_f32(h, re, out, Ub, out, 1, Up);
        } else {
            comera_hgemm_pack_f32(h, rm, out, U, s->out_pad, 1, Up);
        }
        int ymode = comera_gemm_store_mode(batch * out * 2);
        uint16_t one = comera_f32_to_half(h, 1.0f);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r0 = b * rb, nr = batch - r0 < rb ? batch - r0 : rb;
            char *mine = ws + per * omp_get_thread_num();
            uint16_t *Te = (uint16_t *)mine, *tb = t + r0 * rm;
            float *tf32 = (float *)(mine + te), *scr = (float *)(mine + te + tf);
            const char *xb = (const char *)x + r0 * in * elem_bytes(xt);
            if (dot) {
                comera_gemm_dot_f32(nr, rm, in, (const float *)xb, in, Vp, in, tf32, rm, NULL);
                for (int64_t i = 0; i < nr * rm; i++) tb[i] = comera_f32_to_half(h, tf32[i]);
            } else if (wdot) {
                comera_hgemm_dot(h, nr, rm, in, (const uint16_t *)xb, in, Vp, in, tb, h, rm, scr);
            } else if (hdot) {
                comera_hdot_bf16(nr, rm, in, (const uint16_t *)xb, in, Vp, in, tb, h, rm, NULL, 0);
            } else {
                comera_hgemm(h, nr, rm, in, xb, xt, in, Vp, tb, h, rm, COMERA_GEMM_STORE, scr);
            }
            if (bias) {
                ones_column(nr, rm, tb, one, Te);
                comera_hgemm(h, nr, out, re, Te, h, re, Up, y + r0 * out, h, out, ymode, scr);
            } else {
                comera_hgemm(h, nr, out, rm, tb, h, rm, Up, y + r0 * out, h, out, ymode, scr);
            }
        }
    }
    comera_ws_release(block, cached);
    return rc;
}

/* One thread's pieces of the backward workspace. */
typedef struct {
    float *dUe;    /* (r + 1) x out: d(U), last row d(bias) */
    float *dVt;    /* r x in: d(V)^T */
    uint16_t *S;   /* rb x r: dy U^T of the block */
    uint16_t *TeT; /* (r + 1) x rb: [t | 1]^T */
    uint16_t *ST;  /* r x rb: S^T */
    void *Bp;      /* a dy or x block packed */
    float *scr;    /* the products' scratch */
} half_ws;

/* The weight-gradient products of a block on the narrow kernels:
 * [dU; dbias] += [t 1]^T dy and dV^T += S^T x, the block's rows read as
 * they lie (x by then in L2: the S product fetched it). */
static void bwd_half_block_narrow(const tt_shape *s, int xt, int64_t nr, const uint16_t *dyb,
                                  const void *xb, const uint16_t *tb, const half_ws *w) {
    int64_t in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    uint32_t *pairs = (uint32_t *)w->Bp;
    comera_houter_pairs(nr, re, tb, rm, rm, pairs);
    comera_houter_bf16(re, out, nr, pairs, COMERA_DT_BF16, dyb, out, w->dUe, out);
    comera_houter_pairs(nr, rm, w->S, rm, -1, pairs);
    comera_houter_bf16(rm, in, nr, pairs, xt, xb, in, w->dVt, in);
}

/* The weight-gradient products of a block on the variant's outer-product
 * sum (comera_hgemm_outer): [t 1] and S widened to float32 (small), the
 * blocks of dy and x read as they lie.  Each group of 6 rank rows reads
 * the block again: past rank 16 packing it once for the tiles measured as
 * fast or faster (AVX2 variant, 768 -> 768, float32 x under autocast). */
#define OUTER_MAX_RANK 16
static void bwd_half_block_outer(const tt_shape *s, int h, int xt, int64_t nr,
                                 const uint16_t *dyb, const void *xb, const uint16_t *tb,
                                 const half_ws *w) {
    int64_t in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    float *a = (float *)w->Bp;
    for (int64_t i = 0; i < nr; i++) {
        for (int64_t c = 0; c < rm; c++) a[i * re + c] = comera_half_to_f32(h, tb[i * rm + c]);
        a[i * re + rm] = 1.0f;
    }
    comera_hgemm_outer(h, re, out, nr, a, re, dyb, out, w->dUe, out);
    for (int64_t i = 0; i < nr * rm; i++) a[i] = comera_half_to_f32(h, w->S[i]);
    comera_hgemm_outer(xt, rm, in, nr, a, rm, xb, in, w->dVt, in);
}

/* One row block; x and dx of type xt.  Ub: U as bfloat16 rows (r x out)
 * for the narrow kernels, or U (float32, row stride out_pad) for the
 * widened dot products, or neither (NULL). */
static void bwd_half_block(const tt_shape *s, int h, int xt, int64_t rb, int64_t nr,
                           const uint16_t *dyb, const void *xb, const uint16_t *tb,
                           const void *UTp, const uint16_t *Ub, const float *U,
                           const void *VTp, void *dxb, int dxmode, uint16_t one,
                           const half_ws *w) {
    int64_t in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    if (Ub)
        comera_hdot_bf16(nr, rm, out, dyb, out, Ub, out, w->S, h, rm, xb,
                         in * elem_bytes(xt));
    else if (U)
        comera_hgemm_dot(h, nr, rm, out, dyb, out, U, s->out_pad, w->S, h, rm, w->scr);
    else
        comera_hgemm(h, nr, rm, out, dyb, h, out, UTp, w->S, h, rm, COMERA_GEMM_STORE, w->scr);
    if (dxb) comera_hgemm(h, nr, in, rm, w->S, h, rm, VTp, dxb, xt, in, dxmode, w->scr);
    if (Ub) {
        bwd_half_block_narrow(s, xt, nr, dyb, xb, tb, w);
        return;
    }
    if (rm <= OUTER_MAX_RANK && comera_hgemm_outer_usable(h)) {
        bwd_half_block_outer(s, h, xt, nr, dyb, xb, tb, w);
        return;
    }
    /* the weight-gradient products run along the block's rows: their A
     * operands are the block's [t | 1] and S transposed (small) */
    transpose_half(nr, rm, tb, w->TeT, rb);
    for (int64_t i = 0; i < nr; i++) w->TeT[rm * rb + i] = one;
    transpose_half(nr, rm, w->S, w->ST, rb);
    comera_hgemm_pack_half(h, nr, out, dyb, out, w->Bp);
    comera_hgemm(h, re, out, nr, w->TeT, h, rb, w->Bp, w->dUe, COMERA_DT_F32, out,
                 COMERA_GEMM_ADD, w->scr);
    if (xt == COMERA_DT_F32) comera_hgemm_pack_f32(h, nr, in, xb, in, 1, w->Bp);
    else comera_hgemm_pack_half(h, nr, in, xb, in, w->Bp);
    comera_hgemm(h, rm, in, nr, w->ST, h, rb, w->Bp, w->dVt, COMERA_DT_F32, in, COMERA_GEMM_ADD,
                 w->scr);
}

static int bwd_half(const comera_tt_linear_prep *p, int h, int pt, int xt, const uint16_t *dy,
                    const void *x, const uint16_t *t, const void *const *cores,
                    const void *const *gates, void *dx, void *const *dcores,
                    void *const *dgates, void *dbias, int nthreads) {
    const tt_shape *s = &p->shape;
    int64_t batch = p->batch, in = s->in, out = s->out, rm = s->rmid, re = rm + 1;
    int64_t rb = comera_tt_row_block_half(s);
    int64_t blocks = (batch + rb - 1) / rb;
    int nt = comera_threads_for_items(nthreads, blocks);
    int64_t kmax = out > rm ? out : rm;
    if (rb > kmax) kmax = rb;
    int64_t xe = elem_bytes(xt);
    int narrow = use_hnarrow(h, rm);
    /* per thread: dUe, dVt (float32), S, [t | 1]^T, S^T (16-bit), a packed
     * block (the narrow kernels' row pairs, the outer sums' float32 A),
     * the products' scratch */
    int64_t packed = comera_hgemm_packed_bytes(h, rb, in > out ? in : out);
    if (packed < 4 * rb * re) packed = 4 * rb * re; /* the outer sums' float32 [t 1] */
    int64_t pn[7] = {4 * re * out, 4 * rm * in, 2 * rb * rm, 2 * re * rb, 2 * rm * rb,
                     narrow ? 4 * ((rb + 1) / 2) * re : packed, 4 * comera_hgemm_scratch(h, kmax)};
    int64_t po[7];
    int64_t per = carve_bytes(7, pn, po);
    /* eff, deff, P, dP (float32), packed U^T (narrow: U in bfloat16 rows;
     * unused by the widened dot products) and V^T, the threads' pieces */
    int64_t n[7] = {4 * s->core_off[s->D], 4 * s->core_off[s->D], 4 * s->P_off[s->D],
                    4 * s->P_off[s->D],
                    narrow ? 2 * rm * out : comera_hgemm_packed_bytes(h, out, rm),
                    comera_hgemm_packed_bytes(h, rm, in), per * nt};
    int64_t off[7];
    int cached = 0;
    char *block = comera_ws_acquire((size_t)carve_bytes(7, n, off), &cached);
    if (!block) return COMERA_ERR_NOMEM;
    float *eff = (float *)(block + off[0]), *deff = (float *)(block + off[1]);
    float *P = (float *)(block + off[2]), *dP = (float *)(block + off[3]);
    void *UTp = block + off[4], *VTp = block + off[5];
    char *ws = block + off[6];
    /* the sums start at zero: d(P) and every thread's d(U) and d(V)^T (a
     * smaller team than asked leaves some unused, read as zeros) */
    memset(dP, 0, (size_t)n[3]);
    for (int th = 0; th < nt; th++) {
        memset(ws + per * th + po[0], 0, (size_t)pn[0]);
        memset(ws + per * th + po[1], 0, (size_t)pn[1]);
    }
    eff_from_params(s, pt, cores, gates, eff);
    int rc = comera_tt_merges_f32(s, eff, P);
    if (!rc) {
        const float *V = P + s->P_off[s->p - 1], *U = P + s->P_off[s->D - 1];
        uint16_t *Ub = narrow ? (uint16_t *)UTp : NULL;
        const float *Uw = !narrow && use_widened_dot(h, rm) ? U : NULL;
        if (narrow) rounded_rows(h, rm, out, U, s->out_pad, 1, Ub);
        else if (!Uw) comera_hgemm_pack_f32(h, out, rm, U, 1, s->out_pad, UTp);
        comera_hgemm_pack_f32(h, rm, in, V, 1, rm, VTp);
        int dxmode = comera_gemm_store_mode(batch * in * xe);
        uint16_t one = comera_f32_to_half(h, 1.0f);
#pragma omp parallel num_threads(nt)
        {
            int tid = omp_get_thread_num();
            char *mine = ws + per * tid;
            half_ws w = {(float *)(mine + po[0]), (float *)(mine + po[1]),
                         (uint16_t *)(mine + po[2]), (uint16_t *)(mine + po[3]),
                         (uint16_t *)(mine + po[4]), mine + po[5], (float *)(mine + po[6])};
            /* stride by the team actually granted (see cpu_impl.h bwd_merge) */
            int team = omp_get_num_threads();
            for (int64_t b = tid; b < blocks; b += team) {
                int64_t r0 = b * rb, nr = batch - r0 < rb ? batch - r0 : rb;
                bwd_half_block(s, h, xt, rb, nr, dy + r0 * out, (const char *)x + r0 * in * xe,
                               t + r0 * rm, UTp, Ub, Uw, VTp,
                               dx ? (char *)dx + r0 * in * xe : NULL,
                               dxmode, one, &w);
            }
        }
        /* the threads' sums into d(V) and d(U) at the chain ends, and d(bias) */
        float *dVall = dP + s->P_off[s->p - 1], *dUall = dP + s->P_off[s->D - 1];
        for (int th = 0; th < nt; th++) {
            const float *dUe = (const float *)(ws + per * th + po[0]);
            const float *dVt = (const float *)(ws + per * th + po[1]);
            for (int64_t c = 0; c < rm; c++)
                for (int64_t j = 0; j < out; j++) dUall[c * s->out_pad + j] += dUe[c * out + j];
            for (int64_t i = 0; i < in; i++)
                for (int64_t c = 0; c < rm; c++) dVall[i * rm + c] += dVt[c * in + i];
        }
        if (dbias)
            for (int64_t j = 0; j < out; j++) {
                float sum = 0.0f;
                for (int th = 0; th < nt; th++)
                    sum += ((const float *)(ws + per * th + po[0]))[rm * out + j];
                param_put(dbias, pt, j, sum);
            }
        rc = comera_tt_merges_bwd_f32(s, eff, P, dP, deff);
        if (!rc) param_grads(s, pt, cores, gates, deff, dcores, dgates);
    }
    comera_ws_release(block, cached);
    return rc;
}

static int half_types_ok(const comera_tt_half_types *ty) {
    int h = ty->act;
    return (h == COMERA_DT_BF16 || h == COMERA_DT_F16) &&
           (ty->param == h || ty->param == COMERA_DT_F32) &&
           (ty->x == h || ty->x == COMERA_DT_F32);
}

int comera_tt_linear_fwd_half(const comera_tt_linear_prep *p, const comera_tt_half_types *ty,
                              const void *x, const void *const *cores,
                              const void *const *gates, const void *bias, void *y, void *t,
                              int nthreads) {
    if (!ty || !half_types_ok(ty)) return COMERA_ERR_ARG;
    if (p->batch == 0) return COMERA_OK;
    return fwd_half(p, ty->act, ty->param, ty->x, x, cores, gates, bias, y, t, nthreads);
}

int comera_tt_linear_bwd_half(const comera_tt_linear_prep *p, const comera_tt_half_types *ty,
                              const void *dy, const void *x, const void *t,
                              const void *const *cores, const void *const *gates, void *dx,
                              void *const *dcores, void *const *dgates, void *dbias,
                              int nthreads) {
    if (!ty || !half_types_ok(ty)) return COMERA_ERR_ARG;
    return bwd_half(p, ty->act, ty->param, ty->x, dy, x, t, cores, gates, dx, dcores, dgates,
                    dbias, nthreads);
}
