// Proximal steps on the TT gates (docs/design.md section 4) on the GPU:
//   comera_gate_prox_cuda            the rule of comera::gate_prox_ (see
//                                    comera/gate_prox.h), one thread per gate
//   comera_gate_soft_threshold_cuda  the plain soft threshold
#include "common/cuda_common.cuh"

namespace comera_cuda {
namespace {

template <typename T> __global__ void soft_threshold_kernel(T *g, int64_t n, double thr) {
    typedef typename Acc<T>::type A;
    const A th = (A)thr;
    COMERA_FOR_EACH(i, n) {
        A v = to_acc<A>(g[i]);
        // exact zeros (dead ranks) and NaN are left as they are
        if (v > th)
            g[i] = from_acc<T, A>(v - th);
        else if (v < -th)
            g[i] = from_acc<T, A>(v + th);
        else if (v == v)
            g[i] = from_acc<T, A>((A)0);
    }
}

template <typename T> int soft_threshold(void *g, int64_t n, double thr, cudaStream_t st) {
    COMERA_LAUNCH(soft_threshold_kernel<T>, n, st, (T *)g, n, thr);
    return launched();
}

// One thread per gate: gates are short (one entry per rank) and the rule
// needs the whole gate (the min_live rescue), so each thread runs the C
// kernel's three passes over its own gate.  table: gate pointers, sign
// pointers, sizes (num_gates each).
template <typename T> struct ProxArgs {
    const int64_t *table;
    int64_t *live;
    int64_t num_gates, min_live;
    double threshold;
    int kill;
};

template <typename T> __global__ void gate_nan_kernel(ProxArgs<T> a) {
    typedef typename Acc<T>::type A;
    COMERA_FOR_EACH(k, a.num_gates) {
        const T *g = (const T *)a.table[k];
        int64_t n = a.table[2 * a.num_gates + k], bad = 0;
        for (int64_t i = 0; i < n; i++) {
            A v = to_acc<A>(g[i]);
            if (v != v) bad = 1;
        }
        a.live[k] = bad ? -1 : 0;
    }
}

template <typename T> __device__ __host__ int8_t sign_of(typename Acc<T>::type v) {
    return v > 0 ? 1 : v < 0 ? -1 : 0;
}

template <typename T> __global__ void gate_prox_kernel(ProxArgs<T> a) {
    typedef typename Acc<T>::type A;
    COMERA_FOR_EACH(k, a.num_gates) {
        // a NaN anywhere: nothing is modified (the flags come from gate_nan_kernel)
        bool any_nan = false;
        for (int64_t j = 0; j < a.num_gates; j++) any_nan = any_nan || a.live[j] < 0;
        if (any_nan) continue;
        T *g = (T *)a.table[k];
        int8_t *s = (int8_t *)a.table[a.num_gates + k];
        int64_t n = a.table[2 * a.num_gates + k], live = 0, doomed = 0;
        const T zero = from_acc<T, A>((A)0);
        for (int64_t i = 0; i < n; i++) {  // classify; doomed entries are marked +-2
            if (s[i] == 0) {
                g[i] = zero;
                continue;
            }
            A v = to_acc<A>(g[i]);
            int8_t now = sign_of<T>(v);
            if (!a.kill) {
                if (now != 0) s[i] = now;
                live++;
                continue;
            }
            A mag = v < 0 ? -v : v;
            if ((double)mag <= a.threshold || now != s[i]) {
                s[i] = (int8_t)(2 * (now != 0 ? now : 1));
                doomed++;
            } else {
                live++;
            }
        }
        while (live < a.min_live && doomed > 0) {  // rescue the largest doomed entries
            int64_t best = -1;
            A best_abs = 0;
            for (int64_t i = 0; i < n; i++) {
                A v = to_acc<A>(g[i]), mag = v < 0 ? -v : v;
                if ((s[i] == 2 || s[i] == -2) && mag > best_abs) {
                    best_abs = mag;
                    best = i;
                }
            }
            if (best < 0) break;  // the rest are exactly zero
            s[best] = (int8_t)(s[best] / 2);
            live++;
            doomed--;
        }
        for (int64_t i = 0; i < n; i++) {
            if (s[i] == 2 || s[i] == -2) {
                s[i] = 0;
                g[i] = zero;
            }
        }
        a.live[k] = live;
    }
}

template <typename T>
int gate_prox(int64_t num_gates, const int64_t *table, double threshold, int64_t min_live,
              int kill, int64_t *live, cudaStream_t st) {
    ProxArgs<T> a{table, live, num_gates, min_live, threshold, kill};
    COMERA_LAUNCH(gate_nan_kernel<T>, num_gates, st, a);
    int rc = launched();
    if (rc) return rc;
    COMERA_LAUNCH(gate_prox_kernel<T>, num_gates, st, a);
    return launched();
}

}  // namespace
}  // namespace comera_cuda

extern "C" int comera_gate_prox_cuda(int dtype, int64_t num_gates, const int64_t *table,
                                     double threshold, int64_t min_live, int kill,
                                     int64_t *live, cudaStream_t stream) {
    using namespace comera_cuda;
    if (num_gates < 0 || threshold != threshold || min_live < 0) return COMERA_ERR_ARG;
    if (num_gates == 0) return COMERA_OK;
    if (!table || !live) return COMERA_ERR_ARG;
    switch (dtype) {
        case COMERA_DT_F32: return gate_prox<float>(num_gates, table, threshold, min_live, kill, live, stream);
        case COMERA_DT_F64: return gate_prox<double>(num_gates, table, threshold, min_live, kill, live, stream);
        case COMERA_DT_BF16:
            return gate_prox<__nv_bfloat16>(num_gates, table, threshold, min_live, kill, live, stream);
        case COMERA_DT_F16: return gate_prox<__half>(num_gates, table, threshold, min_live, kill, live, stream);
        default: return COMERA_ERR_ARG;
    }
}

extern "C" int comera_gate_soft_threshold_cuda(int dtype, int64_t n, void *g, double threshold,
                                               cudaStream_t stream) {
    using namespace comera_cuda;
    if (n < 0 || !(threshold >= 0.0)) return COMERA_ERR_ARG;
    if (n == 0) return COMERA_OK;
    if (!g) return COMERA_ERR_ARG;
    switch (dtype) {
        case COMERA_DT_F32: return soft_threshold<float>(g, n, threshold, stream);
        case COMERA_DT_F64: return soft_threshold<double>(g, n, threshold, stream);
        case COMERA_DT_BF16: return soft_threshold<__nv_bfloat16>(g, n, threshold, stream);
        case COMERA_DT_F16: return soft_threshold<__half>(g, n, threshold, stream);
        default: return COMERA_ERR_ARG;
    }
}
