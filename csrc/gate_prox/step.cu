// The whole rank-adaptation step on the gates (docs/design.md section 4) on
// the GPU: comera_gate_step_cuda, the step of comera_gate_step_f32/f64
// (comera/gate_prox.h), in ONE launch for up to COMERA_GATE_STEP_CHUNK gates.
#include "common/cuda_common.cuh"
#include "gate_prox/step_rule.h"

namespace comera_cuda {
namespace {

// One block, one thread per gate: a gate is short (one entry per rank) and
// its step needs all of it (the rescues), so each thread runs the C kernel's
// step on its own gate (step_rule.h, one text for both).  What crosses gates
// is the NaN rule, "a NaN anywhere changes nothing": the block agrees on it
// with __syncthreads_or before any thread writes.  The tables travel by
// value in the launch parameters: no table on the device, no copy, no wait.
template <typename T> struct StepArgs {
    T *gate[COMERA_GATE_STEP_CHUNK];
    int8_t *sign[COMERA_GATE_STEP_CHUNK];
    const T *grad[COMERA_GATE_STEP_CHUNK];  // nullptr: no gradient
    double *sal[COMERA_GATE_STEP_CHUNK];
    int64_t size[COMERA_GATE_STEP_CHUNK];
    int64_t first, count;  // this chunk: gates first .. first + count - 1
    int64_t num_gates, min_live;
    const T *amount;       // num_gates, or nullptr: no shrink
    const uint8_t *frozen; // nullptr or one flag
    uint8_t *nan_seen, *nan_gates;
    int64_t *live;         // num_gates
    double threshold;
    int kill;
    int check_nan;  // 1: the block checks for NaN itself (one chunk in all)
};

template <typename T> __device__ int step_has_nan(const T *g, int64_t n) {
    typedef typename Acc<T>::type A;
    for (int64_t i = 0; i < n; i++) {
        A v = to_acc<A>(g[i]);
        if (v != v) return 1;
    }
    return 0;
}

// Chunked calls: the NaN flags of one chunk into live, before any step.
template <typename T> __global__ void gate_step_nan_kernel(StepArgs<T> a) {
    COMERA_FOR_EACH(c, a.count) a.live[a.first + c] = step_has_nan(a.gate[c], a.size[c]) ? -1 : 0;
}

__device__ inline int any_nan_flag(const int64_t *live, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        if (live[j] < 0) return 1;
    return 0;
}

template <typename T> __global__ void __launch_bounds__(COMERA_GATE_STEP_CHUNK)
    gate_step_kernel(StepArgs<T> a) {
    const int64_t c = threadIdx.x;
    const bool mine = c < a.count;
    int bad = 0;
    if (a.check_nan && mine) {
        bad = step_has_nan(a.gate[c], a.size[c]);
        a.live[a.first + c] = bad ? -1 : 0;
    }
    // the same answer in every thread of the block (barriers below are safe);
    // chunked, the flags of every chunk are in live already, and a step that
    // writes live[] writes a count >= 0, which reads as no NaN
    const int any = a.check_nan ? __syncthreads_or(bad) : any_nan_flag(a.live, a.num_gates);
    if (any) {
        // the first NaN seen: which gates; nan_seen is set last, by the last chunk
        const bool first = a.nan_seen && !*a.nan_seen;
        if (first && mine) a.nan_gates[a.first + c] = a.live[a.first + c] < 0;
        __syncthreads();
        if (first && c == 0 && a.first + a.count == a.num_gates) *a.nan_seen = 1;
        return;
    }
    if (!mine) return;
    const bool frozen = a.frozen && *a.frozen;
    const T *amount = a.amount && !frozen ? a.amount + a.first + c : nullptr;
    a.live[a.first + c] = gate_step_one(a.gate[c], a.sign[c], a.grad[c], a.sal[c], a.size[c],
                                        amount, a.threshold, a.min_live, a.kill);
}

// The launch parameters of the chunk starting at gate `first`.
template <typename T>
StepArgs<T> step_chunk(const comera_gate_step_args *g, int64_t first) {
    StepArgs<T> a;
    a.first = first;
    a.count = g->num_gates - first < COMERA_GATE_STEP_CHUNK ? g->num_gates - first
                                                             : COMERA_GATE_STEP_CHUNK;
    for (int64_t c = 0; c < COMERA_GATE_STEP_CHUNK; c++) {
        const bool in = c < a.count;
        a.gate[c] = in ? (T *)g->gates[first + c] : nullptr;
        a.sign[c] = in ? g->signs[first + c] : nullptr;
        a.grad[c] = in && g->grads ? (const T *)g->grads[first + c] : nullptr;
        a.sal[c] = in && g->saliency ? g->saliency[first + c] : nullptr;
        a.size[c] = in ? g->sizes[first + c] : 0;
    }
    a.num_gates = g->num_gates;
    a.min_live = g->min_live;
    a.amount = (const T *)g->amount;
    a.frozen = g->frozen;
    a.nan_seen = g->nan_seen;
    a.nan_gates = g->nan_gates;
    a.live = g->live;
    a.threshold = g->threshold;
    a.kill = g->kill;
    a.check_nan = g->num_gates <= COMERA_GATE_STEP_CHUNK;
    return a;
}

// One launch for up to COMERA_GATE_STEP_CHUNK gates; more: a NaN pass over
// every chunk, then a step per chunk (so that no gate changes before every
// NaN flag is known).
template <typename T> int gate_step(const comera_gate_step_args *g, cudaStream_t st) {
    const int64_t n = g->num_gates;
    if (n > COMERA_GATE_STEP_CHUNK) {
        for (int64_t first = 0; first < n; first += COMERA_GATE_STEP_CHUNK) {
            StepArgs<T> a = step_chunk<T>(g, first);
            COMERA_LAUNCH(gate_step_nan_kernel<T>, a.count, st, a);
            int rc = launched();
            if (rc) return rc;
        }
    }
    for (int64_t first = 0; first < n; first += COMERA_GATE_STEP_CHUNK) {
        StepArgs<T> a = step_chunk<T>(g, first);
        const unsigned threads = (unsigned)((a.count + 31) / 32 * 32);  // whole warps
        COMERA_LAUNCH_BLOCK(gate_step_kernel<T>, threads, st, a);
        int rc = launched();
        if (rc) return rc;
    }
    return COMERA_OK;
}

}  // namespace
}  // namespace comera_cuda

extern "C" int comera_gate_step_cuda(int dtype, const comera_gate_step_args *a,
                                     cudaStream_t stream) {
    using namespace comera_cuda;
    if (!gate_step_args_ok(a)) return COMERA_ERR_ARG;
    if (a->num_gates == 0) return COMERA_OK;
    switch (dtype) {
        case COMERA_DT_F32: return gate_step<float>(a, stream);
        case COMERA_DT_F64: return gate_step<double>(a, stream);
        case COMERA_DT_BF16: return gate_step<__nv_bfloat16>(a, stream);
        case COMERA_DT_F16: return gate_step<__half>(a, stream);
        default: return COMERA_ERR_ARG;
    }
}
