/* The gate step (csrc/gate_prox/step.cu, comera_gate_step_cuda) on the host
 * emulation against its C kernels (comera_gate_step_f32/_f64), bit for bit:
 * random gates with ties, dead and flipped entries, gates without gradient,
 * shrinks that need the min_live rescue, frozen ranks, kill on and off, a
 * NaN (nothing may change but the NaN record), in one launch and in chunks;
 * bfloat16 and float16 gates against the float32 kernel where their
 * arithmetic is exact.  And the launches of one call, against the
 * gate_step lines of launch_counts.txt (one launch for 192 gates). */
#include "cuda_emulate.h"
#include "emu_check.h"
#include "launch_table.h"

#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

#include "comera/cuda.h"
#include "comera/gate_prox.h"

namespace {

const double VALUES[] = {0.0, 0.25, -0.25, 0.5, -0.5, 0.3, 1e-3, -2e-3, 0.05, -0.07, 1.0};

// Everything one call reads and writes, in element type T (R: the C
// kernel's type for the same values).
template <typename T> struct Gates {
    std::vector<std::vector<T>> g, grad;
    std::vector<std::vector<int8_t>> s;
    std::vector<std::vector<double>> sal;
    std::vector<int64_t> sizes, live;
    std::vector<T> amount;
    std::vector<uint8_t> nan_gates;
    uint8_t frozen = 0, nan_seen = 0;
    std::vector<void *> gp;
    std::vector<const void *> grp;
    std::vector<int8_t *> sp;
    std::vector<double *> salp;

    comera_gate_step_args args(double threshold, int64_t min_live, int kill, bool shrink,
                               bool note) {
        gp.clear(), grp.clear(), sp.clear(), salp.clear();
        for (size_t k = 0; k < g.size(); k++) {
            gp.push_back(g[k].data());
            grp.push_back(grad[k].empty() ? nullptr : grad[k].data());
            sp.push_back(s[k].data());
            salp.push_back(sal[k].data());
        }
        live.assign(g.size(), 99);
        comera_gate_step_args a;
        a.num_gates = (int64_t)g.size();
        a.gates = gp.data();
        a.signs = sp.data();
        a.grads = grp.data();
        a.saliency = salp.data();
        a.sizes = sizes.data();
        a.amount = shrink ? amount.data() : nullptr;
        a.frozen = &frozen;
        a.nan_seen = note ? &nan_seen : nullptr;
        a.nan_gates = note ? nan_gates.data() : nullptr;
        a.live = live.data();
        a.threshold = threshold;
        a.min_live = min_live;
        a.kill = kill;
        return a;
    }
};

// Random gates of G entries each drawn from VALUES (ties), some scaled.
template <typename T> Gates<T> random_gates(unsigned *st, int G, bool nan, int grad_every) {
    Gates<T> x;
    for (int k = 0; k < G; k++) {
        int64_t n = (int64_t)((urand_from(st) + 1.0) * 6.0);  // 0 .. 11
        x.sizes.push_back(n);
        std::vector<T> g, gr;
        std::vector<int8_t> s;
        std::vector<double> sal;
        for (int64_t i = 0; i < n; i++) {
            int pick = (int)((urand_from(st) + 1.0) * 5.5);
            double v = VALUES[pick] * (urand_from(st) > 0 ? 1.0 : 1.1);
            double u = urand_from(st);
            int8_t sg = (int8_t)((v > 0) - (v < 0));
            if (u < -0.7) sg = 0;                  /* dead */
            else if (u > 0.8) sg = (int8_t)-sg;    /* flipped since */
            g.push_back(from_d<T>(v));
            s.push_back(sg);
            gr.push_back(from_d<T>(urand_from(st)));
            sal.push_back((urand_from(st) + 1.0) * 0.5);
        }
        x.g.push_back(g);
        x.s.push_back(s);
        x.grad.push_back(grad_every && k % grad_every == 1 ? std::vector<T>() : gr);
        x.sal.push_back(sal);
        x.amount.push_back(from_d<T>((urand_from(st) + 1.0) * (k % 3 == 0 ? 1.0 : 0.05)));
    }
    x.nan_gates.assign(G, 0);
    if (nan) {
        int k = G - 1;
        while (k > 0 && x.sizes[k] == 0) k--;
        if (x.sizes[k]) x.g[k][0] = from_d<T>(NAN);
    }
    return x;
}

template <typename T> bool same_bits(const T &a, const T &b) {
    return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <typename T, typename R> bool same(const Gates<T> &x, const Gates<R> &y) {
    bool ok = x.live == y.live && x.nan_seen == y.nan_seen && x.nan_gates == y.nan_gates;
    for (size_t k = 0; k < x.g.size() && ok; k++) {
        ok = x.s[k] == y.s[k];
        for (int64_t i = 0; i < x.sizes[k] && ok; i++) {
            double a = to_d(x.g[k][i]), b = to_d(y.g[k][i]);
            ok = (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
            ok = ok && same_bits(x.sal[k][i], y.sal[k][i]);
        }
    }
    return ok;
}

// The same random gates through the CUDA kernel (type T) and the C kernel
// (type R, holding the same values); the launches of the CUDA call are
// returned in *kernels.
template <typename T, typename R>
void step_case(unsigned seed, int G, double threshold, int64_t min_live, int kill, bool shrink,
               bool frozen, bool nan, bool note, int (*ref)(const comera_gate_step_args *, int),
               long *kernels = nullptr) {
    unsigned st = seed;
    Gates<T> x = random_gates<T>(&st, G, nan, 3);
    Gates<R> y;
    y.sizes = x.sizes;
    y.s = x.s;
    y.sal = x.sal;
    for (size_t k = 0; k < x.g.size(); k++) {
        std::vector<R> g, gr;
        for (const T &v : x.g[k]) g.push_back((R)to_d(v));
        for (const T &v : x.grad[k]) gr.push_back((R)to_d(v));
        y.g.push_back(g);
        y.grad.push_back(gr);
    }
    for (const T &v : x.amount) y.amount.push_back((R)to_d(v));
    y.nan_gates = x.nan_gates;
    x.frozen = y.frozen = frozen;
    comera_gate_step_args ya = y.args(threshold, min_live, kill, shrink, note);
    int rrc = ref(&ya, 1);
    comera_gate_step_args xa = x.args(threshold, min_live, kill, shrink, note);
    comera_emu::Counts before = comera_emu::Counts::now();
    int rc = comera_gate_step_cuda(DT<T>::id, &xa, nullptr);
    comera_emu::Counts used = comera_emu::Counts::now() - before;
    if (kernels) *kernels = used.kernels;
    bool ok = rc == COMERA_OK && rrc == (nan ? COMERA_GATE_NAN : COMERA_OK) && same(x, y) &&
              used.blas == 0 && used.copies == 0;
    check(ok, "gate step dtype " + std::to_string(DT<T>::id) + " seed " + std::to_string(seed) +
                  " gates " + std::to_string(G) + " threshold " + std::to_string(threshold) +
                  " min_live " + std::to_string(min_live) + " kill " + std::to_string(kill) +
                  " shrink " + std::to_string(shrink) + " frozen " + std::to_string(frozen) +
                  (nan ? " with NaN" : "") + (note ? " noted" : ""));
}

void gate_step_cases() {
    unsigned seed = 500;
    for (double thr : {-1.0, 0.0, 0.01})
        for (int64_t min_live : {0, 1, 3})
            for (int kill = 0; kill < 2; kill++)
                for (int flags = 0; flags < 8; flags++) {
                    bool shrink = flags & 1, frozen = flags & 2, nan = flags & 4;
                    step_case<double, double>(seed++, 7, thr, min_live, kill, shrink, frozen, nan,
                                              true, comera_gate_step_f64);
                    bool note = seed % 2;  /* the NaN record both ways */
                    step_case<float, float>(seed++, 7, thr, min_live, kill, shrink, frozen, nan,
                                            note, comera_gate_step_f32);
                }
    /* chunks: a NaN in the last chunk leaves the first ones alone */
    for (int G : {COMERA_GATE_STEP_CHUNK, COMERA_GATE_STEP_CHUNK + 1, 2 * COMERA_GATE_STEP_CHUNK + 23})
        for (bool nan : {false, true})
            step_case<float, float>(seed++, G, 0.01, 1, 1, true, false, nan, true,
                                    comera_gate_step_f32);
}

/* 16-bit gates: with no shrink the step is the proximal rule, exact in any
 * type; against the float32 kernel on the same values (the saliency's
 * products round differently: no gradients here). */
template <typename T> void half_case(unsigned seed, bool nan) {
    unsigned st = seed;
    Gates<T> x = random_gates<T>(&st, 9, nan, 0);
    Gates<float> y;
    y.sizes = x.sizes;
    y.s = x.s;
    y.sal = x.sal;
    for (size_t k = 0; k < x.g.size(); k++) {
        std::vector<float> g;
        for (const T &v : x.g[k]) g.push_back((float)to_d(v));
        y.g.push_back(g);
        x.grad[k].clear();
        y.grad.emplace_back();
    }
    y.nan_gates = x.nan_gates;
    comera_gate_step_args ya = y.args(0.01, 1, 1, false, true);
    comera_gate_step_f32(&ya, 1);
    comera_gate_step_args xa = x.args(0.01, 1, 1, false, true);
    int rc = comera_gate_step_cuda(DT<T>::id, &xa, nullptr);
    check(rc == COMERA_OK && same(x, y), "gate step 16-bit dtype " + std::to_string(DT<T>::id) +
                                             (nan ? " with NaN" : ""));
}

/* One call's launches for each gate_step line of the table. */
void launch_counts(const char *table) {
    std::vector<LaunchCase> cases = read_launch_table(table, "gate_step");
    check(cases.size() >= 2, std::string("gate_step launch counts read from ") + table);
    for (const LaunchCase &c : cases) {
        long kernels = -1;
        step_case<float, float>(900 + (unsigned)c.one("gates"), (int)c.one("gates"), 0.01, 1, 1,
                                true, false, false, true, comera_gate_step_f32, &kernels);
        check(kernels == c.one("kernels"), "gate_step launches: " + c.line + " counted " +
                                              std::to_string(kernels));
    }
}

void argument_errors() {
    Gates<float> x;
    comera_gate_step_args a = x.args(NAN, 1, 1, false, false);
    check(comera_gate_step_cuda(COMERA_DT_F32, &a, nullptr) == COMERA_ERR_ARG,
          "gate step: a NaN threshold is refused");
    check(comera_gate_step_cuda(COMERA_DT_F32, nullptr, nullptr) == COMERA_ERR_ARG,
          "gate step: no arguments is refused");
    a = x.args(0.1, 1, 1, false, false);
    a.num_gates = 1;
    a.gates = nullptr;
    check(comera_gate_step_cuda(COMERA_DT_F32, &a, nullptr) == COMERA_ERR_ARG,
          "gate step: a missing pointer table is refused");
}

}  // namespace

int main(int argc, char **argv) {
    gate_step_cases();
    for (bool nan : {false, true}) {
        half_case<__nv_bfloat16>(700 + nan, nan);
        half_case<__half>(710 + nan, nan);
    }
    argument_errors();
    launch_counts(argc > 1 ? argv[1] : "launch_counts.txt");
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
