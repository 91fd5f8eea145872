/* TT linear layer, device-neutral half: the descriptor checks, the derived
 * sizes (shape.h), the planner, and comera_tt_linear_prepare, which does all
 * of them once per call for the CPU kernels (cpu_f32.c, cpu_f64.c) and the
 * CUDA launchers (cuda.cu).  The math is in docs/design.md section 2. */
#include "tt_linear/shape.h"
#include "common/gemm.h"

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

int64_t comera_tt_row_block_half(const tt_shape *s) {
    /* a block of the wider of x and dy, and its packed copy, stay in L2
     * with the weight-gradient accumulators (about 1.5 MB at 768 -> 3072);
     * the AMX weight-gradient products load and store their accumulators
     * once per block, so fewer, taller blocks where rows are narrow */
    int64_t wide = s->in > s->out ? s->in : s->out;
    int64_t rb = (384 * 1024) / (2 * wide);
    if (rb > 256) rb = 256;
    rb -= rb % 32;
    return rb < 32 ? 32 : rb;
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

/* The path rule's model (docs/design.md section 5): a two-core
 * calibration, float32 elements; the sequential path's per-row products run
 * at a fraction of the packed kernel's rate. */
#define FLOPS_PER_S 1e11
#define BYTES_PER_S 2e10
#define SEQ_EFFICIENCY 0.15

/* FLOPs and bytes of both paths, with act-byte activations (x, y, dy, dx,
 * t) and work-byte cores and merges. */
static void plan_costs(const tt_shape *s, int64_t batch, double act, double work,
                       comera_tt_linear_plan *plan) {
    double B = (double)batch, in = (double)s->in, out = (double)s->out, rm = (double)s->rmid;
    double cores = (double)s->core_off[s->D];
    double io = act * (3.0 * B * in + 2.0 * B * out + 2.0 * B * rm) + work * 4.0 * cores;
    memset(plan, 0, sizeof *plan);
    /* forward builds V, U; backward rebuilds them and runs two products per
     * merge step to get the core gradients */
    plan->flops[COMERA_PATH_MERGE] = 6.0 * B * rm * (in + out) + 4.0 * s->merge_flops;
    plan->bytes[COMERA_PATH_MERGE] = io + work * 4.0 * (double)s->P_off[s->D];
    /* forward, recomputed forward, then two products per step backward */
    plan->flops[COMERA_PATH_SEQUENTIAL] = 4.0 * B * s->seq_row_flops;
    plan->bytes[COMERA_PATH_SEQUENTIAL] = io;
}

static void plan_from_shape(const tt_shape *s, int64_t batch, comera_tt_linear_plan *plan) {
    plan_costs(s, batch, 4.0, 4.0, plan);
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

/* The micro-kernel that runs products of dtype in this process. */
static int kernel_of(int dtype) {
    const char *name = comera_gemm_isa_for(dtype);
    if (strcmp(name, "amx") == 0) return COMERA_KERNEL_AMX;
    if (strcmp(name, "avx512bf16") == 0) return COMERA_KERNEL_AVX512BF16;
    if (strcmp(name, "avx512") == 0) return COMERA_KERNEL_AVX512;
    if (strcmp(name, "avx2") == 0) return COMERA_KERNEL_AVX2;
    return COMERA_KERNEL_GENERIC;
}

/* FLOP/s of one core on the merge path's products: measured at 768 -> 3072,
 * rank 30, 4096 rows on one core of the AVX-512 / AMX Xeon (the avx2,
 * generic and avx512bf16 tiles on the same core; the bfloat16 figures
 * include conversions and packing).  16-bit types on a float32 tile pay for
 * widening their operands. */
static double kernel_rate(int kernel, int dtype) {
    if (dtype == COMERA_DT_F64) return 1e10;
    double rate = kernel == COMERA_KERNEL_AMX      ? 1.4e11
                  : kernel == COMERA_KERNEL_AVX512 ? 1.4e11
                  : kernel == COMERA_KERNEL_AVX2   ? 8e10
                                                   : 2e10;
    if (kernel == COMERA_KERNEL_AMX && dtype == COMERA_DT_BF16) return 4e11;
    if (kernel == COMERA_KERNEL_AVX512BF16 && dtype == COMERA_DT_BF16) return 2.2e11;
    return dtype == COMERA_DT_F32 ? rate : 0.9 * rate;
}

int comera_tt_linear_plan_for(const comera_tt_linear_desc *d, int64_t batch, int dtype,
                              int nthreads, comera_tt_linear_plan *plan) {
    tt_shape s;
    int rc = comera_tt_shape_build(d, &s);
    if (!rc) rc = check_batch(&s, batch);
    if (!rc && (dtype < COMERA_DT_F32 || dtype > COMERA_DT_F16)) rc = COMERA_ERR_ARG;
    if (rc) return rc;
    int half = dtype == COMERA_DT_BF16 || dtype == COMERA_DT_F16;
    double act = dtype == COMERA_DT_F64 ? 8.0 : half ? 2.0 : 4.0;
    comera_tt_linear_plan rule;
    plan_from_shape(&s, batch, &rule);
    plan_costs(&s, batch, act, act > 4.0 ? 8.0 : 4.0, plan);
    /* the 16-bit kernels have the merge path only */
    plan->path = half ? COMERA_PATH_MERGE : rule.path;
    plan->dtype = dtype;
    plan->kernel = kernel_of(dtype);
    plan->threads = nthreads > 0 ? nthreads : 1;
    double rate = kernel_rate(plan->kernel, dtype) * plan->threads;
    double bandwidth = plan->threads > 1 ? 2e10 : 1.5e10;
    for (int path = 1; path <= 2; path++) {
        double eff = path == COMERA_PATH_MERGE ? 1.0 : SEQ_EFFICIENCY;
        double tf = plan->flops[path] / (eff * rate), tb = plan->bytes[path] / bandwidth;
        plan->seconds[path] = tf > tb ? tf : tb;
    }
    return COMERA_OK;
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
    return comera_tt_linear_plan_for(d, batch, COMERA_DT_F32, 1, plan);
}
