// The device side of the TT linear layer on the GPU (cuda.cu holds the
// host side): strided views, the small products, the gated-core, pack,
// gradient and split-sum kernels, and the split sizes they share.  Every
// kernel: one thread per output element, no shared memory, no atomics, sums
// in a fixed order (see common/cuda_common.cuh).
#ifndef COMERA_CUDA_TT_LINEAR_CUH
#define COMERA_CUDA_TT_LINEAR_CUH

#include "comera/tt_linear.h"
#include "common/cuda_common.cuh"

namespace comera_cuda {
namespace {

typedef comera_tt_linear_shape tt_shape;

// A strided matrix view on an accumulator-type buffer: element (i, j) at
// base[i * rs + j * cs].  The gated cores are materialised once per call
// (eff_kernel), so every operand of the small products is such a view.
template <typename A> struct Mat {
    const A *base;
    int64_t rs, cs;
};

template <typename A> Mat<A> mat(const A *base, int64_t rs, int64_t cs) {
    Mat<A> m;
    m.base = base;
    m.rs = rs;
    m.cs = cs;
    return m;
}

template <typename A> __host__ __device__ __forceinline__ A mat_at(const Mat<A> &m, int64_t i,
                                                                   int64_t j) {
    return m.base[i * m.rs + j * m.cs];
}

// The segment holding item, given the segments' prefix sums (start[0] = 0,
// item < start[n]): the kernels below run several small jobs in one launch.
__host__ __device__ __forceinline__ int segment_of(int64_t item, const int64_t *start) {
    int k = 0;
    while (item >= start[k + 1]) k++;
    return k;
}

// Item by item over the entries of D cores (off: their offsets, core_off)
// and then `tail` more items: entry(k, o, item) for entry o of core k (at
// `item` among all the cores' entries), tail_item(i) for tail item i.  The
// kernels that sweep every core do a small job of their own in the same
// launch: one launch fewer.
template <typename Entry, typename Tail>
__device__ __forceinline__ void for_core_entries(const int64_t *off, int D, int64_t tail,
                                                 Entry entry, Tail tail_item) {
    int64_t total = off[D];
    COMERA_FOR_EACH(item, total + tail) {
        if (item >= total) {
            tail_item(item - total);
            continue;
        }
        int k = segment_of(item, off);
        entry(k, item - off[k], item);
    }
}

// C (M x N, row-major) = A (M x K) B (K x N) over a slice of K: split s of
// nsplit sums k in [s kchunk, (s + 1) kchunk) into c + s M N.  Splitting K
// gives the long reductions (core gradients sum over up to thousands of
// merged rows) enough threads; the splits are added in a fixed order later.
// i32: every index fits in an int (see fits_int), the usual case.
template <typename A> struct SmallGemm {
    Mat<A> a, b;
    A *c;
    int64_t M, N, K, kchunk, nsplit;
    int i32;
};

const int kMaxGemms = 4;
template <typename A> struct SmallGemmBatch {
    SmallGemm<A> g[kMaxGemms];
    int64_t start[kMaxGemms + 1];  // prefix sums of M N nsplit
    int count;
};

// Entry `local` of g's output (split s, row i, column j at s M N + i N + j),
// in index type I: int where every index fits, as 32-bit divisions and
// address arithmetic are several times cheaper on a GPU, else int64_t.
template <typename A, typename I>
__host__ __device__ __forceinline__ void small_gemm_item(const SmallGemm<A> &g, I local) {
    I mn = (I)(g.M * g.N), split = local / mn, ij = local - split * mn;
    I i = ij / (I)g.N, j = ij - i * (I)g.N;
    I k0 = split * (I)g.kchunk, n = (I)g.K - k0 < (I)g.kchunk ? (I)g.K - k0 : (I)g.kchunk;
    const A *a = g.a.base + (i * (I)g.a.rs + k0 * (I)g.a.cs);
    const A *b = g.b.base + (k0 * (I)g.b.rs + j * (I)g.b.cs);
    g.c[local] = dot<A, A, I>(a, (I)g.a.cs, b, (I)g.b.rs, n);
}

template <typename A> __global__ void small_gemm_kernel(SmallGemmBatch<A> b) {
    COMERA_FOR_EACH(item, b.start[b.count]) {
        int q = segment_of(item, b.start);
        const SmallGemm<A> &g = b.g[q];
        int64_t local = item - b.start[q];
        if (g.i32)
            small_gemm_item<A, int>(g, (int)local);
        else
            small_gemm_item<A, int64_t>(g, local);
    }
}

// eff_k = core_k scaled by gate_k (the last core has none) in the
// accumulator type, for every core, once per call: the small products then
// read plain arrays instead of converting, taking a remainder for the gate
// index and loading the gate at every term.  With eff_t, also each eff_k
// transposed ((dims[k] r[k+1]) x r[k]), for the dP chain product, whose
// threads then read eff_k coalesced.  Also zeroes n_zero entries at `zero`
// (the backward's dP: one launch fewer than a memset).
template <typename T> struct EffArgs {
    const T *core[COMERA_MAX_CORES];
    const T *gate[COMERA_MAX_CORES];
    int64_t off[COMERA_MAX_CORES + 1];  // core_off
    int64_t rows[COMERA_MAX_CORES], cols[COMERA_MAX_CORES];  // r[k], dims[k] r[k + 1]
    int64_t rank[COMERA_MAX_CORES];  // r[k + 1], the gate's size
    typename Acc<T>::type *eff, *eff_t, *zero;
    int64_t n_zero;
    int D;
};

template <typename T> __global__ void eff_kernel(EffArgs<T> a) {
    typedef typename Acc<T>::type A;
    auto zero = [&](int64_t i) { a.zero[i] = 0; };
    auto entry = [&](int k, int64_t o, int64_t item) {
        A v = to_acc<A>(a.core[k][o]);
        if (a.gate[k]) v *= to_acc<A>(a.gate[k][mod_small(o, a.rank[k])]);
        a.eff[item] = v;
        if (a.eff_t) {
            int64_t i = o / a.cols[k];
            a.eff_t[a.off[k] + (o - i * a.cols[k]) * a.rows[k] + i] = v;
        }
    };
    for_core_entries(a.off, a.D, a.n_zero, entry, zero);
}

// Writes the element-type operands of the four big GEMMs, the rank padded
// with zeros (cuda.cu: rp from rm, rk from rm and the bias): vc (in x rp)
// from V, uc (n_u / out rows of out) from U [with the bias as row rm], and
// te (batch x rk): with t_src, a copy of t, else zeros; with ones, a ones
// column at rm.
template <typename T> struct PackArgs {
    Mat<typename Acc<T>::type> v, u;
    T *vc, *uc, *te;
    const T *bias, *t_src;
    int64_t in, out, rm, rp, rk, batch;
    int ones;
    int64_t n_v, n_u, n_te;  // items per part
};

template <typename T> __global__ void pack_kernel(PackArgs<T> a) {
    typedef typename Acc<T>::type A;
    const T zero = from_acc<T, A>((A)0);
    COMERA_FOR_EACH(item, a.n_v + a.n_u + a.n_te) {
        if (item < a.n_v) {
            int64_t i = item / a.rp, c = item % a.rp;
            a.vc[item] = c < a.rm ? from_acc<T, A>(mat_at(a.v, i, c)) : zero;
        } else if (item < a.n_v + a.n_u) {
            int64_t o = item - a.n_v, c = o / a.out, j = o % a.out;
            a.uc[o] = c < a.rm ? from_acc<T, A>(mat_at(a.u, c, j))
                               : (c == a.rm && a.bias ? a.bias[j] : zero);
        } else {
            int64_t o = item - a.n_v - a.n_u, r = o / a.rk, c = o % a.rk;
            if (c < a.rm)
                a.te[o] = a.t_src ? a.t_src[r * a.rm + c] : zero;
            else
                a.te[o] = c == a.rm && a.ones ? from_acc<T, A>((A)1) : zero;
        }
    }
}

// d(core) = d(eff) * gate from the split partial sums of d(eff); also keeps
// the summed d(eff) for the gate gradients, and converts the bias gradient.
template <typename T> struct CoreGradArgs {
    const typename Acc<T>::type *src[COMERA_MAX_CORES];
    int64_t nsplit[COMERA_MAX_CORES];
    int64_t off[COMERA_MAX_CORES + 1];
    const T *gate[COMERA_MAX_CORES];
    int64_t gmod[COMERA_MAX_CORES];
    T *dcore[COMERA_MAX_CORES];
    typename Acc<T>::type *deff;
    const typename Acc<T>::type *dbias_src;
    T *dbias;
    int64_t n_bias;
    int D;
};

template <typename T> __global__ void core_grad_kernel(CoreGradArgs<T> a) {
    typedef typename Acc<T>::type A;
    auto bias = [&](int64_t i) { a.dbias[i] = from_acc<T, A>(a.dbias_src[i]); };
    auto entry = [&](int k, int64_t o, int64_t item) {
        A s = sum_strided(a.src[k] + o, a.off[k + 1] - a.off[k], a.nsplit[k]);
        a.deff[item] = s;
        a.dcore[k][o] =
            from_acc<T, A>(a.gate[k] ? s * to_acc<A>(a.gate[k][mod_small(o, a.gmod[k])]) : s);
    };
    for_core_entries(a.off, a.D, a.n_bias, entry, bias);
}

// d(gate k)[j] = sum_i d(eff k)[i, j] core_k[i, j], in two passes: partial
// sums over chunks of kGateChunk rows (one thread each), then their sum in a
// fixed order.  One thread per entry over all rows had a few dozen threads
// run hundreds of steps each (46 us of a 466 us step on an H200).
const int64_t kGateChunk = 16;

template <typename T> struct GateGradArgs {
    const typename Acc<T>::type *deff;
    typename Acc<T>::type *part;
    int64_t off[COMERA_MAX_CORES + 1];
    int64_t start[COMERA_MAX_CORES];  // prefix sums of the gate sizes
    int64_t pstart[COMERA_MAX_CORES];  // prefix sums of gate size x chunks
    int64_t cols[COMERA_MAX_CORES];
    int64_t chunks[COMERA_MAX_CORES];
    const T *core[COMERA_MAX_CORES];
    T *dgate[COMERA_MAX_CORES];
    int G;
};

template <typename T> __global__ void gate_part_kernel(GateGradArgs<T> a) {
    typedef typename Acc<T>::type A;
    COMERA_FOR_EACH(item, a.pstart[a.G]) {
        int k = segment_of(item, a.pstart);
        int64_t cols = a.cols[k], c = (item - a.pstart[k]) / cols, j = (item - a.pstart[k]) % cols;
        int64_t rows = (a.off[k + 1] - a.off[k]) / cols;
        int64_t i1 = (c + 1) * kGateChunk < rows ? (c + 1) * kGateChunk : rows;
        const A *de = a.deff + a.off[k];
        A s = 0;
        for (int64_t i = c * kGateChunk; i < i1; i++)
            s += de[i * cols + j] * to_acc<A>(a.core[k][i * cols + j]);
        a.part[item] = s;
    }
}

template <typename T> __global__ void gate_sum_kernel(GateGradArgs<T> a) {
    typedef typename Acc<T>::type A;
    COMERA_FOR_EACH(item, a.start[a.G]) {
        int k = segment_of(item, a.start);
        const A *p = a.part + a.pstart[k] + (item - a.start[k]);
        a.dgate[k][item - a.start[k]] = from_acc<T, A>(sum_strided(p, a.cols[k], a.chunks[k]));
    }
}

// c[i] = sum over s of part[s * n + i] (in a fixed order): the split-K
// partial sums of up to two products (one per chain) added up.
template <typename A> struct SplitSum {
    const A *part[2];
    A *c[2];
    int64_t n[2], nsplit[2], start[3];
    int count;
};

template <typename A> __global__ void split_sum_kernel(SplitSum<A> a) {
    COMERA_FOR_EACH(item, a.start[a.count]) {
        int q = segment_of(item, a.start);
        int64_t i = item - a.start[q];
        a.c[q][i] = sum_strided(a.part[q] + i, a.n[q], a.nsplit[q]);
    }
}

// d(eff_k) = P_{k-1}^T dP_k sums over the rows of P_{k-1}
inline int64_t deff_splits(const comera_tt_linear_shape &s, int k) {
    return split_count((s.P_off[k] - s.P_off[k - 1]) / s.r[k]);
}

// dP_{k-1} = dP_k eff_k^T sums over dims[k] r[k+1] terms (one thread per
// output over the whole sum took 53 us a launch on an H200)
inline int64_t chain_splits(const comera_tt_linear_shape &s, int k) {
    return split_count(s.dims[k] * s.r[k + 1]);
}

inline int64_t gate_chunks(const comera_tt_linear_shape &s, int k) {
    int64_t cols = s.r[k + 1], rows = (s.core_off[k + 1] - s.core_off[k]) / cols;
    return (rows + kGateChunk - 1) / kGateChunk;
}

}  // namespace
}  // namespace comera_cuda
#endif
