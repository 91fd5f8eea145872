/* TT linear layer, device-neutral half: the descriptor checks, the derived
 * sizes (shape.h), the planner, and comera_tt_linear_prepare, which does all
 * of them once per call for the CPU kernels (cpu_f32.c, cpu_f64.c) and the
 * CUDA launchers (cuda.cu).  The math is in docs/design.md section 2. */
#include "tt_linear/shape.h"

#include <string.h>

static int mul_ok(int64_t a, int64_t b, int64_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
static int add_ok(int64_t a, int64_t b, int64_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

int comera_tt_shape_build(const comera_tt_linear_desc *d, tt_shape *s) {
    if (!d || !d->in_modes || !d->out_modes || !d->ranks) return COMERA_ERR_ARG;
    if (d->num_in < 1 || d->num_out < 1) return COMERA_ERR_ARG;
    /* each count is checked alone first: their int sum could overflow */
    if (d->num_in > COMERA_MAX_CORES || d->num_out > COMERA_MAX_CORES ||
        d->num_in + d->num_out > COMERA_MAX_CORES)
        return COMERA_ERR_ARG;
    memset(s, 0, sizeof *s);
    s->p = d->num_in;
    s->D = d->num_in + d->num_out;
    for (int k = 0; k < s->p; k++) s->dims[k] = d->in_modes[k];
    for (int k = 0; k < d->num_out; k++) s->dims[s->p + k] = d->out_modes[k];
    for (int k = 0; k <= s->D; k++) s->r[k] = d->ranks[k];
    if (s->r[0] != 1 || s->r[s->D] != 1) return COMERA_ERR_ARG;
    for (int k = 0; k < s->D; k++)
        if (s->dims[k] < 1 || s->r[k + 1] < 1) return COMERA_ERR_ARG;

    int64_t v;
    s->core_off[0] = 0;
    for (int k = 0; k < s->D; k++) {
        if (!mul_ok(s->r[k], s->dims[k], &v) || !mul_ok(v, s->r[k + 1], &v) ||
            !add_ok(s->core_off[k], v, &s->core_off[k + 1]))
            return COMERA_ERR_OVERFLOW;
    }
    s->in_pad = 1;
    for (int k = 0; k < s->p; k++)
        if (!mul_ok(s->in_pad, s->dims[k], &s->in_pad)) return COMERA_ERR_OVERFLOW;
    s->out_pad = 1;
    for (int k = s->p; k < s->D; k++)
        if (!mul_ok(s->out_pad, s->dims[k], &s->out_pad)) return COMERA_ERR_OVERFLOW;
    s->in = d->in_features;
    s->out = d->out_features;
    if (s->in < 1 || s->in > s->in_pad || s->out < 1 || s->out > s->out_pad)
        return COMERA_ERR_ARG;
    s->rmid = s->r[s->p];

    /* merge chains: V chain over cores 0..p-1 starts with 1 row, U chain
     * over cores p..D-1 starts with r[p] rows. */
    s->P_off[0] = 0;
    s->merge_flops = 0.0;
    for (int chain = 0; chain < 2; chain++) {
        int first = chain == 0 ? 0 : s->p, last = chain == 0 ? s->p - 1 : s->D - 1;
        int64_t rows = s->r[first];
        for (int k = first; k <= last; k++) {
            if (!mul_ok(rows, s->dims[k], &rows) || !mul_ok(rows, s->r[k + 1], &v) ||
                !add_ok(s->P_off[k], v, &s->P_off[k + 1]))
                return COMERA_ERR_OVERFLOW;
            if (k > first)
                s->merge_flops += 2.0 * (double)(rows / s->dims[k]) * (double)s->r[k] *
                                  (double)s->dims[k] * (double)s->r[k + 1];
        }
    }

    s->R[s->p] = 1;
    for (int k = s->p - 1; k >= 0; k--) s->R[k] = s->R[k + 1] * s->dims[k];
    s->M[0] = 1;
    for (int l = 1; l <= d->num_out; l++) s->M[l] = s->M[l - 1] * s->dims[s->p + l - 1];
    int64_t off = 0, mx = 0;
    s->seq_row_flops = 0.0;
    for (int k = 0; k <= s->p; k++) {
        s->Z_off[k] = off;
        if (!mul_ok(s->r[k], s->R[k], &v) || !add_ok(off, v, &off)) return COMERA_ERR_OVERFLOW;
        if (v > mx) mx = v;
        if (k < s->p)
            s->seq_row_flops += 2.0 * (double)s->r[k + 1] * (double)s->r[k] *
                                (double)s->dims[k] * (double)s->R[k + 1];
    }
    for (int l = 1; l <= d->num_out; l++) {
        int c = s->p + l - 1;
        s->Y_off[l] = off;
        if (!mul_ok(s->M[l], s->r[c + 1], &v) || !add_ok(off, v, &off))
            return COMERA_ERR_OVERFLOW;
        if (v > mx) mx = v;
        s->seq_row_flops += 2.0 * (double)s->M[l - 1] * (double)s->r[c] *
                            (double)s->dims[c] * (double)s->r[c + 1];
    }
    s->Y_off[0] = s->Z_off[s->p];
    s->seq_state_max = mx;
    s->seq_total = off;
    /* room for per-thread copies of every workspace, with margin */
    if (!mul_ok(mx, 2, &v) || !add_ok(v, s->seq_total, &v) || !add_ok(v, s->core_off[s->D], &v) ||
        !mul_ok(v, 4 * 64, &v))
        return COMERA_ERR_OVERFLOW;
    if (!mul_ok(s->P_off[s->D], 4, &v)) return COMERA_ERR_OVERFLOW;
    return COMERA_OK;
}

int64_t comera_tt_row_block(const tt_shape *s) {
    int64_t wide = s->in > s->out ? s->in : s->out;
    int64_t rb = (64 * 1024) / wide;
    /* The weight-gradient products run over the block's rows (their K): at
     * 12 rows (3072-wide layers) every tile reloaded its accumulators each
     * 12 steps.  So at least 48 rows while a block stays within 640 KB of
     * the 2 MB L2 (measured: 3072 -> 768 rank 64 backward 80 -> 68 ms; at
     * 30522-wide rows 48 was slower, so those keep 12). */
    int64_t floor = (160 * 1024) / wide;
    if (floor > 48) floor = 48;
    if (rb < floor) rb = floor;
    if (rb < 12) rb = 12;
    if (rb > 240) rb = 240;
    /* whole micro-kernel tiles (6 or 12 rows): a block of 85 rows would end
     * in a 1-row tile that costs as much as a full one */
    return rb - rb % 12;
}

/* Batch-dependent sizes: x or y rows and the t rows, in bytes. */
static int check_batch(const tt_shape *s, int64_t batch) {
    if (batch < 0) return COMERA_ERR_ARG;
    int64_t v;
    if (!mul_ok(batch, s->in_pad > s->out_pad ? s->in_pad : s->out_pad, &v) ||
        !mul_ok(v, 8, &v) || !mul_ok(batch, s->rmid, &v) || !mul_ok(v, 8, &v))
        return COMERA_ERR_OVERFLOW;
    return COMERA_OK;
}

#define FLOPS_PER_S 1e11
#define BYTES_PER_S 2e10
#define SEQ_EFFICIENCY 0.15

static void plan_from_shape(const tt_shape *s, int64_t batch, comera_tt_linear_plan *plan) {
    double B = (double)batch, in = (double)s->in, out = (double)s->out, rm = (double)s->rmid;
    double cores = (double)s->core_off[s->D];
    double io = 4.0 * (3.0 * B * in + 2.0 * B * out + 2.0 * B * rm + 4.0 * cores);
    memset(plan, 0, sizeof *plan);
    /* forward builds V, U; backward rebuilds them and runs two products per
     * merge step to get the core gradients */
    plan->flops[COMERA_PATH_MERGE] = 6.0 * B * rm * (in + out) + 4.0 * s->merge_flops;
    plan->bytes[COMERA_PATH_MERGE] = io + 4.0 * 4.0 * (double)s->P_off[s->D];
    /* forward, recomputed forward, then two products per step backward */
    plan->flops[COMERA_PATH_SEQUENTIAL] = 4.0 * B * s->seq_row_flops;
    plan->bytes[COMERA_PATH_SEQUENTIAL] = io;
    for (int path = 1; path <= 2; path++) {
        double eff = path == COMERA_PATH_MERGE ? 1.0 : SEQ_EFFICIENCY;
        double tf = plan->flops[path] / (eff * FLOPS_PER_S);
        double tb = plan->bytes[path] / BYTES_PER_S;
        plan->seconds[path] = tf > tb ? tf : tb;
    }
    plan->path = plan->seconds[COMERA_PATH_SEQUENTIAL] < plan->seconds[COMERA_PATH_MERGE]
                     ? COMERA_PATH_SEQUENTIAL
                     : COMERA_PATH_MERGE;
}

int comera_tt_linear_check(const comera_tt_linear_desc *d, int64_t batch) {
    tt_shape s;
    int rc = comera_tt_shape_build(d, &s);
    return rc ? rc : check_batch(&s, batch);
}

int comera_tt_linear_prepare(const comera_tt_linear_desc *d, int64_t batch, int path,
                             comera_tt_linear_prep *out) {
    if (!out) return COMERA_ERR_ARG;
    int rc = comera_tt_shape_build(d, &out->shape);
    if (!rc) rc = check_batch(&out->shape, batch);
    if (rc) return rc;
    if (path < COMERA_PATH_AUTO || path > COMERA_PATH_SEQUENTIAL) return COMERA_ERR_ARG;
    out->batch = batch;
    if (path == COMERA_PATH_AUTO) {
        comera_tt_linear_plan plan;
        plan_from_shape(&out->shape, batch, &plan);
        path = plan.path;
    }
    out->path = path;
    return COMERA_OK;
}

int comera_tt_linear_make_plan(const comera_tt_linear_desc *d, int64_t batch,
                               comera_tt_linear_plan *plan) {
    tt_shape s;
    int rc = comera_tt_shape_build(d, &s);
    if (!rc) rc = check_batch(&s, batch);
    if (rc) return rc;
    plan_from_shape(&s, batch, plan);
    return COMERA_OK;
}
