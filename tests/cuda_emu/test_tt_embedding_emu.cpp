/* The CUDA TT embedding launchers (csrc/tt_embedding/cuda*.cu), compiled
 * for the host with the emulation in cuda_emulate.h, against the float64 C
 * kernels (csrc/tt_embedding/cpu_f64.c) as reference, for float64, float32,
 * bfloat16 and float16: plain, sum (with and without per-sample weights) and
 * mean bags, every reuse strategy, repeated indices (also runs of hundreds
 * of one row), a padding row, padded row and dim modes, empty bags and an
 * empty batch.  Also: the workspace size is enough (guard bytes past it stay
 * untouched), an index out of range reads as NaN, argument errors, and the
 * backward is bitwise the same for a permuted batch of distinct rows, and
 * the kernels and copies of one call against launch_counts.txt (argument 1,
 * default ./launch_counts.txt).
 * Prints one line per failure, then "N passed, M failed"; exits 1 on failure. */
#include "cuda_emulate.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "comera/cuda.h"
#include "comera/tt_embedding.h"
#include "../c/one_call.h"
#include "emu_check.h"
#include "launch_table.h"

struct Case {
    const char *name;
    std::vector<int64_t> v, e, r;
    int64_t num, dim, pad;
};

static const Case CASES[] = {
    {"d2 5x3", {5, 3}, {2, 3}, {1, 3, 1}, 15, 6, -1},
    {"d2 padded pad0", {4, 4}, {3, 3}, {1, 4, 1}, 13, 7, 0},
    {"d3 TT bound", {3, 2, 4}, {2, 2, 3}, {1, 6, 12, 1}, 24, 12, 5},
    {"d3 rank1", {2, 3, 3}, {2, 1, 3}, {1, 1, 1, 1}, 17, 5, -1},
    {"d4 mixed", {2, 3, 2, 2}, {2, 2, 1, 3}, {1, 3, 4, 2, 1}, 20, 11, 19},
    {"d3 wide", {4, 5, 3}, {4, 4, 6}, {1, 8, 8, 1}, 60, 96, 7},
};

static unsigned g_state = 12345;
static double urand() { return urand_from(&g_state); }

template <typename T> static std::vector<double> rounded(size_t n, double lo, double hi) {
    std::vector<double> v(n);
    for (auto &x : v) x = to_d(from_d<T>(lo + (hi - lo) * (urand() + 1.0) / 2.0));
    return v;
}
template <typename T> static std::vector<T> as(const std::vector<double> &v) {
    std::vector<T> o(v.size());
    for (size_t i = 0; i < v.size(); i++) o[i] = from_d<T>(v[i]);
    return o;
}
template <typename T> static double rel_err(const std::vector<T> &got, const std::vector<double> &ref) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < ref.size(); i++) {
        num = std::fmax(num, std::fabs(to_d(got[i]) - ref[i]));
        if (std::isnan(to_d(got[i]))) num = 1e30;
        den = std::fmax(den, std::fabs(ref[i]));
    }
    return got.size() == ref.size() ? num / den : 1e30;
}

struct Layer {
    comera_tt_embedding_desc d{};
    std::vector<std::vector<double>> cores, gates;
    explicit Layer(const Case &c) {
        d.num_cores = (int32_t)c.v.size();
        d.row_modes = c.v.data();
        d.dim_modes = c.e.data();
        d.ranks = c.r.data();
        d.num_embeddings = c.num;
        d.embedding_dim = c.dim;
        d.padding_idx = c.pad;
        for (int k = 0; k < d.num_cores; k++) {
            cores.push_back(std::vector<double>((size_t)(c.r[k] * c.v[k] * c.e[k] * c.r[k + 1])));
            if (k + 1 < d.num_cores) gates.push_back(std::vector<double>((size_t)c.r[k + 1]));
        }
    }
};

/* One batch against the float64 C kernels, forward and backward. */
template <typename T>
static void run(const Case &c, int mode, bool with_psw, int reuse, std::vector<int64_t> idx,
                std::vector<int64_t> offsets) {
    Layer L(c);
    for (auto &v : L.cores) v = rounded<T>(v.size(), -0.8, 0.8);
    for (auto &v : L.gates) v = rounded<T>(v.size(), 0.5, 1.5);
    const int64_t n = (int64_t)idx.size();
    comera_tt_embedding_batch b{};
    b.mode = mode;
    b.n = n;
    b.indices = idx.data();
    b.num_bags = mode ? (int64_t)offsets.size() - 1 : 0;
    b.offsets = mode ? offsets.data() : nullptr;
    const int64_t rows = mode ? b.num_bags : n, D = c.dim;
    std::vector<double> psw = rounded<T>((size_t)n, -1.5, 1.5);
    std::vector<double> grad = rounded<T>((size_t)(rows * D), -1, 1);
    const double *rpsw = with_psw ? psw.data() : nullptr;
    std::string what = std::string(c.name) + " mode " + std::to_string(mode) +
                       (with_psw ? " psw" : "") + " reuse " + std::to_string(reuse) + " n " +
                       std::to_string(n) + " dtype " + std::to_string((int)DT<T>::id);

    std::vector<const double *> rc, rg;
    for (auto &v : L.cores) rc.push_back(v.data());
    for (auto &v : L.gates) rg.push_back(v.data());
    std::vector<double> ref_out((size_t)(rows * D));
    int rrc = embedding_fwd_f64(&L.d, &b, rpsw, COMERA_REUSE_DEDUP, rc.data(), rg.data(),
                                          ref_out.data(), 1);
    std::vector<std::vector<double>> rdc, rdg;
    std::vector<double *> rdcp, rdgp;
    for (auto &v : L.cores) rdc.push_back(std::vector<double>(v.size()));
    for (auto &v : L.gates) rdg.push_back(std::vector<double>(v.size()));
    for (auto &v : rdc) rdcp.push_back(v.data());
    for (auto &v : rdg) rdgp.push_back(v.data());
    rrc |= embedding_bwd_f64(&L.d, &b, rpsw, COMERA_REUSE_DEDUP, grad.data(), rc.data(),
                                       rg.data(), rdcp.data(), rdgp.data(), 1);
    check(rrc == COMERA_OK, what + ": reference kernels");

    std::vector<std::vector<T>> tc, tg, dc, dg;
    std::vector<const void *> tcp, tgp;
    std::vector<void *> dcp, dgp;
    for (auto &v : L.cores) tc.push_back(as<T>(v));
    for (auto &v : L.gates) tg.push_back(as<T>(v));
    for (auto &v : tc) { tcp.push_back(v.data()); dc.push_back(std::vector<T>(v.size(), from_d<T>(7))); }
    for (auto &v : tg) { tgp.push_back(v.data()); dg.push_back(std::vector<T>(v.size(), from_d<T>(7))); }
    for (auto &v : dc) dcp.push_back(v.data());
    for (auto &v : dg) dgp.push_back(v.data());
    std::vector<T> tpsw = as<T>(psw), tgrad = as<T>(grad);
    std::vector<T> out((size_t)(rows * D), from_d<T>(7));

    size_t fb = 0, bb = 0;
    check(embedding_cuda_workspace(&L.d, &b, DT<T>::id, 0, &fb) == COMERA_OK &&
              embedding_cuda_workspace(&L.d, &b, DT<T>::id, 1, &bb) == COMERA_OK,
          what + ": workspace size");
    Guarded wf(fb), wb(bb);
    int frc = embedding_fwd_cuda(&L.d, &b, DT<T>::id, with_psw ? tpsw.data() : nullptr,
                                           reuse, tcp.data(), tgp.data(), out.data(),
                                           wf.buf.data(), fb, nullptr);
    check(frc == COMERA_OK, what + ": forward returned " + std::to_string(frc));
    check(wf.intact(), what + ": forward wrote past its workspace");
    double e = rel_err(out, ref_out);
    check(e <= DT<T>::tol, what + ": forward error " + std::to_string(e));
    int brc = embedding_bwd_cuda(&L.d, &b, DT<T>::id, with_psw ? tpsw.data() : nullptr,
                                           reuse, tgrad.data(), tcp.data(), tgp.data(), dcp.data(),
                                           dgp.data(), wb.buf.data(), bb, nullptr);
    check(brc == COMERA_OK, what + ": backward returned " + std::to_string(brc));
    check(wb.intact(), what + ": backward wrote past its workspace");
    for (size_t k = 0; k < dc.size(); k++) {
        double ek = rel_err(dc[k], rdc[k]);
        check(ek <= 2 * DT<T>::tol, what + ": core " + std::to_string(k) + " grad error " + std::to_string(ek));
    }
    for (size_t k = 0; k < dg.size(); k++) {
        double ek = rel_err(dg[k], rdg[k]);
        check(ek <= 2 * DT<T>::tol, what + ": gate " + std::to_string(k) + " grad error " + std::to_string(ek));
    }
}

static std::vector<int64_t> random_indices(const Case &c, int64_t n) {
    std::vector<int64_t> idx((size_t)n);
    for (auto &t : idx) {
        t = (int64_t)((urand() + 1.0) / 2.0 * (double)c.num);
        if (t >= c.num) t = c.num - 1;
        if (urand() > 0.6) t = 3 % c.num;  // plenty of repeats
    }
    if (c.pad >= 0 && n > 2) idx[1] = c.pad;
    return idx;
}

template <typename T> static void run_all() {
    for (const Case &c : CASES) {
        for (int64_t n : {0, 1, 9, 40}) {
            std::vector<int64_t> idx = random_indices(c, n);
            std::vector<int64_t> off = {0};
            if (n > 0) off = {0, 0, n / 3, n / 3, n};  // empty bags too
            else off = {0, 0};
            for (int reuse : {COMERA_REUSE_AUTO, COMERA_REUSE_NONE, COMERA_REUSE_DEDUP})
                run<T>(c, COMERA_EMB_PLAIN, false, reuse, idx, {});
            run<T>(c, COMERA_EMB_SUM, false, COMERA_REUSE_PREFIX, idx, off);
            run<T>(c, COMERA_EMB_SUM, true, COMERA_REUSE_NONE, idx, off);
            run<T>(c, COMERA_EMB_MEAN, false, COMERA_REUSE_AUTO, idx, off);
        }
    }
}

/* Long runs of one row (hundreds of duplicates, over many aligned chunks
 * of the seed's two-pass sum) and large slices (many partial sums per core
 * entry), plain and in bags: a few big bags, a bag of one, an empty one. */
template <typename T> static void long_runs() {
    for (int ci : {2, 5}) {
        const Case &c = CASES[ci];
        for (int64_t n : {300, 700, 2500}) {  // 2500: two merge passes after the chunk ranks
            std::vector<int64_t> idx = random_indices(c, n);
            for (int64_t p = 0; p < n; p++)
                if (urand() > -0.2) idx[(size_t)p] = p % 3 ? 3 % c.num : (c.num - 2);
            std::vector<int64_t> off = {0, n / 2, n / 2 + 1, n / 2 + 1, n};
            run<T>(c, COMERA_EMB_PLAIN, false, COMERA_REUSE_AUTO, idx, {});
            run<T>(c, COMERA_EMB_SUM, true, COMERA_REUSE_NONE, idx, off);
            run<T>(c, COMERA_EMB_MEAN, false, COMERA_REUSE_AUTO, idx, off);
        }
    }
}

/* An index out of range reads NaN (plain row, its bag) and no memory past
 * the table; argument errors come back as codes. */
static void edge_cases() {
    const Case &c = CASES[0];
    Layer L(c);
    for (auto &v : L.cores) v.assign(v.size(), 0.5);
    for (auto &v : L.gates) v.assign(v.size(), 1.0);
    std::vector<const void *> cp, gp;
    std::vector<std::vector<float>> fc, fg;
    for (auto &v : L.cores) fc.push_back(as<float>(v));
    for (auto &v : L.gates) fg.push_back(as<float>(v));
    for (auto &v : fc) cp.push_back(v.data());
    for (auto &v : fg) gp.push_back(v.data());
    std::vector<int64_t> idx = {2, 15, -1, 2}, off = {0, 1, 4};
    comera_tt_embedding_batch b{COMERA_EMB_PLAIN, 4, idx.data(), 0, nullptr};
    size_t bytes = 0;
    embedding_cuda_workspace(&L.d, &b, COMERA_DT_F32, 0, &bytes);
    std::vector<unsigned char> ws(bytes);
    std::vector<float> out((size_t)(4 * c.dim));
    int rc = embedding_fwd_cuda(&L.d, &b, COMERA_DT_F32, nullptr, 0, cp.data(), gp.data(),
                                          out.data(), ws.data(), bytes, nullptr);
    check(rc == COMERA_OK && !std::isnan(out[0]) && std::isnan(out[(size_t)c.dim]) &&
              std::isnan(out[(size_t)(2 * c.dim)]) && out[(size_t)(3 * c.dim)] == out[0],
          "out-of-range indices read as NaN rows");
    comera_tt_embedding_batch bb{COMERA_EMB_SUM, 4, idx.data(), 2, off.data()};
    embedding_cuda_workspace(&L.d, &bb, COMERA_DT_F32, 0, &bytes);
    ws.resize(bytes);
    std::vector<float> bout((size_t)(2 * c.dim));
    rc = embedding_fwd_cuda(&L.d, &bb, COMERA_DT_F32, nullptr, 0, cp.data(), gp.data(),
                                      bout.data(), ws.data(), bytes, nullptr);
    check(rc == COMERA_OK && !std::isnan(bout[0]) && std::isnan(bout[(size_t)c.dim]),
          "a bag holding an out-of-range index is NaN");
    check(embedding_fwd_cuda(&L.d, &b, COMERA_DT_F32, nullptr, 9, cp.data(), gp.data(),
                                       out.data(), ws.data(), bytes, nullptr) == COMERA_ERR_ARG,
          "bad reuse is an argument error");
    check(embedding_fwd_cuda(&L.d, &b, 7, nullptr, 0, cp.data(), gp.data(), out.data(),
                                       ws.data(), bytes, nullptr) == COMERA_ERR_ARG,
          "bad dtype is an argument error");
    check(embedding_fwd_cuda(&L.d, &b, COMERA_DT_F32, nullptr, 0, cp.data(), gp.data(),
                                       out.data(), ws.data(), 16, nullptr) == COMERA_ERR_WORKSPACE,
          "a short workspace is refused");
    comera_tt_embedding_batch bad{5, 4, idx.data(), 0, nullptr};
    check(embedding_cuda_workspace(&L.d, &bad, COMERA_DT_F32, 0, &bytes) == COMERA_ERR_ARG,
          "bad mode is an argument error");
}

/* Distinct rows in two orders: every gradient sum runs in the same order,
 * so the backward is bitwise the same. */
static void permutation_invariance() {
    const Case &c = CASES[5];
    Layer L(c);
    for (auto &v : L.cores) v = rounded<float>(v.size(), -1, 1);
    for (auto &v : L.gates) v = rounded<float>(v.size(), 0.5, 1.5);
    std::vector<std::vector<float>> fc, fg;
    std::vector<const void *> cp, gp;
    for (auto &v : L.cores) fc.push_back(as<float>(v));
    for (auto &v : L.gates) fg.push_back(as<float>(v));
    for (auto &v : fc) cp.push_back(v.data());
    for (auto &v : fg) gp.push_back(v.data());
    std::vector<int64_t> a = {4, 17, 33, 50, 8, 21}, rev(a.rbegin(), a.rend());
    std::vector<float> grad = as<float>(rounded<float>((size_t)(6 * c.dim), -1, 1)), grev(grad.size());
    for (int p = 0; p < 6; p++)
        memcpy(&grev[(size_t)(p * c.dim)], &grad[(size_t)((5 - p) * c.dim)], sizeof(float) * (size_t)c.dim);
    std::vector<std::vector<float>> out[2];
    for (int w = 0; w < 2; w++) {
        comera_tt_embedding_batch b{COMERA_EMB_PLAIN, 6, w ? rev.data() : a.data(), 0, nullptr};
        size_t bytes = 0;
        embedding_cuda_workspace(&L.d, &b, COMERA_DT_F32, 1, &bytes);
        std::vector<unsigned char> ws(bytes);
        std::vector<void *> dcp, dgp;
        for (auto &v : fc) out[w].push_back(std::vector<float>(v.size()));
        for (auto &v : fg) out[w].push_back(std::vector<float>(v.size()));
        for (size_t k = 0; k < fc.size(); k++) dcp.push_back(out[w][k].data());
        for (size_t k = 0; k < fg.size(); k++) dgp.push_back(out[w][fc.size() + k].data());
        embedding_bwd_cuda(&L.d, &b, COMERA_DT_F32, nullptr, 0, w ? grev.data() : grad.data(),
                                     cp.data(), gp.data(), dcp.data(), dgp.data(), ws.data(), bytes,
                                     nullptr);
    }
    bool same = true;
    for (size_t k = 0; k < out[0].size(); k++)
        same = same && memcmp(out[0][k].data(), out[1][k].data(), sizeof(float) * out[0][k].size()) == 0;
    check(same, "backward of permuted distinct rows is bitwise identical");
}

/* Kernels, cuBLAS calls and copies of one forward and one backward call,
 * for each embedding case of launch_counts.txt, against the table. */
static void launch_counts(const char *table) {
    std::vector<LaunchCase> cases = read_launch_table(table, "embedding");
    check(cases.size() >= 3, std::string("launch table ") + table + " has embedding cases");
    for (const LaunchCase &lc : cases) {
        const std::vector<int64_t> &feat = lc.at("features");
        const int64_t n = lc.one("n"), mode = lc.one("mode"), bags = lc.one("bags");
        const int reuse = (int)lc.one("reuse");
        if (feat.size() != 2 || n < 0 || lc.at("fwd").size() != 3 || lc.at("bwd").size() != 3 ||
            lc.at("ranks").size() != lc.at("rows").size() + 1 || (mode != 0 && bags < 1)) {
            check(false, "launch table: malformed line:" + lc.line);
            continue;
        }
        Case c{"table", lc.at("rows"), lc.at("dims"), lc.at("ranks"), feat[0], feat[1], -1};
        Layer L(c);
        std::vector<std::vector<float>> fc, fg, dc, dg;
        std::vector<const void *> cp, gp;
        std::vector<void *> dcp, dgp;
        for (auto &v : L.cores) fc.push_back(as<float>(rounded<float>(v.size(), -1, 1)));
        for (auto &v : L.gates) fg.push_back(std::vector<float>(v.size(), 1.0f));
        for (auto &v : fc) { cp.push_back(v.data()); dc.push_back(std::vector<float>(v.size())); }
        for (auto &v : fg) { gp.push_back(v.data()); dg.push_back(std::vector<float>(v.size())); }
        for (auto &v : dc) dcp.push_back(v.data());
        for (auto &v : dg) dgp.push_back(v.data());
        std::vector<int64_t> idx = random_indices(c, n), off;
        for (int64_t q = 0; mode != 0 && q <= bags; q++) off.push_back(q * n / bags);
        comera_tt_embedding_batch b{(int32_t)mode, n, idx.data(), mode ? bags : 0,
                                    mode ? off.data() : nullptr};
        const int64_t rows = mode ? bags : n;
        std::vector<float> out((size_t)(rows * c.dim)), grad((size_t)(rows * c.dim), 0.25f);
        size_t fb = 0, bb = 0;
        int rc = embedding_cuda_workspace(&L.d, &b, COMERA_DT_F32, 0, &fb);
        rc |= embedding_cuda_workspace(&L.d, &b, COMERA_DT_F32, 1, &bb);
        std::vector<unsigned char> wf(fb), wb(bb);
        comera_emu::Counts before = comera_emu::Counts::now();
        rc |= embedding_fwd_cuda(&L.d, &b, COMERA_DT_F32, nullptr, reuse, cp.data(), gp.data(),
                                 out.data(), wf.data(), fb, nullptr);
        comera_emu::Counts nf = comera_emu::Counts::now() - before;
        before = comera_emu::Counts::now();
        rc |= embedding_bwd_cuda(&L.d, &b, COMERA_DT_F32, nullptr, reuse, grad.data(), cp.data(),
                                 gp.data(), dcp.data(), dgp.data(), wb.data(), bb, nullptr);
        comera_emu::Counts nb = comera_emu::Counts::now() - before;
        const std::vector<int64_t> &ef = lc.at("fwd"), &eb = lc.at("bwd");
        comera_emu::Counts want_f{(long)ef[0], (long)ef[1], (long)ef[2]};
        comera_emu::Counts want_b{(long)eb[0], (long)eb[1], (long)eb[2]};
        printf("launches%s: forward %ld,%ld,%ld backward %ld,%ld,%ld (kernels, cuBLAS, copies)\n",
               lc.line.substr(9).c_str(), nf.kernels, nf.blas, nf.copies, nb.kernels, nb.blas,
               nb.copies);
        check(rc == COMERA_OK, "launch counts: the calls ran:" + lc.line);
        check(nf == want_f, "forward launches as in the table:" + lc.line);
        check(nb == want_b, "backward launches as in the table:" + lc.line);
    }
}

int main(int argc, char **argv) {
    run_all<double>();
    run_all<float>();
    run_all<__nv_bfloat16>();
    run_all<__half>();
    long_runs<double>();
    long_runs<float>();
    edge_cases();
    permutation_invariance();
    launch_counts(argc > 1 ? argv[1] : "launch_counts.txt");
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
