/* The CUDA TT linear launchers (csrc/tt_linear/cuda.cu), compiled for the
 * host with the emulation in cuda_emulate.h, against the float64 C kernels
 * (csrc/tt_linear/cpu_f64.c) as reference, for float64, float32, bfloat16
 * and float16, with and without bias and input gradient, over layer shapes
 * that exercise p = 1 / q = 1 chains, padding, ranks at the TT bound and
 * long (split) gradient sums.  Also: the workspace size is enough (guard
 * bytes past it stay untouched), argument errors, the gate proximal step
 * (csrc/gate_prox/cuda.cu) against its C kernel, and the kernels, cuBLAS
 * calls and copies of one call against launch_counts.txt (argument 1, default
 * ./launch_counts.txt).
 * Prints one line per failure, then "N passed, M failed"; exits 1 on failure. */
#include "cuda_emulate.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "comera/cuda.h"
#include "comera/gate_prox.h"
#include "comera/tt_linear.h"
#include "../c/one_call.h"
#include "emu_check.h"
#include "launch_table.h"

struct Case {
    const char *name;
    std::vector<int64_t> in_modes, out_modes, ranks;
    int64_t in, out;
};

static const Case CASES[] = {
    {"p1q1 5x7 r3", {5}, {7}, {1, 3, 1}, 5, 7},
    {"p1q1 rank1 padded", {6}, {8}, {1, 1, 1}, 5, 7},
    {"p2q2 TT bound", {2, 3}, {3, 3}, {1, 2, 6, 3, 1}, 5, 7},
    {"p1q3 TT bound", {7}, {2, 3, 2}, {1, 7, 6, 2, 1}, 6, 12},
    {"p3q1 TT bound", {2, 2, 3}, {5}, {1, 2, 4, 5, 1}, 10, 5},
    {"p2q3 primes", {3, 5}, {2, 3, 2}, {1, 3, 4, 4, 2, 1}, 13, 11},
    {"p4q4 {2}^4", {2, 2, 2, 2}, {2, 2, 2, 2}, {1, 2, 3, 3, 3, 3, 3, 2, 1}, 16, 13},
    {"p3q2 mode of 1", {3, 1, 5}, {7, 2}, {1, 2, 2, 5, 2, 1}, 15, 13},
    {"p3q3 {4}^3 r16", {4, 4, 4}, {4, 4, 4}, {1, 4, 16, 16, 16, 4, 1}, 64, 64},
    /* the U chain's last step sums over 8 * 12 * 16 = 1536 merged rows: six splits */
    {"p2q3 long sums", {4, 6}, {12, 16, 4}, {1, 4, 8, 6, 5, 1}, 24, 768},
};

static double urand(unsigned *state) { return urand_from(state); }

/* max |a - b| relative to max |b|; a NaN fails (fmax alone would skip it,
 * and unwritten workspace reads as NaN) */
template <typename T>
static double rel_err(const std::vector<T> &got, const std::vector<double> &ref) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < ref.size(); i++) {
        double d = std::fabs(to_d(got[i]) - ref[i]);
        if (std::isnan(d)) return 1e30;
        num = std::fmax(num, d);
        den = std::fmax(den, std::fabs(ref[i]));
    }
    return got.size() == ref.size() ? num / den : 1e30;
}

/* values rounded through T, as double, so the reference sees the same inputs */
template <typename T> static std::vector<double> rounded(size_t n, unsigned *st, double lo, double hi) {
    std::vector<double> v(n);
    for (auto &e : v) e = to_d(from_d<T>(lo + (hi - lo) * (urand(st) + 1.0) / 2.0));
    return v;
}

template <typename T> static std::vector<T> as(const std::vector<double> &v) {
    std::vector<T> o(v.size());
    for (size_t i = 0; i < v.size(); i++) o[i] = from_d<T>(v[i]);
    return o;
}

template <typename T>
static void run_case(const Case &c, int64_t batch, bool has_bias, bool want_dx, unsigned seed) {
    const int p = (int)c.in_modes.size(), D = p + (int)c.out_modes.size();
    comera_tt_linear_desc d{};
    d.num_in = p;
    d.num_out = D - p;
    d.in_modes = c.in_modes.data();
    d.out_modes = c.out_modes.data();
    d.ranks = c.ranks.data();
    d.in_features = c.in;
    d.out_features = c.out;
    std::vector<int64_t> dims(c.in_modes);
    dims.insert(dims.end(), c.out_modes.begin(), c.out_modes.end());
    const int64_t rm = c.ranks[p];
    unsigned st = seed;
    std::vector<std::vector<double>> cores, gates;
    for (int k = 0; k < D; k++) {
        cores.push_back(rounded<T>((size_t)(c.ranks[k] * dims[k] * c.ranks[k + 1]), &st, -0.8, 0.8));
        if (k < D - 1) gates.push_back(rounded<T>((size_t)c.ranks[k + 1], &st, 0.5, 1.5));
    }
    std::vector<double> x = rounded<T>((size_t)(batch * c.in), &st, -1, 1);
    std::vector<double> dy = rounded<T>((size_t)(batch * c.out), &st, -1, 1);
    std::vector<double> bias = rounded<T>((size_t)c.out, &st, -0.5, 0.5);

    /* reference: float64 C kernels, merge path */
    std::vector<const double *> rc_, rg_;
    for (auto &v : cores) rc_.push_back(v.data());
    for (auto &v : gates) rg_.push_back(v.data());
    std::vector<double> ry((size_t)(batch * c.out)), rt((size_t)(batch * rm));
    int rc = linear_fwd_f64(&d, COMERA_PATH_MERGE, batch, x.data(), rc_.data(), rg_.data(),
                                      has_bias ? bias.data() : nullptr, ry.data(), rt.data(), 1);
    std::vector<double> rdx((size_t)(batch * c.in)), rdb((size_t)c.out);
    std::vector<std::vector<double>> rdc, rdg;
    std::vector<double *> rdcp, rdgp;
    for (auto &v : cores) rdc.emplace_back(v.size());
    for (auto &v : gates) rdg.emplace_back(v.size());
    for (auto &v : rdc) rdcp.push_back(v.data());
    for (auto &v : rdg) rdgp.push_back(v.data());
    if (!rc)
        rc = linear_bwd_f64(&d, COMERA_PATH_MERGE, batch, dy.data(), x.data(), rt.data(),
                                      rc_.data(), rg_.data(), rdx.data(), rdcp.data(), rdgp.data(),
                                      has_bias ? rdb.data() : nullptr, 1);
    std::string name = std::string(c.name) + " dtype " + std::to_string((int)DT<T>::id) +
                       " batch " + std::to_string(batch) + (has_bias ? " bias" : "") +
                       (want_dx ? " dx" : "");
    check(rc == COMERA_OK, name + ": reference kernels ran");
    if (rc) return;

    /* the CUDA launchers, emulated */
    std::vector<std::vector<T>> tc, tg;
    for (auto &v : cores) tc.push_back(as<T>(v));
    for (auto &v : gates) tg.push_back(as<T>(v));
    std::vector<const void *> cp, gp;
    for (auto &v : tc) cp.push_back(v.data());
    for (auto &v : tg) gp.push_back(v.data());
    std::vector<T> tx = as<T>(x), tdy = as<T>(dy), tb = as<T>(bias);
    std::vector<T> y((size_t)(batch * c.out)), t((size_t)(batch * rm));
    size_t fb = 0, bb = 0;
    rc = linear_cuda_workspace(&d, batch, DT<T>::id, has_bias, 0, &fb);
    check(rc == COMERA_OK, name + ": forward workspace size");
    rc = linear_cuda_workspace(&d, batch, DT<T>::id, has_bias, 1, &bb);
    check(rc == COMERA_OK, name + ": backward workspace size");
    Guarded fw(fb), bw(bb);
    rc = linear_fwd_cuda(&d, COMERA_PATH_AUTO, DT<T>::id, batch, tx.data(), cp.data(),
                                   gp.data(), has_bias ? tb.data() : nullptr, y.data(), t.data(),
                                   fw.buf.data(), fw.bytes, nullptr, nullptr);
    check(rc == COMERA_OK, name + ": forward returned " + std::to_string(rc));
    check(fw.intact(), name + ": forward stayed inside its workspace");
    double tol = DT<T>::tol;
    double e = rel_err(y, ry);
    check(e <= tol, name + ": y error " + std::to_string(e));
    e = rel_err(t, rt);
    check(e <= tol, name + ": t error " + std::to_string(e));

    /* backward from the reference t rounded to T, as the op would see it */
    std::vector<T> tt = as<T>(rt), dx((size_t)(batch * c.in)), db((size_t)c.out);
    std::vector<std::vector<T>> dc, dg;
    for (auto &v : cores) dc.emplace_back(v.size(), from_d<T>(123.0));
    for (auto &v : gates) dg.emplace_back(v.size(), from_d<T>(123.0));
    std::vector<void *> dcp, dgp;
    for (auto &v : dc) dcp.push_back(v.data());
    for (auto &v : dg) dgp.push_back(v.data());
    rc = linear_bwd_cuda(&d, COMERA_PATH_MERGE, DT<T>::id, batch, tdy.data(), tx.data(),
                                   tt.data(), cp.data(), gp.data(), want_dx ? dx.data() : nullptr,
                                   dcp.data(), dgp.data(), has_bias ? db.data() : nullptr,
                                   bw.buf.data(), bw.bytes, nullptr, nullptr);
    check(rc == COMERA_OK, name + ": backward returned " + std::to_string(rc));
    check(bw.intact(), name + ": backward stayed inside its workspace");
    if (want_dx) {
        e = rel_err(dx, rdx);
        check(e <= tol, name + ": dx error " + std::to_string(e));
    }
    if (has_bias) {
        e = rel_err(db, rdb);
        check(e <= tol, name + ": dbias error " + std::to_string(e));
    }
    for (int k = 0; k < D; k++) {
        e = rel_err(dc[k], rdc[k]);
        check(e <= tol, name + ": dcore " + std::to_string(k) + " error " + std::to_string(e));
    }
    /* a gate gradient sums products over a whole core, with cancellation: in
     * 16-bit types its error relative to its largest entry is a few times
     * that of the other outputs */
    const int id = DT<T>::id;
    double gtol = id == COMERA_DT_BF16 || id == COMERA_DT_F16 ? 3 * tol : tol;
    for (int k = 0; k < D - 1; k++) {
        e = rel_err(dg[k], rdg[k]);
        check(e <= gtol, name + ": dgate " + std::to_string(k) + " error " + std::to_string(e));
    }
}

static void argument_errors() {
    std::vector<int64_t> im{2, 3}, om{4}, rk{1, 2, 3, 1};
    comera_tt_linear_desc d{};
    d.num_in = 2;
    d.num_out = 1;
    d.in_modes = im.data();
    d.out_modes = om.data();
    d.ranks = rk.data();
    d.in_features = 6;
    d.out_features = 4;
    std::vector<float> c0(6), c1(18), c2(12), g0(2), g1(3), x(6), y(4), t(3);
    const void *cp[3] = {c0.data(), c1.data(), c2.data()}, *gp[2] = {g0.data(), g1.data()};
    size_t bytes = 0;
    check(linear_cuda_workspace(&d, 1, COMERA_DT_F32, 0, 0, &bytes) == COMERA_OK &&
              bytes > 0,
          "workspace size for a valid layer");
    std::vector<char> ws(bytes);
    check(linear_fwd_cuda(&d, 0, COMERA_DT_F32, 1, x.data(), cp, gp, nullptr, y.data(),
                                    t.data(), ws.data(), bytes - 1, nullptr, nullptr) ==
              COMERA_ERR_WORKSPACE,
          "a workspace one byte short is refused");
    check(linear_fwd_cuda(&d, 3, COMERA_DT_F32, 1, x.data(), cp, gp, nullptr, y.data(),
                                    t.data(), ws.data(), bytes, nullptr, nullptr) == COMERA_ERR_ARG,
          "path 3 is refused");
    check(linear_fwd_cuda(&d, 0, 7, 1, x.data(), cp, gp, nullptr, y.data(), t.data(),
                                    ws.data(), bytes, nullptr, nullptr) == COMERA_ERR_ARG,
          "dtype 7 is refused");
    d.out_features = 5;
    check(linear_cuda_workspace(&d, 1, COMERA_DT_F32, 0, 0, &bytes) == COMERA_ERR_ARG,
          "out_features above the product of the modes is refused");
}

/* comera_gate_prox_cuda against the C kernel comera_gate_prox_f64/f32 on the
 * same gates: random values near the threshold, dead entries, sign flips,
 * min_live rescues, kill on and off, and a NaN that must leave all alone. */
template <typename T, typename R>
static void gate_prox_case(int dt, unsigned seed, double threshold, int64_t min_live, int kill,
                           bool with_nan,
                           int (*ref_fn)(int64_t, R *const *, int8_t *const *, const int64_t *,
                                         double, int64_t, int, int64_t *, int),
                           int G = 6) {
    unsigned st = seed;
    const int64_t base_sizes[] = {1, 5, 17, 3, 40, 8};
    std::vector<int64_t> sizes(G);
    for (int k = 0; k < G; k++) sizes[k] = base_sizes[k % 6];
    std::vector<std::vector<R>> rg(G);
    std::vector<std::vector<T>> tg(G);
    std::vector<std::vector<int8_t>> rs(G), ts(G);
    for (int k = 0; k < G; k++) {
        for (int64_t i = 0; i < sizes[k]; i++) {
            double v = urand(&st) * 0.05;
            int8_t s = urand(&st) > 0.7 ? 0 : (urand(&st) > 0.0 ? 1 : -1);  /* some dead, some flipped */
            T tv = from_d<T>(v);
            rg[k].push_back((R)to_d(tv));
            tg[k].push_back(tv);
            rs[k].push_back(s);
        }
        ts[k] = rs[k];
    }
    if (with_nan) {  /* in the last gate of size 40: the last chunk when G > COMERA_GATE_CHUNK */
        int k = G - 1;
        while (sizes[k] != 40) k--;
        rg[k][7] = (R)NAN;
        tg[k][7] = from_d<T>(NAN);
    }
    std::vector<R *> rgp;
    std::vector<int8_t *> rsp;
    std::vector<void *> tgp;
    std::vector<int8_t *> tsp;
    for (int k = 0; k < G; k++) {
        rgp.push_back(rg[k].data());
        rsp.push_back(rs[k].data());
        tgp.push_back(tg[k].data());
        tsp.push_back(ts[k].data());
    }
    std::vector<int64_t> rlive(G), live(G, 99);
    int rrc = ref_fn(G, rgp.data(), rsp.data(), sizes.data(), threshold, min_live, kill,
                     rlive.data(), 1);
    int rc = comera_gate_prox_cuda(dt, G, tgp.data(), tsp.data(), sizes.data(), threshold,
                                   min_live, kill, live.data(), nullptr);
    bool ok = rc == COMERA_OK && (rrc == COMERA_OK || rrc == COMERA_GATE_NAN) && live == rlive;
    for (int k = 0; k < G && ok; k++) {
        ok = ts[k] == rs[k];
        for (int64_t i = 0; i < sizes[k] && ok; i++) {
            double a = to_d(tg[k][i]), b = (double)rg[k][i];
            ok = (std::isnan(a) && std::isnan(b)) || a == b;
        }
    }
    check(ok, "gate prox dtype " + std::to_string(dt) + " seed " + std::to_string(seed) +
                  " gates " + std::to_string(G) + " threshold " + std::to_string(threshold) +
                  " min_live " + std::to_string(min_live) + " kill " + std::to_string(kill) +
                  (with_nan ? " with NaN" : ""));
}

static void gate_prox() {
    unsigned seed = 100;
    for (double thr : {-1.0, 0.0, 0.01, 0.03})
        for (int64_t min_live : {0, 1, 4})
            for (int kill = 0; kill < 2; kill++)
                for (bool nan : {false, true}) {
                    gate_prox_case<double, double>(COMERA_DT_F64, seed++, thr, min_live, kill, nan,
                                                   comera_gate_prox_f64);
                    gate_prox_case<float, float>(COMERA_DT_F32, seed++, thr, min_live, kill, nan,
                                                 comera_gate_prox_f32);
                    /* 16-bit gates against the float32 kernel on the same rounded values */
                    gate_prox_case<__nv_bfloat16, float>(COMERA_DT_BF16, seed++, thr, min_live, kill,
                                                         nan, comera_gate_prox_f32);
                    gate_prox_case<__half, float>(COMERA_DT_F16, seed++, thr, min_live, kill, nan,
                                                  comera_gate_prox_f32);
                }
    /* more gates than one launch carries: three chunks, a NaN in the last one
     * must still leave the first chunks alone */
    for (int G : {COMERA_GATE_CHUNK, COMERA_GATE_CHUNK + 1, 2 * COMERA_GATE_CHUNK + 23})
        for (bool nan : {false, true})
            gate_prox_case<float, float>(COMERA_DT_F32, seed++, 0.01, 1, 1, nan,
                                         comera_gate_prox_f32, G);
    int64_t size = 1, live = 0;
    void *g = &live;
    int8_t s = 0, *sp = &s;
    check(comera_gate_prox_cuda(COMERA_DT_F32, 1, &g, &sp, &size, NAN, 0, 1, &live, nullptr) ==
              COMERA_ERR_ARG,
          "gate prox: a NaN threshold is refused");
    check(comera_gate_prox_cuda(COMERA_DT_F32, 1, nullptr, &sp, &size, 0.1, 0, 1, &live,
                                nullptr) == COMERA_ERR_ARG,
          "gate prox: a missing pointer array is refused");
}

/* Kernels, cuBLAS calls and copies of one forward and one backward call,
 * for each linear case of launch_counts.txt, against the table (a fixed
 * launch budget per layer shape, whatever the batch). */
static void launch_counts(const char *table) {
    std::vector<LaunchCase> cases = read_launch_table(table, "linear");
    check(cases.size() >= 4, std::string("launch table ") + table + " has linear cases");
    for (const LaunchCase &lc : cases) {
        std::vector<int64_t> im = lc.at("in"), om = lc.at("out"), rk = lc.at("ranks");
        const std::vector<int64_t> &feat = lc.at("features");
        const int64_t batch = lc.one("batch");
        const bool hb = lc.one("bias") == 1, want_dx = lc.one("dx") == 1;
        comera_tt_linear_desc d{};
        d.num_in = (int)im.size();
        d.num_out = (int)om.size();
        d.in_modes = im.data();
        d.out_modes = om.data();
        d.ranks = rk.data();
        d.in_features = feat.size() == 2 ? feat[0] : 0;
        d.out_features = feat.size() == 2 ? feat[1] : 0;
        const int D = d.num_in + d.num_out;
        if (rk.size() != (size_t)D + 1 || batch < 0 || lc.at("fwd").size() != 3 ||
            lc.at("bwd").size() != 3) {
            check(false, "launch table: malformed line:" + lc.line);
            continue;
        }
        std::vector<int64_t> dims(im);
        dims.insert(dims.end(), om.begin(), om.end());
        unsigned st = 1;
        std::vector<std::vector<float>> c, g;
        for (int k = 0; k < D; k++) {
            c.push_back(std::vector<float>((size_t)(rk[k] * dims[k] * rk[k + 1])));
            for (auto &v : c.back()) v = (float)urand(&st);
            if (k < D - 1) g.push_back(std::vector<float>((size_t)rk[k + 1], 1.0f));
        }
        std::vector<const void *> cp, gp;
        std::vector<void *> dcp, dgp;
        std::vector<std::vector<float>> dc(c), dg(g);
        for (auto &v : c) cp.push_back(v.data());
        for (auto &v : g) gp.push_back(v.data());
        for (auto &v : dc) dcp.push_back(v.data());
        for (auto &v : dg) dgp.push_back(v.data());
        const int64_t in = d.in_features, out = d.out_features, rm = rk[d.num_in];
        std::vector<float> x((size_t)(batch * in), 0.5f), y((size_t)(batch * out)),
            t((size_t)(batch * rm)), b((size_t)out), dx((size_t)(batch * in)), db((size_t)out);
        size_t fb = 0, bb = 0;
        int rc = linear_cuda_workspace(&d, batch, COMERA_DT_F32, hb, 0, &fb);
        rc |= linear_cuda_workspace(&d, batch, COMERA_DT_F32, hb, 1, &bb);
        std::vector<char> fw(fb), bw(bb);
        comera_emu::Counts before = comera_emu::Counts::now();
        rc |= linear_fwd_cuda(&d, 0, COMERA_DT_F32, batch, x.data(), cp.data(), gp.data(),
                              hb ? b.data() : nullptr, y.data(), t.data(), fw.data(), fb, nullptr,
                              nullptr);
        comera_emu::Counts nf = comera_emu::Counts::now() - before;
        before = comera_emu::Counts::now();
        rc |= linear_bwd_cuda(&d, 0, COMERA_DT_F32, batch, y.data(), x.data(), t.data(), cp.data(),
                              gp.data(), want_dx ? dx.data() : nullptr, dcp.data(), dgp.data(),
                              hb ? db.data() : nullptr, bw.data(), bb, nullptr, nullptr);
        comera_emu::Counts nb = comera_emu::Counts::now() - before;
        const std::vector<int64_t> &ef = lc.at("fwd"), &eb = lc.at("bwd");
        comera_emu::Counts want_f{(long)ef[0], (long)ef[1], (long)ef[2]};
        comera_emu::Counts want_b{(long)eb[0], (long)eb[1], (long)eb[2]};
        printf("launches%s: forward %ld,%ld,%ld backward %ld,%ld,%ld (kernels, cuBLAS, copies)\n",
               lc.line.substr(6).c_str(), nf.kernels, nf.blas, nf.copies, nb.kernels, nb.blas,
               nb.copies);
        check(rc == COMERA_OK, "launch counts: the calls ran:" + lc.line);
        check(nf == want_f, "forward launches as in the table:" + lc.line);
        check(nb == want_b, "backward launches as in the table:" + lc.line);
    }
    /* the workspace of the benchmark shape, for the record */
    std::vector<int64_t> im{8, 8, 12}, om{12, 16, 16}, rk{1, 8, 32, 32, 32, 16, 1};
    comera_tt_linear_desc d{};
    d.num_in = 3;
    d.num_out = 3;
    d.in_modes = im.data();
    d.out_modes = om.data();
    d.ranks = rk.data();
    d.in_features = 768;
    d.out_features = 3072;
    size_t fb = 0, bb = 0;
    linear_cuda_workspace(&d, 4096, COMERA_DT_BF16, 1, 0, &fb);
    linear_cuda_workspace(&d, 4096, COMERA_DT_BF16, 1, 1, &bb);
    printf("768->3072 rank 32, 4096 rows, bf16 with bias: workspace forward %.2f MB, "
           "backward %.2f MB\n", fb / 1e6, bb / 1e6);
}

int main(int argc, char **argv) {
    unsigned seed = 7;
    for (const Case &c : CASES) {
        for (int64_t batch : {0, 1, 37, 130}) {
            for (int hb = 0; hb < 2; hb++) {
                run_case<double>(c, batch, hb, hb, seed++);
                run_case<float>(c, batch, hb, !hb, seed++);
            }
            run_case<__nv_bfloat16>(c, batch, true, true, seed++);
            run_case<__half>(c, batch, false, true, seed++);
        }
    }
    argument_errors();
    gate_prox();
    launch_counts(argc > 1 ? argv[1] : "launch_counts.txt");
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
