// TT linear layer on the GPU: the merge path (docs/design.md section 2).
//
//   forward   V = merge(input cores), U = merge(output cores)   small kernels
//             T = x V          cuBLAS      y = [T 1] [U; b]      cuBLAS
//   backward  S = dy U^T, dx = S V^T, [dU; db] = [T 1]^T dy,
//             dV = x^T S       cuBLAS (bfloat16/float16 in, float32 out)
//             then back through the merges and the gates         small kernels
//
// The bias rides along as one more rank: a ones column appended to T and the
// bias appended to U as a row, so y = T U + b is one GEMM and the bias
// gradient (the column sums of dy) falls out of the dU GEMM as its last row,
// with no extra pass over y or dy.
//
// The rank the four large GEMMs share is padded with zeros to a multiple of
// 32 bytes (16 elements of bfloat16/float16, 8 of float32): an odd K or
// leading dimension such as 31 rules out cuBLAS's aligned tensor-core
// kernels.  rp pads rm (the columns of V and S), rk pads rm plus the bias
// rank (the columns of [T 1], the rows of [U; b]).  The padding stays inside
// the op: t keeps rm columns (one strided copy out of the padded T), and dV is
// compacted from its padded product the same way.
//
// Merges and their gradients run in the accumulator type (float32 for the
// 16-bit types) from the gated cores, converted once per call (eff_kernel);
// only V and U are rounded to the element type, for the tensor-core GEMMs.
//
// Paths: on the GPU every path runs this algorithm.  The sequential path of
// the C kernels contracts each row core by core; on a GPU that is a chain of
// batched small products which cuBLAS runs far below peak, and it has more
// batch flops than merge whenever the ranks exceed about two, while for
// tiny batches both paths are bound by launch latency and merge launches
// fewer kernels.  So the planner's GPU answer is always merge; the `path`
// argument is validated and otherwise ignored here.
//
// Nothing here allocates or synchronises: workspace comes from the caller
// (the torch caching allocator), cuBLAS runs on the caller's handle and
// stream, so forward and backward can be captured in a CUDA graph.
// The shape comes prepared by comera_tt_linear_prepare (plan.c).
#include "tt_linear/cuda_kernels.cuh"

namespace comera_cuda {
namespace {

// ------------------------------------------------------------------ layout
// The rank rm and its two paddings (see the top of the file): rp, rm rounded
// up to 32 bytes of T; rk, rm plus the bias rank rounded up the same way.
struct Ranks {
    int64_t rm, rp, rk;
};
template <typename T> Ranks ranks_of(const tt_shape &s, bool hb) {
    const int64_t step = 32 / (int64_t)sizeof(T), rm = s.rmid;
    return Ranks{rm, (rm + step - 1) / step * step, (rm + (hb ? 1 : 0) + step - 1) / step * step};
}

// The two merge chains: cores [0, p) make V, cores [p, D) make U.
inline int chain_first(const comera_tt_linear_shape &s, int chain) {
    return chain == 0 ? 0 : s.p;
}
inline int chain_last(const comera_tt_linear_shape &s, int chain) {
    return chain == 0 ? s.p - 1 : s.D - 1;
}

// The layer's operands as accumulator-type views: the gated cores from the
// eff buffer (eff_kernel; eff_t holds them transposed, backward only) and
// the merge buffer P.
template <typename A> struct Layer {
    const tt_shape &s;
    const A *eff_buf, *eff_t;

    // eff_k as (rows x r[k+1]) with the given strides
    Mat<A> eff(int k, int64_t rs, int64_t cs) const {
        return mat(eff_buf + s.core_off[k], rs, cs);
    }
    // eff_k^T as ((dims[k] r[k+1]) x r[k]), stored row by row
    Mat<A> eff_tr(int k) const { return mat(eff_t + s.core_off[k], s.r[k], 1); }
    // P_{k} (rows x r[k+1]) of k's chain: the gated core itself when k opens
    // its chain (it is never stored), else the merge buffer
    Mat<A> chain(int k, const A *P, bool transposed) const {
        int64_t c = s.r[k + 1];
        if (k == 0 || k == s.p) return transposed ? eff(k, 1, c) : eff(k, c, 1);
        return transposed ? mat(P + s.P_off[k], 1, c) : mat(P + s.P_off[k], c, 1);
    }
    int64_t rows_of(int k) const { return (s.P_off[k + 1] - s.P_off[k]) / s.r[k + 1]; }
    int steps() const {
        int q = s.D - s.p;
        return (s.p > q ? s.p : q) - 1;
    }
};

// Writes eff (and eff_t unless null) for every core, and zeroes n_zero
// entries at zero.
template <typename T>
int launch_eff(const tt_shape &s, const T *const *cores, const T *const *gates,
               typename Acc<T>::type *eff, typename Acc<T>::type *eff_t,
               typename Acc<T>::type *zero, int64_t n_zero, cudaStream_t st) {
    EffArgs<T> a;
    a.D = s.D;
    for (int k = 0; k <= s.D; k++) a.off[k] = s.core_off[k];
    for (int k = 0; k < s.D; k++) {
        a.core[k] = cores[k];
        a.gate[k] = k < s.D - 1 ? gates[k] : nullptr;
        a.rows[k] = s.r[k];
        a.cols[k] = s.dims[k] * s.r[k + 1];
        a.rank[k] = s.r[k + 1];
    }
    a.eff = eff;
    a.eff_t = eff_t;
    a.zero = zero;
    a.n_zero = n_zero;
    COMERA_LAUNCH(eff_kernel<T>, s.core_off[s.D] + n_zero, st, a);
    return launched();
}

// Whether every index small_gemm_item computes for g fits in an int.
template <typename A> bool fits_int(const SmallGemm<A> &g) {
    int64_t last_a = (g.M - 1) * g.a.rs + (g.K - 1) * g.a.cs;
    int64_t last_b = (g.K - 1) * g.b.rs + (g.N - 1) * g.b.cs;
    return g.M * g.N * g.nsplit <= INT_MAX && g.nsplit * g.kchunk <= INT_MAX && g.K <= INT_MAX &&
           last_a <= INT_MAX && last_b <= INT_MAX;
}

template <typename A> int launch_gemms(SmallGemmBatch<A> &b, cudaStream_t st) {
    b.start[0] = 0;
    for (int i = 0; i < b.count; i++) {
        b.start[i + 1] = b.start[i] + b.g[i].M * b.g[i].N * b.g[i].nsplit;
        b.g[i].i32 = fits_int(b.g[i]);
    }
    if (b.count == 0 || b.start[b.count] == 0) return COMERA_OK;
    COMERA_LAUNCH(small_gemm_kernel<A>, b.start[b.count], st, b);
    return launched();
}

// P_k = P_{k-1} eff_k for every step of both chains, one launch per step
// (the two chains' steps run side by side).
template <typename A> int run_merges(const Layer<A> &L, A *P, cudaStream_t st) {
    const tt_shape &s = L.s;
    for (int step = 1; step <= L.steps(); step++) {
        SmallGemmBatch<A> b;
        b.count = 0;
        for (int chain = 0; chain < 2; chain++) {
            int first = chain_first(s, chain), last = chain_last(s, chain);
            int k = first + step;
            if (k > last) continue;
            SmallGemm<A> &g = b.g[b.count++];
            g.M = L.rows_of(k - 1);
            g.K = s.r[k];
            g.N = s.dims[k] * s.r[k + 1];
            g.a = L.chain(k - 1, P, false);
            g.b = L.eff(k, g.N, 1);
            g.c = P + s.P_off[k];
            g.kchunk = g.K;
            g.nsplit = 1;
        }
        int rc = launch_gemms(b, st);
        if (rc) return rc;
    }
    return COMERA_OK;
}

template <typename T>
PackArgs<T> pack_args(const Layer<typename Acc<T>::type> &L, const typename Acc<T>::type *P,
                      const Ranks &k, int64_t u_rows) {
    const tt_shape &s = L.s;
    PackArgs<T> a;
    a.in = s.in;
    a.out = s.out;
    a.rm = s.rmid;
    a.rp = k.rp;
    a.rk = k.rk;
    a.v = s.p == 1 ? L.eff(0, s.rmid, 1) : mat(P + s.P_off[s.p - 1], s.rmid, 1);
    a.u = s.D - s.p == 1 ? L.eff(s.D - 1, s.out_pad, 1) : mat(P + s.P_off[s.D - 1], s.out_pad, 1);
    a.vc = a.uc = a.te = nullptr;
    a.bias = a.t_src = nullptr;
    a.batch = 0;
    a.ones = 0;
    a.n_v = s.in * a.rp;
    a.n_u = u_rows * s.out;
    a.n_te = 0;
    return a;
}

// ------------------------------------------------------------- workspace
template <typename T> struct FwdBufs {
    typename Acc<T>::type *eff, *P;
    T *vc, *ue, *te;
};

// te: [T 1] padded to rk columns, when that differs from t itself.
template <typename T> FwdBufs<T> fwd_layout(const tt_shape &s, int64_t batch, bool hb, Arena &w) {
    typedef typename Acc<T>::type A;
    const Ranks k = ranks_of<T>(s, hb);
    FwdBufs<T> b;
    b.eff = w.take<A>(s.core_off[s.D]);
    b.P = w.take<A>(s.P_off[s.D]);
    b.vc = w.take<T>(s.in * k.rp);
    b.ue = w.take<T>(k.rk * s.out);
    b.te = k.rk != k.rm ? w.take<T>(batch * k.rk) : nullptr;
    return b;
}

// dP holds every merge's gradient, dU last: rk rows of out_pad, so the
// padded dU product lands in place with the bias gradient as row rm.
inline int64_t dP_size(const tt_shape &s, const Ranks &k) {
    return s.P_off[s.D] + (k.rk - k.rm) * s.out_pad;
}

template <typename T> struct BwdBufs {
    typename Acc<T>::type *eff, *eff_t, *P, *dP, *deff, *gpart;
    typename Acc<T>::type *dpart[2];  // per chain: split sums of dP_{k-1}
    typename Acc<T>::type *part[COMERA_MAX_CORES];
    int64_t nsplit[COMERA_MAX_CORES];
    typename Acc<T>::type *dVp;  // x^T S with rp columns, before compaction
    T *vc, *uc, *te, *S;
};

template <typename T> BwdBufs<T> bwd_layout(const tt_shape &s, int64_t batch, bool hb, Arena &w) {
    typedef typename Acc<T>::type A;
    const Ranks k = ranks_of<T>(s, hb);
    BwdBufs<T> b;
    b.eff = w.take<A>(s.core_off[s.D]);
    b.eff_t = w.take<A>(s.core_off[s.D]);
    b.P = w.take<A>(s.P_off[s.D]);
    b.dP = w.take<A>(dP_size(s, k));  // + the padding rows of dU (the bias row first)
    b.deff = w.take<A>(s.core_off[s.D]);
    for (int k = 0; k < s.D; k++) {
        b.part[k] = nullptr;
        b.nsplit[k] = 1;
        if (k == 0 || k == s.p) continue;  // chain openers: d(eff) is dP itself
        b.nsplit[k] = deff_splits(s, k);
        b.part[k] = w.take<A>(b.nsplit[k] * (s.core_off[k + 1] - s.core_off[k]));
    }
    for (int chain = 0; chain < 2; chain++) {
        int first = chain_first(s, chain), last = chain_last(s, chain);
        int64_t most = 0;
        for (int k = first + 1; k <= last; k++) {
            int64_t ns = chain_splits(s, k), X = (s.P_off[k] - s.P_off[k - 1]) / s.r[k];
            if (ns > 1 && ns * X * s.r[k] > most) most = ns * X * s.r[k];
        }
        b.dpart[chain] = most ? w.take<A>(most) : nullptr;
    }
    int64_t gate_parts = 0;
    for (int k = 0; k < s.D - 1; k++) gate_parts += s.r[k + 1] * gate_chunks(s, k);
    b.gpart = w.take<A>(gate_parts);
    b.vc = w.take<T>(s.in * k.rp);
    b.uc = w.take<T>(k.rp * s.out);
    b.te = k.rk != k.rm ? w.take<T>(batch * k.rk) : nullptr;
    b.dVp = k.rp != k.rm ? w.take<A>(s.in * k.rp) : nullptr;
    b.S = w.take<T>(batch * k.rp);
    return b;
}

// ---------------------------------------------------------------- forward
template <typename T>
int fwd(const tt_shape &s, int64_t B, const T *x, const T *const *cores, const T *const *gates,
        const T *bias, T *y, T *t, Arena &w, cublasHandle_t h, cudaStream_t st) {
    typedef typename Acc<T>::type A;
    const cudaDataType_t dt = DType<T>::cuda;
    const cublasComputeType_t ct = DType<T>::compute;
    bool hb = bias != nullptr;
    FwdBufs<T> b = fwd_layout<T>(s, B, hb, w);
    Layer<A> L{s, b.eff, nullptr};
    int rc = launch_eff<T>(s, cores, gates, b.eff, nullptr, nullptr, 0, st);
    if (!rc) rc = run_merges(L, b.P, st);
    if (rc) return rc;
    // T = x V into te, then y = te [U; b]: with the bias, te starts as the
    // ones column and the first GEMM adds to it (beta 1)
    const Ranks k = ranks_of<T>(s, hb);
    const int64_t rm = k.rm, rp = k.rp, rk = k.rk;
    T *te = b.te ? b.te : t;
    PackArgs<T> pa = pack_args<T>(L, b.P, k, rk);
    pa.vc = b.vc;
    pa.uc = b.ue;
    pa.bias = bias;
    pa.te = te;
    pa.ones = hb;
    pa.batch = B;
    pa.n_te = hb ? B * rk : 0;
    COMERA_LAUNCH(pack_kernel<T>, pa.n_v + pa.n_u + pa.n_te, st, pa);
    if ((rc = launched())) return rc;
    rc = gemm_rm(h, false, false, B, rp, s.in, x, dt, s.in, b.vc, dt, rp, te, dt, rk, ct,
                 hb ? 1.0 : 0.0);
    if (rc) return rc;
    rc = gemm_rm(h, false, false, B, s.out, rk, te, dt, rk, b.ue, dt, s.out, y, dt, s.out, ct, 0.0);
    if (rc) return rc;
    if (te != t && cudaMemcpy2DAsync(t, sizeof(T) * rm, te, sizeof(T) * rk, sizeof(T) * rm, B,
                                     cudaMemcpyDeviceToDevice, st) != cudaSuccess)
        return COMERA_ERR_CUDA;
    return COMERA_OK;
}

// --------------------------------------------------------------- backward
// Back through the merges: for step k of a chain, d(eff_k) = P_{k-1}^T dP_k
// into b.part[k] (split over the long sum) and dP_{k-1} = dP_k eff_k^T,
// both chains' steps side by side.
template <typename T>
int back_through_merges(const Layer<typename Acc<T>::type> &L, const BwdBufs<T> &b,
                        cudaStream_t st) {
    typedef typename Acc<T>::type A;
    const tt_shape &s = L.s;
    for (int step = 0; step < L.steps(); step++) {
        SmallGemmBatch<A> sb;
        sb.count = 0;
        SplitSum<A> ss;
        ss.count = 0;
        for (int chain = 0; chain < 2; chain++) {
            int first = chain_first(s, chain), last = chain_last(s, chain);
            int k = last - step;
            if (k <= first) continue;
            int64_t X = L.rows_of(k - 1), N = s.dims[k] * s.r[k + 1];
            SmallGemm<A> &ge = sb.g[sb.count++];
            ge.M = s.r[k];
            ge.N = N;
            ge.K = X;
            ge.a = L.chain(k - 1, b.P, true);
            ge.b = mat<A>(b.dP + s.P_off[k], N, 1);
            ge.c = b.part[k];
            ge.kchunk = split_chunk(X);
            ge.nsplit = b.nsplit[k];  // deff_splits(s, k): chunks of split_chunk(X)
            SmallGemm<A> &gp = sb.g[sb.count++];
            gp.M = X;
            gp.N = s.r[k];
            gp.K = N;
            gp.a = mat<A>(b.dP + s.P_off[k], N, 1);
            gp.b = L.eff_tr(k);
            int64_t ns = chain_splits(s, k);
            gp.kchunk = split_chunk(N);
            gp.nsplit = ns;
            gp.c = ns > 1 ? b.dpart[chain] : b.dP + s.P_off[k - 1];
            if (ns > 1) {
                ss.part[ss.count] = b.dpart[chain];
                ss.c[ss.count] = b.dP + s.P_off[k - 1];
                ss.n[ss.count] = X * s.r[k];
                ss.nsplit[ss.count] = ns;
                ss.count++;
            }
        }
        int rc = launch_gemms(sb, st);
        if (rc) return rc;
        if (ss.count > 0) {
            ss.start[0] = 0;
            for (int q = 0; q < ss.count; q++) ss.start[q + 1] = ss.start[q] + ss.n[q];
            COMERA_LAUNCH(split_sum_kernel<A>, ss.start[ss.count], st, ss);
            if ((rc = launched())) return rc;
        }
    }
    return COMERA_OK;
}

template <typename T>
int bwd(const tt_shape &s, int64_t B, const T *dy, const T *x, const T *t, const T *const *cores,
        const T *const *gates, T *dx, T *const *dcores, T *const *dgates, T *dbias, Arena &w,
        cublasHandle_t h, cudaStream_t st) {
    typedef typename Acc<T>::type A;
    const cudaDataType_t dt = DType<T>::cuda, at = DType<A>::cuda;
    const cublasComputeType_t ct = DType<T>::compute;
    bool hb = dbias != nullptr;
    BwdBufs<T> b = bwd_layout<T>(s, B, hb, w);
    Layer<A> L{s, b.eff, b.eff_t};
    const Ranks k = ranks_of<T>(s, hb);
    const int64_t rm = k.rm, rp = k.rp, rk = k.rk;
    // dV, dU and the bias row are written for the real features only: the
    // padding and (for batch 0) everything else must read as zero
    int rc = launch_eff<T>(s, cores, gates, b.eff, b.eff_t, b.dP, dP_size(s, k), st);
    if (!rc) rc = run_merges(L, b.P, st);
    if (rc) return rc;
    // te: t padded to rk columns [with the ones column at rm]
    const T *te = b.te ? b.te : t;
    PackArgs<T> pa = pack_args<T>(L, b.P, k, rp);
    pa.vc = b.vc;
    pa.uc = b.uc;
    pa.te = b.te;
    pa.t_src = t;
    pa.ones = hb;
    pa.batch = B;
    pa.n_te = b.te ? B * rk : 0;
    COMERA_LAUNCH(pack_kernel<T>, pa.n_v + pa.n_u + pa.n_te, st, pa);
    if ((rc = launched())) return rc;

    A *dV = b.dP + s.P_off[s.p - 1], *dU = b.dP + s.P_off[s.D - 1];
    if (B > 0) {
        // dy is read by the S and dU products back to back, so the second
        // read mostly hits L2
        rc = gemm_rm(h, false, true, B, rp, s.out, dy, dt, s.out, b.uc, dt, s.out, b.S, dt, rp, ct,
                     0.0);
        if (!rc)
            rc = gemm_rm(h, true, false, rk, s.out, B, te, dt, rk, dy, dt, s.out, dU, at,
                         s.out_pad, ct, 0.0);
        if (!rc && dx)
            rc = gemm_rm(h, false, true, B, s.in, rp, b.S, dt, rp, b.vc, dt, rp, dx, dt, s.in, ct,
                         0.0);
        A *dVp = b.dVp ? b.dVp : dV;
        if (!rc)
            rc = gemm_rm(h, true, false, s.in, rp, B, x, dt, s.in, b.S, dt, rp, dVp, at, rp, ct, 0.0);
        if (rc) return rc;
        if (dVp != dV && cudaMemcpy2DAsync(dV, sizeof(A) * rm, dVp, sizeof(A) * rp, sizeof(A) * rm,
                                           s.in, cudaMemcpyDeviceToDevice, st) != cudaSuccess)
            return COMERA_ERR_CUDA;
    }

    if ((rc = back_through_merges(L, b, st))) return rc;

    CoreGradArgs<T> ca;
    ca.D = s.D;
    for (int k = 0; k <= s.D; k++) ca.off[k] = s.core_off[k];
    for (int k = 0; k < s.D; k++) {
        bool opener = k == 0 || k == s.p;
        ca.src[k] = opener ? b.dP + s.P_off[k] : b.part[k];
        ca.nsplit[k] = opener ? 1 : b.nsplit[k];
        ca.gate[k] = k < s.D - 1 ? gates[k] : nullptr;
        ca.gmod[k] = s.r[k + 1];
        ca.dcore[k] = dcores[k];
    }
    ca.deff = b.deff;
    ca.dbias_src = dU + rm * s.out_pad;
    ca.dbias = dbias;
    ca.n_bias = hb ? s.out : 0;
    COMERA_LAUNCH(core_grad_kernel<T>, s.core_off[s.D] + ca.n_bias, st, ca);
    if ((rc = launched())) return rc;

    GateGradArgs<T> ga;
    ga.deff = b.deff;
    ga.part = b.gpart;
    ga.G = s.D - 1;
    ga.start[0] = ga.pstart[0] = 0;
    for (int k = 0; k <= s.D; k++) ga.off[k] = s.core_off[k];
    for (int k = 0; k < ga.G; k++) {
        ga.cols[k] = s.r[k + 1];
        ga.chunks[k] = gate_chunks(s, k);
        ga.start[k + 1] = ga.start[k] + ga.cols[k];
        ga.pstart[k + 1] = ga.pstart[k] + ga.cols[k] * ga.chunks[k];
        ga.core[k] = cores[k];
        ga.dgate[k] = dgates[k];
    }
    if (ga.pstart[ga.G] > 0) {
        COMERA_LAUNCH(gate_part_kernel<T>, ga.pstart[ga.G], st, ga);
        if ((rc = launched())) return rc;
    }
    COMERA_LAUNCH(gate_sum_kernel<T>, ga.start[ga.G], st, ga);
    return launched();
}

// ------------------------------------------------------------- dispatch
bool dtype_ok(int dtype) { return dtype >= COMERA_DT_F32 && dtype <= COMERA_DT_F16; }

template <typename T> size_t workspace_bytes(const tt_shape &s, int64_t batch, bool hb, bool backward) {
    Arena w{nullptr, 0};
    if (backward)
        bwd_layout<T>(s, batch, hb, w);
    else
        fwd_layout<T>(s, batch, hb, w);
    return w.used + 256;  // room to align the base
}

size_t workspace_for(const tt_shape &s, int dtype, int64_t batch, bool hb, bool backward) {
    switch (dtype) {
        case COMERA_DT_F32: return workspace_bytes<float>(s, batch, hb, backward);
        case COMERA_DT_F64: return workspace_bytes<double>(s, batch, hb, backward);
        case COMERA_DT_BF16: return workspace_bytes<__nv_bfloat16>(s, batch, hb, backward);
        default: return workspace_bytes<__half>(s, batch, hb, backward);
    }
}

Arena arena_for(void *ws) {
    uintptr_t p = ((uintptr_t)ws + 255) & ~(uintptr_t)255;
    return Arena{(char *)p, 0};
}

template <typename T>
int fwd_typed(const tt_shape &s, int64_t batch, const void *x, const void *const *cores,
              const void *const *gates, const void *bias, void *y, void *t, void *ws,
              cublasHandle_t h, cudaStream_t st) {
    Arena w = arena_for(ws);
    return fwd<T>(s, batch, (const T *)x, (const T *const *)cores, (const T *const *)gates,
                  (const T *)bias, (T *)y, (T *)t, w, h, st);
}

template <typename T>
int bwd_typed(const tt_shape &s, int64_t batch, const void *dy, const void *x, const void *t,
              const void *const *cores, const void *const *gates, void *dx,
              void *const *dcores, void *const *dgates, void *dbias, void *ws,
              cublasHandle_t h, cudaStream_t st) {
    Arena w = arena_for(ws);
    return bwd<T>(s, batch, (const T *)dy, (const T *)x, (const T *)t, (const T *const *)cores,
                  (const T *const *)gates, (T *)dx, (T *const *)dcores, (T *const *)dgates,
                  (T *)dbias, w, h, st);
}

}  // namespace
}  // namespace comera_cuda

using namespace comera_cuda;

extern "C" int comera_tt_linear_cuda_workspace(const comera_tt_linear_prep *p, int dtype,
                                               int has_bias, int backward, size_t *bytes) {
    if (!p || !bytes || !dtype_ok(dtype)) return COMERA_ERR_ARG;
    *bytes = workspace_for(p->shape, dtype, p->batch, has_bias != 0, backward != 0);
    return COMERA_OK;
}

extern "C" int comera_tt_linear_fwd_cuda(const comera_tt_linear_prep *p, int dtype, const void *x,
                                         const void *const *cores, const void *const *gates,
                                         const void *bias, void *y, void *t, void *workspace,
                                         size_t workspace_bytes, cublasHandle_t handle,
                                         cudaStream_t stream) {
    if (!p || !dtype_ok(dtype)) return COMERA_ERR_ARG;
    const tt_shape &s = p->shape;
    const int64_t batch = p->batch;
    if (batch == 0) return COMERA_OK;
    if (!x || !cores || !gates || !y || !t || !workspace) return COMERA_ERR_ARG;
    if (workspace_bytes < workspace_for(s, dtype, batch, bias != nullptr, false))
        return COMERA_ERR_WORKSPACE;
    if (cublasSetStream(handle, stream) != CUBLAS_STATUS_SUCCESS) return COMERA_ERR_CUBLAS;
    switch (dtype) {
        case COMERA_DT_F32:
            return fwd_typed<float>(s, batch, x, cores, gates, bias, y, t, workspace, handle, stream);
        case COMERA_DT_F64:
            return fwd_typed<double>(s, batch, x, cores, gates, bias, y, t, workspace, handle, stream);
        case COMERA_DT_BF16:
            return fwd_typed<__nv_bfloat16>(s, batch, x, cores, gates, bias, y, t, workspace,
                                            handle, stream);
        default:
            return fwd_typed<__half>(s, batch, x, cores, gates, bias, y, t, workspace, handle,
                                     stream);
    }
}

extern "C" int comera_tt_linear_bwd_cuda(const comera_tt_linear_prep *p, int dtype, const void *dy,
                                         const void *x, const void *t, const void *const *cores,
                                         const void *const *gates, void *dx,
                                         void *const *dcores, void *const *dgates, void *dbias,
                                         void *workspace, size_t workspace_bytes,
                                         cublasHandle_t handle, cudaStream_t stream) {
    if (!p || !dtype_ok(dtype)) return COMERA_ERR_ARG;
    const tt_shape &s = p->shape;
    const int64_t batch = p->batch;
    if (!cores || !gates || !dcores || !dgates || !workspace) return COMERA_ERR_ARG;
    if (batch > 0 && (!dy || !x || !t)) return COMERA_ERR_ARG;
    if (workspace_bytes < workspace_for(s, dtype, batch, dbias != nullptr, true))
        return COMERA_ERR_WORKSPACE;
    if (cublasSetStream(handle, stream) != CUBLAS_STATUS_SUCCESS) return COMERA_ERR_CUBLAS;
    switch (dtype) {
        case COMERA_DT_F32:
            return bwd_typed<float>(s, batch, dy, x, t, cores, gates, dx, dcores, dgates, dbias,
                                    workspace, handle, stream);
        case COMERA_DT_F64:
            return bwd_typed<double>(s, batch, dy, x, t, cores, gates, dx, dcores, dgates, dbias,
                                     workspace, handle, stream);
        case COMERA_DT_BF16:
            return bwd_typed<__nv_bfloat16>(s, batch, dy, x, t, cores, gates, dx, dcores, dgates,
                                            dbias, workspace, handle, stream);
        default:
            return bwd_typed<__half>(s, batch, dy, x, t, cores, gates, dx, dcores, dgates, dbias,
                                     workspace, handle, stream);
    }
}
