/* Where the time of the TT linear merge path goes, one thread: each batch
 * product of the float32 merge path timed alone with the layouts the kernel
 * uses (csrc/tt_linear/cpu_impl.h), summed over the row blocks, plus the
 * packing, and the whole comera_tt_linear_fwd/bwd for comparison.
 *
 *   make -C benchmarks/c run            # 768 -> 3072, rank 30, 4096 rows
 *   ./build/merge_gemms IN OUT RANK ROWS [ROW_BLOCK]
 *
 * Prints milliseconds and GFLOP/s per product (median of 5), by the
 * thread's CPU time (CLOCK_THREAD_CPUTIME_ID): on a shared machine, time
 * spent descheduled does not count (a core shared through SMT still does). */
#include "comera/tt_linear.h"
#include "common/gemm.h"
#include "tt_linear/shape.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static float *fbuf(int64_t n) {
    float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) p[i] = (float)((i * 7919 % 1000) - 500) * 1e-3f;
    return p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* the product `which` over every row block (see phase names below) */
enum { T_XV, Y_TU, S_DYUT, DX_SVT, PACK_DY, DU_TDY, PACK_X, DV_SX, NPHASE };
static const char *NAMES[NPHASE] = {
    "fwd  T = x V        (M=rb N=r  K=in)", "fwd  y = T U        (M=rb N=out K=r)",
    "bwd  S = dy U^T     (M=rb N=r  K=out)", "bwd  dx = S V^T     (M=rb N=in K=r)",
    "bwd  pack dy block", "bwd  dU += [T|1]^T dy (M=r+1 N=out K=rb)",
    "bwd  pack x block", "bwd  dV^T += S^T x  (M=r N=in K=rb)"};

typedef struct {
    int64_t in, out, r, rows, rb;
    float *x, *dy, *t, *y, *dx, *S, *Te, *Bp, *Vp, *Up, *UTp, *VTp, *dUe, *dVt;
} bufs;

static void phase(bufs *b, int which) {
    int64_t in = b->in, out = b->out, r = b->r, re = r + 1;
    for (int64_t r0 = 0; r0 < b->rows; r0 += b->rb) {
        int64_t nr = b->rows - r0 < b->rb ? b->rows - r0 : b->rb;
        const float *dyb = b->dy + r0 * out, *xb = b->x + r0 * in;
        switch (which) {
        case T_XV: comera_gemm_packed_f32(nr, r, in, xb, in, 1, b->Vp, b->t + r0 * r, r, 0); break;
        case Y_TU: comera_gemm_packed_f32(nr, out, r, b->t + r0 * r, r, 1, b->Up, b->y + r0 * out, out, 0); break;
        case S_DYUT: comera_gemm_packed_f32(nr, r, out, dyb, out, 1, b->UTp, b->S, r, 0); break;
        case DX_SVT: comera_gemm_packed_f32(nr, in, r, b->S, r, 1, b->VTp, b->dx + r0 * in, in, 0); break;
        case PACK_DY: comera_gemm_pack_b_f32(nr, out, dyb, out, 1, b->Bp); break;
        case DU_TDY: comera_gemm_packed_f32(re, out, nr, b->Te, 1, re, b->Bp, b->dUe, out, 1); break;
        case PACK_X: comera_gemm_pack_b_f32(nr, in, xb, in, 1, b->Bp); break;
        case DV_SX: comera_gemm_packed_f32(r, in, nr, b->S, 1, r, b->Bp, b->dVt, in, 1); break;
        }
    }
}

static double flops_of(const bufs *b, int which) {
    double B = (double)b->rows, in = (double)b->in, out = (double)b->out, r = (double)b->r;
    switch (which) {
    case T_XV: case DV_SX: case DX_SVT: return 2.0 * B * in * r;
    case Y_TU: case S_DYUT: return 2.0 * B * out * r;
    case DU_TDY: return 2.0 * B * out * (r + 1);
    default: return 0.0;
    }
}

static double median_ms(void (*fn)(void *, int), void *arg, int which) {
    double t[5];
    fn(arg, which);
    for (int i = 0; i < 5; i++) {
        double t0 = now();
        fn(arg, which);
        t[i] = (now() - t0) * 1e3;
    }
    qsort(t, 5, sizeof t[0], cmp_double);
    return t[2];
}

static void run_phase(void *arg, int which) { phase(arg, which); }

typedef struct {
    comera_tt_linear_prep prep;
    const float *const *cores, *const *gates;
    float *const *dcores, *const *dgates;
    bufs *b;
    float *bias, *dbias;
} whole;

static void run_whole(void *arg, int bwd) {
    whole *w = arg;
    bufs *b = w->b;
    if (!bwd)
        comera_tt_linear_fwd_f32(&w->prep, b->x, w->cores, w->gates, w->bias, b->y, b->t, 1);
    else
        comera_tt_linear_bwd_f32(&w->prep, b->dy, b->x, b->t, w->cores, w->gates, b->dx,
                                 (float *const *)w->dcores, (float *const *)w->dgates,
                                 w->dbias, 1);
}

/* n as three factors near its cube root (the layer's merges are cheap next
 * to the batch products; the exact modes barely matter here) */
static void three_modes(int64_t n, int64_t m[3]) {
    int64_t a = 1, rest;
    for (int64_t f = 2; f * f * f <= n; f++)
        if (n % f == 0) a = f;
    rest = n / a;
    int64_t b = 1;
    for (int64_t f = 2; f * f <= rest; f++)
        if (rest % f == 0) b = f;
    m[0] = a; m[1] = b; m[2] = rest / b;
}

static void whole_layer(bufs *b) {
    int64_t im[3], om[3], ranks[7] = {1, b->r, b->r, b->r, b->r, b->r, 1};
    three_modes(b->in, im);
    three_modes(b->out, om);
    comera_tt_linear_desc d = {3, 3, im, om, ranks, b->in, b->out};
    whole w = {.b = b};
    if (comera_tt_linear_prepare(&d, b->rows, COMERA_PATH_MERGE, &w.prep)) {
        printf("prepare failed\n");
        return;
    }
    const float *cores[6], *gates[5];
    float *dcores[6], *dgates[5];
    for (int k = 0; k < 6; k++) {
        int64_t n = ranks[k] * (k < 3 ? im[k] : om[k - 3]) * ranks[k + 1];
        cores[k] = fbuf(n);
        dcores[k] = fbuf(n);
        if (k < 5) { gates[k] = fbuf(b->r); dgates[k] = fbuf(b->r); }
    }
    w.cores = cores; w.gates = gates; w.dcores = dcores; w.dgates = dgates;
    w.bias = fbuf(b->out); w.dbias = fbuf(b->out);
    double fl = 2.0 * b->rows * b->r * (b->in + b->out);
    double f = median_ms(run_whole, &w, 0), g = median_ms(run_whole, &w, 1);
    printf("%-40s %8.2f ms %6.1f GFLOP/s\n", "comera_tt_linear_fwd_f32 (whole)", f, fl / f * 1e-6);
    printf("%-40s %8.2f ms %6.1f GFLOP/s\n", "comera_tt_linear_bwd_f32 (whole)", g,
           2 * fl / g * 1e-6);
    for (int k = 0; k < 6; k++) { free((void *)cores[k]); free(dcores[k]); }
    for (int k = 0; k < 5; k++) { free((void *)gates[k]); free(dgates[k]); }
    free(w.bias); free(w.dbias);
}

int main(int argc, char **argv) {
    bufs b = {.in = 768, .out = 3072, .r = 30, .rows = 4096};
    if (argc >= 5) {
        b.in = atoll(argv[1]); b.out = atoll(argv[2]);
        b.r = atoll(argv[3]); b.rows = atoll(argv[4]);
    }
    int64_t wide = b.in > b.out ? b.in : b.out;
    comera_tt_linear_shape s = {0};
    s.in = b.in; s.out = b.out;
    b.rb = argc >= 6 ? atoll(argv[5]) : comera_tt_row_block(&s);
    int64_t r = b.r, re = r + 1;
    b.x = fbuf(b.rows * b.in); b.dy = fbuf(b.rows * b.out);
    b.t = fbuf(b.rows * r); b.y = fbuf(b.rows * b.out); b.dx = fbuf(b.rows * b.in);
    b.S = fbuf(b.rb * r); b.Te = fbuf(b.rb * re);
    b.Bp = fbuf(comera_gemm_packed_size(b.rb, wide));
    b.Vp = fbuf(comera_gemm_packed_size(b.in, r)); b.Up = fbuf(comera_gemm_packed_size(r, b.out));
    b.UTp = fbuf(comera_gemm_packed_size(b.out, r)); b.VTp = fbuf(comera_gemm_packed_size(r, b.in));
    b.dUe = fbuf(re * b.out); b.dVt = fbuf(r * b.in);
    printf("%lld -> %lld, rank %lld, %lld rows, row block %lld, 1 thread, gemm variant %s\n",
           (long long)b.in, (long long)b.out, (long long)r, (long long)b.rows, (long long)b.rb,
           comera_gemm_isa());
    double total = 0;
    for (int p = 0; p < NPHASE; p++) {
        double ms = median_ms(run_phase, &b, p);
        total += ms;
        if (flops_of(&b, p) > 0)
            printf("%-40s %8.2f ms %6.1f GFLOP/s\n", NAMES[p], ms, flops_of(&b, p) / ms * 1e-6);
        else
            printf("%-40s %8.2f ms\n", NAMES[p], ms);
    }
    printf("%-40s %8.2f ms\n", "sum of the batch products", total);
    whole_layer(&b);
    return 0;
}
