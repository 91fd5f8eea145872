// TT embedding backward on the GPU: gradients of the cores and gates.
//
// Deterministic without float atomics (see cuda.cuh for the slots):
//   1. the indices are sorted and each distinct row (head slot) sums the
//      output gradient of its positions in ascending position order, in two
//      passes: the sorted slots are cut into aligned chunks, each piece of a
//      run inside one chunk is summed on its own, then each head adds its
//      run's pieces in order;
//   2. that row gradient goes back through the levels (dR_{k-1} from dR_k),
//      every head slot on its own;
//   3. core k's gradient X_k[a, i, j, b] = sum over the distinct rows u with
//      i_k(u) = i of sum_p R_{k-1}^u[p, a] dR_k^u[(p, j), b]: the head slots
//      are sorted (stably) by i_k and each slice i's run is found once; the
//      run's terms are split into a fixed number of chunks per core entry,
//      summed apart, then the chunk sums are added in order;
//   4. with C'_k = C_k * g_k: dC_k = X_k * g_k, dg_k[b] = sum X_k[.., b] C_k[.., b],
//      over chunks of rows, then the chunk sums in order.
// Every sum has a fixed order (set by the sorted slots and the shape), so the
// result is the same from run to run and does not depend on how the indices
// were ordered beyond rounding of step 1.  Every buffer is sized by n and the
// shape, never by the data, so the launches stay capturable in a CUDA graph.
#include "tt_embedding/cuda.cuh"

namespace comera_cuda {
namespace emb {
namespace {

// Partial sums per entry of core k's gradient: enough for a slice holding all
// n slots, at most kMaxSplits, and at most kMaxPartial for the whole core.  A
// real slice holds far fewer slots, and its terms are shared out among all
// the chunks, so a thread's share is its slice's terms / splits.
const int64_t kMaxSplits = 64;
const int64_t kMaxPartial = (int64_t)1 << 20;  // 4 MB in float32

inline int64_t core_splits(const Shape &s, int k, int64_t n) {
    int64_t size = s.core_off[k + 1] - s.core_off[k], P = k ? s.E[k - 1] : 1;
    int64_t S = split_count(n * P);
    if (S > kMaxSplits) S = kMaxSplits;
    if (S * size > kMaxPartial) S = kMaxPartial / size > 1 ? kMaxPartial / size : 1;
    return S;
}

template <typename A> struct BwdBufs {
    Common<A> c;
    A *lvl[COMERA_MAX_CORES];  // R_k of every head slot, k < d - 1
    A *grad[2];                // dR_k, ping-pong; the seed's pieces use the free one
    A *x;                      // X_k of the current core
    A *part;                   // core_splits partial sums per entry of X_k
    A *gpart;                  // the gate gradient's chunk sums
    A *bag_scale;              // per bag: 1 / count (mean) or 1
    int64_t *bag_of;           // per position: its bag, or -1 (bag modes)
    int64_t *ckey, *cslot, *ckey2, *cslot2;  // head slots sorted by i_k
    int64_t *bounds;           // first sorted slot of each slice i_k, and the end
};

template <typename A>
BwdBufs<A> bwd_layout(const Shape &s, int64_t n, int64_t num_bags, Arena &w) {
    BwdBufs<A> f;
    f.c = common_layout<A>(s, n, w);
    for (int k = 0; k + 1 < s.d; k++) f.lvl[k] = w.take<A>(n * s.level[k]);
    f.grad[0] = w.take<A>(n * s.max_level);
    f.grad[1] = w.take<A>(n * s.max_level);
    int64_t core_max = 0, part_max = 0, gpart_max = 0, v_max = 0;
    for (int k = 0; k < s.d; k++) {
        int64_t size = s.core_off[k + 1] - s.core_off[k], r2 = s.r[k + 1];
        int64_t part = size * core_splits(s, k, n), gpart = split_count(size / r2) * r2;
        if (size > core_max) core_max = size;
        if (part > part_max) part_max = part;
        if (gpart > gpart_max) gpart_max = gpart;
        if (s.v[k] > v_max) v_max = s.v[k];
    }
    f.x = w.take<A>(core_max);
    f.part = w.take<A>(part_max);
    f.gpart = w.take<A>(gpart_max);
    f.bag_scale = w.take<A>(num_bags);
    w.take_each<int64_t>(n, {&f.bag_of, &f.ckey, &f.cslot, &f.ckey2, &f.cslot2});
    f.bounds = w.take<int64_t>(v_max + 1);
    return f;
}

// Per bag: 1 / (non-padding entries) for mean bags, 1 otherwise (offsets
// clamped).  Per position p (items num_bags + p): its bag, or -1 when it is
// in none, found once here rather than by every seed term and column.
template <typename A>
__global__ void bags_kernel(Shape s, int mode, const int64_t *indices, const int64_t *offsets,
                            int64_t num_bags, int64_t n, A *scale, int64_t *bag_of) {
    COMERA_FOR_EACH(item, num_bags + n) {
        if (item >= num_bags) {
            int64_t p = item - num_bags, row = upper_bound(offsets, 0, num_bags + 1, p) - 1;
            bag_of[p] = row >= 0 && row < num_bags && p < offsets[row + 1] ? row : -1;
            continue;
        }
        int64_t lo = offsets[item], hi = offsets[item + 1], count = 0;
        lo = lo < 0 ? 0 : lo > n ? n : lo;
        hi = hi < lo ? lo : hi > n ? n : hi;
        for (int64_t p = lo; p < hi; p++) count += key_of(s, indices[p]) < s.num_embeddings;
        scale[item] = (mode == COMERA_EMB_MEAN && count > 0) ? (A)1 / (A)count : (A)1;
    }
}

// What the two seed passes read and write.  dR_{d-1} of a head slot is the
// sum over its run's slots t of seed_term(t), in slot order (ascending
// positions: the sort is stable).
template <typename T, typename A> struct SeedArgs {
    const T *grad_out, *psw;
    const A *bag_scale;
    const int64_t *bag_of, *key, *pos, *head;
    A *part, *dr;  // part: one sum per piece, at the piece's first slot (n x L)
    int64_t n, L, D, num, chunk;  // slots, dR_{d-1} entries, columns, num_embeddings, chunk
    int mode;
};

// weight * grad_out[row of slot t's position][c]; 0 for a position in no bag.
template <typename T, typename A>
__host__ __device__ __forceinline__ A seed_term(const SeedArgs<T, A> &a, int64_t t, int64_t c) {
    int64_t p = a.pos[t], row = p;
    A w = a.psw ? to_acc<A>(a.psw[p]) : (A)1;
    if (a.mode != COMERA_EMB_PLAIN) {
        row = a.bag_of[p];
        if (row < 0) return (A)0;
        w *= a.bag_scale[row];
    }
    return w * to_acc<A>(a.grad_out[row * a.D + c]);
}

// Pass 1: the slots are cut into aligned chunks of a.chunk; each piece of a
// run inside one chunk (starting at its head or at a chunk start) sums its
// terms.  The most frequent row has hundreds of duplicates: one thread over
// the whole run took 278 us on an H200.
template <typename T, typename A> __global__ void seed_part_kernel(SeedArgs<T, A> a) {
    COMERA_FOR_EACH(q, a.n * a.D) {
        int64_t u = div_small(q, a.D), c = q - u * a.D;
        int64_t cend = (div_small(u, a.chunk) + 1) * a.chunk;  // the chunk's end
        if (a.key[u] >= a.num || (a.head[u] != u && cend - u != a.chunk)) continue;
        int64_t end = upper_bound(a.key, u, cend < a.n ? cend : a.n, a.key[u]);
        A s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // four sums in flight, as in dot
        int64_t t = u;
        for (; t + 4 <= end; t += 4) {
            s0 += seed_term(a, t, c);
            s1 += seed_term(a, t + 1, c);
            s2 += seed_term(a, t + 2, c);
            s3 += seed_term(a, t + 3, c);
        }
        for (; t < end; t++) s0 += seed_term(a, t, c);
        a.part[u * a.L + c] = (s0 + s1) + (s2 + s3);
    }
}

// Pass 2: dR_{d-1} of each head slot = its own piece + the pieces at the
// chunk starts inside its run, in order; 0 in the padded columns.
template <typename T, typename A> __global__ void seed_sum_kernel(SeedArgs<T, A> a) {
    COMERA_FOR_EACH(q, a.n * a.L) {
        int64_t h = div_small(q, a.L), c = q - h * a.L;
        if (a.head[h] != h || a.key[h] >= a.num) continue;
        A acc = 0;
        if (c < a.D) {
            int64_t end = upper_bound(a.key, h, a.n, a.key[h]);
            int64_t g = (div_small(h, a.chunk) + 1) * a.chunk;  // the first chunk start past h
            int64_t pieces = g < end ? (end - 1 - g) / a.chunk + 1 : 0;
            acc = a.part[h * a.L + c];
            if (pieces) acc += sum_strided(a.part + g * a.L + c, a.chunk * a.L, pieces);
        }
        a.dr[h * a.L + c] = acc;
    }
}

// dR_{k-1}[slot][p, a] = sum_{j, b} dR_k[slot][(p, j), b] C'_k[a, i_k, j, b]
// (32-bit divisions and four sums in flight: up to n x 1024 threads)
template <typename A>
__global__ void back_level_kernel(Shape s, int k, const int64_t *key, const int64_t *head,
                                  int64_t n, const A *cores, const A *dcur, A *dprev) {
    const int64_t L = s.level[k], Lp = s.level[k - 1], ek = s.e[k], rk = s.r[k], rk1 = s.r[k + 1];
    const A *C = cores + s.core_off[k];
    COMERA_FOR_EACH(q, n * Lp) {
        int64_t slot = div_small(q, Lp), x = q - slot * Lp;
        if (head[slot] != slot || key[slot] >= s.num_embeddings) continue;
        int64_t prefix = div_small(key[slot], s.vstride[k]);  // (i_0, ..., i_k)
        int64_t ik = prefix - div_small(prefix, s.v[k]) * s.v[k];
        int64_t p = div_small(x, rk), a = x - p * rk;
        const A *c = C + (a * s.v[k] + ik) * ek * rk1;  // C'_k[a, ik, :, :]
        const A *g = dcur + slot * L + p * ek * rk1;    // dR_k[(p, :), :]
        dprev[slot * Lp + x] = dot(g, (int64_t)1, c, (int64_t)1, ek * rk1);
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

// bounds[i] = the first sorted slot of slice i (bounds[v] = the live slots),
// once per core instead of two binary searches in every partial-sum thread.
__global__ void slice_bounds_kernel(const int64_t *ckey, int64_t n, int64_t v, int64_t *bounds) {
    COMERA_FOR_EACH(i, v + 1) bounds[i] = lower_bound(ckey, 0, n, i);
}

// Pass 1 of X_k: the terms of entry q = (a, i, j, b) are numbered t = (u -
// lo) P + p over its slice's sorted slots u in [lo, hi) and p < P; split
// `split` of nsplit sums a run of ceil(terms / nsplit) of them.  One thread
// per entry over the whole slice took up to 344 us a launch on an H200.
template <typename A>
__global__ void core_part_kernel(Shape s, int k, const int64_t *bounds, const int64_t *cslot,
                                 int64_t nsplit, const A *prev, const A *dcur, A *part) {
    const int64_t v = s.v[k], ek = s.e[k], rk = s.r[k], rk1 = s.r[k + 1], size = rk * v * ek * rk1;
    const int64_t L = s.level[k], Lp = k ? s.level[k - 1] : 0, P = k ? s.E[k - 1] : 1;
    COMERA_FOR_EACH(item, size * nsplit) {
        int64_t split = div_small(item, size), q = item - split * size;
        int64_t qb = div_small(q, rk1), qj = div_small(qb, ek), a = div_small(qj, v);
        int64_t b = q - qb * rk1, j = qb - qj * ek, i = qj - a * v;
        int64_t lo = bounds[i], terms = (bounds[i + 1] - lo) * P;
        int64_t chunk = div_small(terms + nsplit - 1, nsplit), t = split * chunk;
        int64_t t1 = t + chunk < terms ? t + chunk : terms;
        A acc = 0;
        while (t < t1) {  // one slot's stretch of p at a time
            int64_t u = div_small(t, P), p = t - u * P, m = P - p < t1 - t ? P - p : t1 - t;
            int64_t slot = cslot[lo + u];
            const A *g = dcur + slot * L + (p * ek + j) * rk1 + b;  // dR_k[(p, j), b]
            acc += k ? dot(prev + slot * Lp + p * rk + a, rk, g, ek * rk1, m) : g[0];
            t += m;
        }
        part[item] = acc;
    }
}

// Pass 2: X_k = the partial sums added in order; dC_k = X_k * g_k.
template <typename T, typename A>
__global__ void core_sum_kernel(const A *part, int64_t size, int64_t nsplit, const T *gate,
                                int64_t r2, A *x, T *dcore) {
    COMERA_FOR_EACH(q, size) {
        A acc = sum_strided(part + q, size, nsplit);
        x[q] = acc;
        A gb = gate ? to_acc<A>(gate[q % r2]) : (A)1;
        dcore[q] = from_acc<T, A>(acc * gb);
    }
}

// dg_k[b] = sum_{a, i, j} X_k[a, i, j, b] C_k[a, i, j, b] in two passes: item
// (c, b) sums the rows of chunk c, then gate_sum_kernel adds the chunks in
// order.  One thread per b over all rows took 495 us on an H200.
template <typename T, typename A>
__global__ void gate_part_kernel(const A *x, const T *core, int64_t rows, int64_t r2,
                                 int64_t chunk, int64_t chunks, A *part) {
    COMERA_FOR_EACH(item, chunks * r2) {
        int64_t c = item / r2, b = item % r2, m = c * chunk;
        int64_t m1 = m + chunk < rows ? m + chunk : rows;
        part[item] = dot(x + m * r2 + b, r2, core + m * r2 + b, r2, m1 - m);
    }
}

template <typename T, typename A>
__global__ void gate_sum_kernel(const A *part, int64_t chunks, int64_t r2, T *dgate) {
    COMERA_FOR_EACH(b, r2) dgate[b] = from_acc<T, A>(sum_strided(part + b, r2, chunks));
}

template <typename T> size_t bwd_bytes(const Shape &s, int64_t n, int64_t bags) {
    Arena w{nullptr, 0};
    bwd_layout<typename Acc<T>::type>(s, n, bags, w);
    return w.used + 256;
}

// dR_{d-1} of every head slot (into f.grad[(d - 1) % 2]), in two passes.
template <typename T, typename A>
int seed_run(const Shape &s, const comera_tt_embedding_batch *b, int64_t bags, const T *psw,
             const T *grad_out, const BwdBufs<A> &f, cudaStream_t st) {
    const int64_t n = b->n;
    if (b->mode != COMERA_EMB_PLAIN) {
        auto k = bags_kernel<A>;
        COMERA_LAUNCH(k, bags + n, st, s, b->mode, b->indices, b->offsets, bags, n, f.bag_scale,
                      f.bag_of);
    }
    SeedArgs<T, A> a;
    a.grad_out = grad_out;
    a.psw = psw;
    a.bag_scale = f.bag_scale;
    a.bag_of = f.bag_of;
    a.key = f.c.key;
    a.pos = f.c.pos;
    a.head = f.c.head;
    a.part = f.grad[s.d % 2];  // free until the first back level
    a.dr = f.grad[(s.d - 1) % 2];
    a.n = n;
    a.L = s.level[s.d - 1];
    a.D = s.embedding_dim;
    a.num = s.num_embeddings;
    a.chunk = split_chunk(n);
    a.mode = b->mode;
    auto part = seed_part_kernel<T, A>;
    COMERA_LAUNCH(part, n * a.D, st, a);
    auto sum = seed_sum_kernel<T, A>;
    COMERA_LAUNCH(sum, n * a.L, st, a);
    return launched();
}

// dC_k and dg_k from dR_k (f.grad[k % 2]) and R_{k-1}.
template <typename T, typename A>
int core_run(const Shape &s, int k, int64_t n, const T *core, const T *gate, T *dcore, T *dgate,
             BwdBufs<A> &f, cudaStream_t st) {
    COMERA_LAUNCH(core_keys_kernel, n, st, s, k, f.c.key, f.c.head, n, f.ckey, f.cslot);
    int rc = launched();
    if (rc) return rc;
    rc = sort_pairs(f.ckey, f.cslot, f.ckey2, f.cslot2, n, st);
    if (rc) return rc;
    COMERA_LAUNCH(slice_bounds_kernel, s.v[k] + 1, st, f.ckey, n, s.v[k], f.bounds);
    int64_t size = s.core_off[k + 1] - s.core_off[k], r2 = s.r[k + 1];
    int64_t nsplit = core_splits(s, k, n);
    auto part = core_part_kernel<A>;
    COMERA_LAUNCH(part, size * nsplit, st, s, k, f.bounds, f.cslot, nsplit,
                  k ? f.lvl[k - 1] : (const A *)nullptr, f.grad[k % 2], f.part);
    auto sum = core_sum_kernel<T, A>;
    COMERA_LAUNCH(sum, size, st, f.part, size, nsplit, gate, r2, f.x, dcore);
    if (gate) {
        int64_t rows = size / r2, chunks = split_count(rows);
        auto gp = gate_part_kernel<T, A>;
        COMERA_LAUNCH(gp, chunks * r2, st, f.x, core, rows, r2, split_chunk(rows), chunks,
                      f.gpart);
        auto gs = gate_sum_kernel<T, A>;
        COMERA_LAUNCH(gs, r2, st, f.gpart, chunks, r2, dgate);
    }
    return launched();
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
    rc = seed_run<T, A>(s, b, bags, psw, grad_out, f, st);
    if (rc) return rc;
    for (int k = s.d - 1; k >= 0; k--) {
        bool gated = k < s.d - 1;
        rc = core_run<T, A>(s, k, n, cores[k], gated ? gates[k] : (const T *)nullptr, dcores[k],
                            gated ? dgates[k] : (T *)nullptr, f, st);
        if (rc) return rc;
        if (k > 0) {
            auto back = back_level_kernel<A>;
            COMERA_LAUNCH(back, n * s.level[k - 1], st, s, k, f.c.key, f.c.head, n, f.c.cores,
                          f.grad[k % 2], f.grad[(k - 1) % 2]);
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
