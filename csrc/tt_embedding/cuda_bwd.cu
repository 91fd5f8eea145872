// TT embedding backward on the GPU: gradients of the cores and gates.
//
// Deterministic without float atomics (see cuda.cuh for the slots):
//   1. the indices are sorted and each distinct row (head slot) sums the
//      output gradient of its positions in ascending position order;
//   2. that row gradient goes back through the levels (dR_{k-1} from dR_k),
//      every head slot on its own;
//   3. core k's gradient X_k[a, i, j, b] = sum over the distinct rows u with
//      i_k(u) = i of sum_p R_{k-1}^u[p, a] dR_k^u[(p, j), b]: the head slots
//      are sorted (stably) by i_k, each slice i finds its run by binary
//      search, and one thread per core entry sums its run in order;
//   4. with C'_k = C_k * g_k: dC_k = X_k * g_k, dg_k[b] = sum X_k[.., b] C_k[.., b],
//      one thread per gate entry.
// Every sum has a fixed order, so the result is the same from run to run and
// does not depend on how the indices were ordered beyond rounding of step 1.
#include "tt_embedding/cuda.cuh"

namespace comera_cuda {
namespace emb {
namespace {

template <typename A> struct BwdBufs {
    Common<A> c;
    A *lvl[COMERA_MAX_CORES];  // R_k of every head slot, k < d - 1
    A *grad[2];                // dR_k, ping-pong
    A *x;                      // X_k of the current core
    A *bag_scale;              // per bag: 1 / count (mean) or 1
    int64_t *ckey, *cslot, *ckey2, *cslot2;  // head slots sorted by i_k
};

template <typename A>
BwdBufs<A> bwd_layout(const Shape &s, int64_t n, int64_t num_bags, Arena &w) {
    BwdBufs<A> f;
    f.c = common_layout<A>(s, n, w);
    for (int k = 0; k + 1 < s.d; k++) f.lvl[k] = w.take<A>(n * s.level[k]);
    f.grad[0] = w.take<A>(n * s.max_level);
    f.grad[1] = w.take<A>(n * s.max_level);
    int64_t core_max = 0;
    for (int k = 0; k < s.d; k++)
        if (s.core_off[k + 1] - s.core_off[k] > core_max) core_max = s.core_off[k + 1] - s.core_off[k];
    f.x = w.take<A>(core_max);
    f.bag_scale = w.take<A>(num_bags);
    f.ckey = w.take<int64_t>(n);
    f.cslot = w.take<int64_t>(n);
    f.ckey2 = w.take<int64_t>(n);
    f.cslot2 = w.take<int64_t>(n);
    return f;
}

// 1 / (non-padding entries) for mean bags, 1 otherwise (offsets clamped).
template <typename A>
__global__ void bag_scale_kernel(Shape s, int mode, const int64_t *indices, const int64_t *offsets,
                                 int64_t num_bags, int64_t n, A *scale) {
    COMERA_FOR_EACH(b, num_bags) {
        int64_t lo = offsets[b], hi = offsets[b + 1], count = 0;
        lo = lo < 0 ? 0 : lo > n ? n : lo;
        hi = hi < lo ? lo : hi > n ? n : hi;
        for (int64_t p = lo; p < hi; p++) count += key_of(s, indices[p]) < s.num_embeddings;
        scale[b] = (mode == COMERA_EMB_MEAN && count > 0) ? (A)1 / (A)count : (A)1;
    }
}

// dR_{d-1} of each head slot: the sum over the slots of its run (ascending
// positions, the sort is stable) of weight * grad_out[row of the position].
template <typename T, typename A>
__global__ void seed_kernel(Shape s, int mode, const T *grad_out, const int64_t *offsets,
                            int64_t num_bags, const T *psw, const A *bag_scale, const int64_t *key,
                            const int64_t *pos, const int64_t *head, int64_t n, A *dr) {
    const int64_t L = s.level[s.d - 1], D = s.embedding_dim;
    COMERA_FOR_EACH(q, n * L) {
        int64_t slot = q / L, c = q % L;
        if (head[slot] != slot || key[slot] >= s.num_embeddings) continue;
        A acc = 0;
        if (c < D) {
            for (int64_t u = slot; u < n && key[u] == key[slot]; u++) {
                int64_t p = pos[u], row = p;
                A w = psw ? to_acc<A>(psw[p]) : (A)1;
                if (mode != COMERA_EMB_PLAIN) {
                    row = upper_bound(offsets, 0, num_bags + 1, p) - 1;
                    if (row < 0 || row >= num_bags || p >= offsets[row + 1]) continue;
                    w *= bag_scale[row];
                }
                acc += w * to_acc<A>(grad_out[row * D + c]);
            }
        }
        dr[slot * L + c] = acc;
    }
}

// dR_{k-1}[slot][p, a] = sum_{j, b} dR_k[slot][(p, j), b] C'_k[a, i_k, j, b]
template <typename A>
__global__ void back_level_kernel(Shape s, int k, const int64_t *key, const int64_t *head,
                                  int64_t n, const A *cores, const A *dcur, A *dprev) {
    const int64_t L = s.level[k], Lp = s.level[k - 1], ek = s.e[k], rk = s.r[k], rk1 = s.r[k + 1];
    const A *C = cores + s.core_off[k];
    COMERA_FOR_EACH(q, n * Lp) {
        int64_t slot = q / Lp, x = q % Lp;
        if (head[slot] != slot || key[slot] >= s.num_embeddings) continue;
        int64_t ik = (key[slot] / s.vstride[k]) % s.v[k], a = x % rk, p = x / rk;
        const A *c = C + (a * s.v[k] + ik) * ek * rk1;  // C'_k[a, ik, :, :]
        const A *g = dcur + slot * L + p * ek * rk1;    // dR_k[(p, :), :]
        A acc = 0;
        for (int64_t jb = 0; jb < ek * rk1; jb++) acc += g[jb] * c[jb];
        dprev[slot * Lp + x] = acc;
    }
}

// Sort key of a slot for core k: i_k for head slots, v_k (last) otherwise.
__global__ void core_keys_kernel(Shape s, int k, const int64_t *key, const int64_t *head,
                                 int64_t n, int64_t *ckey, int64_t *cslot) {
    COMERA_FOR_EACH(u, n) {
        bool live = head[u] == u && key[u] < s.num_embeddings;
        ckey[u] = live ? (key[u] / s.vstride[k]) % s.v[k] : s.v[k];
        cslot[u] = u;
    }
}

// X_k and dC_k, one thread per core entry (a, i, j, b).
template <typename T, typename A>
__global__ void core_grad_kernel(Shape s, int k, const int64_t *ckey, const int64_t *cslot,
                                 int64_t n, const A *prev, const A *dcur, const T *gate, A *x,
                                 T *dcore) {
    const int64_t v = s.v[k], ek = s.e[k], rk = s.r[k], rk1 = s.r[k + 1];
    const int64_t L = s.level[k], Lp = k ? s.level[k - 1] : 0, P = k ? s.E[k - 1] : 1;
    COMERA_FOR_EACH(q, rk * v * ek * rk1) {
        int64_t b = q % rk1, j = (q / rk1) % ek, i = (q / (rk1 * ek)) % v, a = q / (rk1 * ek * v);
        int64_t lo = lower_bound(ckey, 0, n, i), hi = lower_bound(ckey, lo, n, i + 1);
        A acc = 0;
        for (int64_t u = lo; u < hi; u++) {
            int64_t slot = cslot[u];
            const A *g = dcur + slot * L + j * rk1 + b;
            if (k == 0) {
                acc += g[0];
            } else {
                const A *r = prev + slot * Lp + a;
                for (int64_t p = 0; p < P; p++) acc += r[p * rk] * g[p * ek * rk1];
            }
        }
        x[q] = acc;
        A gb = gate ? to_acc<A>(gate[b]) : (A)1;
        dcore[q] = from_acc<T, A>(acc * gb);
    }
}

// dg_k[b] = sum_{a, i, j} X_k[a, i, j, b] C_k[a, i, j, b]
template <typename T, typename A>
__global__ void gate_grad_kernel(const A *x, const T *core, int64_t rows, int64_t r2, T *dgate) {
    COMERA_FOR_EACH(b, r2) {
        A acc = 0;
        for (int64_t m = 0; m < rows; m++) acc += x[m * r2 + b] * to_acc<A>(core[m * r2 + b]);
        dgate[b] = from_acc<T, A>(acc);
    }
}

template <typename T> size_t bwd_bytes(const Shape &s, int64_t n, int64_t bags) {
    Arena w{nullptr, 0};
    bwd_layout<typename Acc<T>::type>(s, n, bags, w);
    return w.used + 256;
}

template <typename T>
int bwd(const Shape &s, const comera_tt_embedding_batch *b, const T *psw, const T *grad_out,
        const T *const *cores, const T *const *gates, T *const *dcores, T *const *dgates,
        void *ws, size_t ws_bytes, cudaStream_t st) {
    typedef typename Acc<T>::type A;
    const int64_t n = b->n, bags = b->mode == COMERA_EMB_PLAIN ? 0 : b->num_bags;
    if (ws_bytes < bwd_bytes<T>(s, n, bags) || !ws) return COMERA_ERR_WORKSPACE;
    Arena w = arena_for(ws);
    BwdBufs<A> f = bwd_layout<A>(s, n, bags, w);
    int rc = common_run<T, A>(s, f.c, n, b->indices, cores, gates, 1, st);
    if (rc) return rc;
    for (int k = 0; k + 1 < s.d; k++) {  // the forward levels, kept
        auto level = level_kernel<A>;
        COMERA_LAUNCH(level, n * s.level[k], st, s, k, f.c.key, f.c.head, n, f.c.cores,
                      k ? f.lvl[k - 1] : (const A *)nullptr, f.lvl[k]);
    }
    if (bags > 0) {
        auto scale = bag_scale_kernel<A>;
        COMERA_LAUNCH(scale, bags, st, s, b->mode, b->indices, b->offsets, bags, n, f.bag_scale);
    }
    auto seed = seed_kernel<T, A>;
    COMERA_LAUNCH(seed, n * s.level[s.d - 1], st, s, b->mode, grad_out, b->offsets, bags, psw,
                  f.bag_scale, f.c.key, f.c.pos, f.c.head, n, f.grad[(s.d - 1) % 2]);
    for (int k = s.d - 1; k >= 0; k--) {
        A *dcur = f.grad[k % 2];
        COMERA_LAUNCH(core_keys_kernel, n, st, s, k, f.c.key, f.c.head, n, f.ckey, f.cslot);
        rc = launched();
        if (rc) return rc;
        rc = sort_pairs(f.ckey, f.cslot, f.ckey2, f.cslot2, n, st);
        if (rc) return rc;
        const T *gate = k < s.d - 1 ? gates[k] : (const T *)nullptr;
        auto cg = core_grad_kernel<T, A>;
        int64_t size = s.core_off[k + 1] - s.core_off[k];
        COMERA_LAUNCH(cg, size, st, s, k, f.ckey, f.cslot, n, k ? f.lvl[k - 1] : (const A *)nullptr,
                      dcur, gate, f.x, dcores[k]);
        if (k < s.d - 1) {
            auto gg = gate_grad_kernel<T, A>;
            COMERA_LAUNCH(gg, s.r[k + 1], st, f.x, cores[k], size / s.r[k + 1], s.r[k + 1],
                          dgates[k]);
        }
        if (k > 0) {
            auto back = back_level_kernel<A>;
            COMERA_LAUNCH(back, n * s.level[k - 1], st, s, k, f.c.key, f.c.head, n, f.c.cores,
                          dcur, f.grad[(k - 1) % 2]);
        }
        rc = launched();
        if (rc) return rc;
    }
    return launched();
}

}  // namespace

size_t bwd_workspace(const Shape &s, int64_t n, int64_t num_bags, int dtype) {
    switch (dtype) {
        case COMERA_DT_F64: return bwd_bytes<double>(s, n, num_bags);
        default: return bwd_bytes<float>(s, n, num_bags);  // float accumulators for the others
    }
}

}  // namespace emb
}  // namespace comera_cuda

using namespace comera_cuda;

extern "C" int comera_tt_embedding_bwd_cuda(const comera_tt_embedding_prep *p,
                                            const comera_tt_embedding_batch *b, int dtype,
                                            const void *psw, const void *grad_out,
                                            const void *const *cores, const void *const *gates,
                                            void *const *dcores, void *const *dgates,
                                            void *workspace, size_t workspace_bytes,
                                            cudaStream_t stream) {
    // every reuse strategy gives the same gradient; the backward always
    // sorts, because that is what makes its sums deterministic
    emb::Shape s;
    int rc = emb::check_args(p, b, dtype, &s);
    if (rc) return rc;
    int64_t rows = b->mode == COMERA_EMB_PLAIN ? b->n : b->num_bags;
    if (!cores || !gates || !dcores || !dgates || (rows > 0 && b->n > 0 && !grad_out))
        return COMERA_ERR_ARG;
    if (b->mode == COMERA_EMB_PLAIN) psw = nullptr;
#define COMERA_EMB_BWD(T)                                                                       \
    emb::bwd<T>(s, b, (const T *)psw, (const T *)grad_out, (const T *const *)cores,             \
                (const T *const *)gates, (T *const *)dcores, (T *const *)dgates, workspace,     \
                workspace_bytes, stream)
    switch (dtype) {
        case COMERA_DT_F32: return COMERA_EMB_BWD(float);
        case COMERA_DT_F64: return COMERA_EMB_BWD(double);
        case COMERA_DT_BF16: return COMERA_EMB_BWD(__nv_bfloat16);
        default: return COMERA_EMB_BWD(__half);
    }
#undef COMERA_EMB_BWD
}
