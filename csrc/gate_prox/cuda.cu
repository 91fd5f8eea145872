// The proximal step on the TT gates (docs/design.md section 4) on the GPU:
// comera_gate_prox_cuda, the rule of comera::gate_prox_ (see
// comera/gate_prox.h), one thread per gate.
#include "common/cuda_common.cuh"
#include "gate_prox/rule.h"

namespace comera_cuda {
namespace {

// One thread per gate: gates are short (one entry per rank) and the rule
// needs the whole gate (the min_live rescue), so each thread runs the C
// kernel's three passes (rule.h, one text for both) over its own gate.  The
// gate and sign pointers and the sizes of up to COMERA_GATE_CHUNK gates
// travel by value in the launch parameters (no table on the device: no copy,
// no wait, graph-capturable); more gates take more launches.  `live` holds
// all num_gates counts, so that every chunk sees every chunk's NaN flag.
template <typename T> struct ProxArgs {
    T *gate[COMERA_GATE_CHUNK];
    int8_t *sign[COMERA_GATE_CHUNK];
    int64_t size[COMERA_GATE_CHUNK];
    int64_t first, count;  // this chunk: gates first .. first + count - 1
    int64_t *live;          // num_gates entries
    int64_t num_gates, min_live;
    double threshold;
    int kill;
};

template <typename T> __global__ void gate_nan_kernel(ProxArgs<T> a) {
    typedef typename Acc<T>::type A;
    COMERA_FOR_EACH(c, a.count) {
        const T *g = a.gate[c];
        int64_t bad = 0;
        for (int64_t i = 0; i < a.size[c]; i++) {
            A v = to_acc<A>(g[i]);
            if (v != v) bad = 1;
        }
        a.live[a.first + c] = bad ? -1 : 0;
    }
}

template <typename T> __global__ void gate_prox_kernel(ProxArgs<T> a) {
    COMERA_FOR_EACH(c, a.count) {
        // a NaN anywhere: nothing is modified (the flags come from gate_nan_kernel,
        // which ran for every chunk before any chunk's step)
        bool any_nan = false;
        for (int64_t j = 0; j < a.num_gates; j++) any_nan = any_nan || a.live[j] < 0;
        if (any_nan) continue;
        // safe although other threads read live[]: no NaN, so all are >= 0
        a.live[a.first + c] =
            gate_prox_one(a.gate[c], a.sign[c], a.size[c], a.threshold, a.min_live, a.kill);
    }
}

// Fills the launch parameters of the chunk starting at gate `first`.
template <typename T>
ProxArgs<T> chunk_args(int64_t num_gates, void *const *gates, int8_t *const *signs,
                       const int64_t *sizes, int64_t first, double threshold, int64_t min_live,
                       int kill, int64_t *live) {
    ProxArgs<T> a;
    a.first = first;
    a.count = num_gates - first < COMERA_GATE_CHUNK ? num_gates - first : COMERA_GATE_CHUNK;
    for (int64_t c = 0; c < COMERA_GATE_CHUNK; c++) {
        bool in = c < a.count;
        a.gate[c] = in ? (T *)gates[first + c] : nullptr;
        a.sign[c] = in ? signs[first + c] : nullptr;
        a.size[c] = in ? sizes[first + c] : 0;
    }
    a.live = live;
    a.num_gates = num_gates;
    a.min_live = min_live;
    a.threshold = threshold;
    a.kill = kill;
    return a;
}

// Two passes over the chunks: every NaN flag is written before any gate changes.
template <typename T>
int gate_prox(int64_t num_gates, void *const *gates, int8_t *const *signs, const int64_t *sizes,
              double threshold, int64_t min_live, int kill, int64_t *live, cudaStream_t st) {
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t first = 0; first < num_gates; first += COMERA_GATE_CHUNK) {
            ProxArgs<T> a = chunk_args<T>(num_gates, gates, signs, sizes, first, threshold,
                                          min_live, kill, live);
            if (pass == 0)
                COMERA_LAUNCH(gate_nan_kernel<T>, a.count, st, a);
            else
                COMERA_LAUNCH(gate_prox_kernel<T>, a.count, st, a);
            int rc = launched();
            if (rc) return rc;
        }
    }
    return COMERA_OK;
}

}  // namespace
}  // namespace comera_cuda

extern "C" int comera_gate_prox_cuda(int dtype, int64_t num_gates, void *const *gates,
                                     int8_t *const *signs, const int64_t *sizes,
                                     double threshold, int64_t min_live, int kill,
                                     int64_t *live, cudaStream_t stream) {
    using namespace comera_cuda;
    if (num_gates < 0 || threshold != threshold || min_live < 0) return COMERA_ERR_ARG;
    if (num_gates == 0) return COMERA_OK;
    if (!gates || !signs || !sizes || !live) return COMERA_ERR_ARG;
    for (int64_t k = 0; k < num_gates; k++)
        if (sizes[k] < 0 || (sizes[k] > 0 && (!gates[k] || !signs[k]))) return COMERA_ERR_ARG;
    switch (dtype) {
        case COMERA_DT_F32:
            return gate_prox<float>(num_gates, gates, signs, sizes, threshold, min_live, kill, live, stream);
        case COMERA_DT_F64:
            return gate_prox<double>(num_gates, gates, signs, sizes, threshold, min_live, kill, live, stream);
        case COMERA_DT_BF16:
            return gate_prox<__nv_bfloat16>(num_gates, gates, signs, sizes, threshold, min_live, kill,
                                            live, stream);
        case COMERA_DT_F16:
            return gate_prox<__half>(num_gates, gates, signs, sizes, threshold, min_live, kill, live,
                                     stream);
        default: return COMERA_ERR_ARG;
    }
}
