// Proximal step of the L1 gate penalty (DESIGN.md section 4) on the GPU:
// the soft threshold g = sign(g) max(|g| - threshold, 0), in place.
#include "common.cuh"

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

}  // namespace
}  // namespace comera_cuda

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
