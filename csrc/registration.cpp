// Every comera operator schema, in one place, and the Python module.
// Implementations are registered per device (CPU, and CUDA in a CUDA build)
// in csrc/<op>/op.cpp; fakes and autograd are registered from Python
// (comera/ops/).  Everything is on the LibTorch stable ABI: the library loads
// into every torch from the one its TORCH_TARGET_VERSION names (setup.py) on.
#include <Python.h>
#include <torch/csrc/stable/library.h>

#include <string>
#include <vector>

#include "common/gemm.h"
#include "common/outpool.h"

namespace {
// The float32 micro-kernel variant of the C kernels ("avx512", "avx2",
// "generic"; "avx512" also under the amx variant, which runs bfloat16 on
// AMX tiles): chosen once per process, COMERA_ISA forces one.
std::string cpu_isa() { return comera_gemm_isa(); }

// [idle bytes, bytes in use, bytes freed] of the output pool
// (common/outpool.h); release frees the idle blocks first.
std::vector<int64_t> output_pool(bool release) {
    int64_t freed = release ? static_cast<int64_t>(comera_outpool_release()) : 0;
    size_t idle = 0, busy = 0;
    comera_outpool_stats(&idle, &busy);
    return {static_cast<int64_t>(idle), static_cast<int64_t>(busy), freed};
}
}  // namespace

STABLE_TORCH_LIBRARY(comera, m) {
    // y = x W^T + bias for a TT weight; also returns t = x V (batch x r_mid)
    // that the backward reuses.  path: 0 auto (planner), 1 merge, 2 sequential.
    m.def("tt_linear(Tensor x, Tensor[] cores, Tensor[] gates, Tensor? bias, "
          "int num_in_cores, int out_features, int path) -> (Tensor, Tensor)");
    // Gradients of tt_linear; grad_x is empty when needs_input_grad is false,
    // grad_bias is empty when has_bias is false.
    m.def("tt_linear_backward(Tensor grad_y, Tensor x, Tensor t, Tensor[] cores, "
          "Tensor[] gates, bool has_bias, bool needs_input_grad, int num_in_cores, "
          "int out_features, int path) -> (Tensor, Tensor[], Tensor[], Tensor)");
    // The planner's verdict for `batch` rows of element type dtype (COMERA_DT_*:
    // 0 float32, 1 float64, 2 bfloat16, 3 float16) on `threads` threads, as a
    // float64 tensor: [path, flops_merge, bytes_merge, seconds_merge, flops_seq,
    // bytes_seq, seconds_seq, kernel (COMERA_KERNEL_*), dtype, threads]
    m.def("tt_linear_plan(int[] in_modes, int[] out_modes, int[] ranks, "
          "int in_features, int out_features, int batch, int dtype=0, int threads=1) -> Tensor");

    // --- tt_embedding (TTEmbedding) ---
    // Lookup of a TTM-format embedding (docs/design.md section 3).  cores[k] is
    // (r_k, v_k, e_k, r_{k+1}); mode 0 plain (output (N, embedding_dim)), 1 sum
    // and 2 mean over bags (offsets has num_bags + 1 entries, output
    // (num_bags, embedding_dim)); padding_idx -1 for none; reuse 0 auto,
    // 1 none, 2 dedup, 3 dedup + shared prefixes.
    m.def("tt_embedding(Tensor indices, Tensor? offsets, Tensor? per_sample_weights, "
          "Tensor[] cores, Tensor[] gates, int num_embeddings, int embedding_dim, "
          "int padding_idx, int mode, int reuse) -> Tensor");
    // Gradients of tt_embedding with respect to the cores and gates.
    m.def("tt_embedding_backward(Tensor grad_out, Tensor indices, Tensor? offsets, "
          "Tensor? per_sample_weights, Tensor[] cores, Tensor[] gates, int num_embeddings, "
          "int embedding_dim, int padding_idx, int mode, int reuse) -> (Tensor[], Tensor[])");
    // The planner's numbers for one batch as a float64 tensor: [reuse, rows,
    // unique, flops none/dedup/prefix, seconds none/dedup/prefix, distinct
    // prefixes per level].
    m.def("tt_embedding_plan(Tensor indices, Tensor? offsets, int[] row_modes, "
          "int[] dim_modes, int[] ranks, int num_embeddings, int embedding_dim, "
          "int padding_idx, int mode) -> Tensor");

    // --- rank adaptation (gate proximal step) ---
    // Fused proximal step on TT gates after an optimizer step, in place: dead
    // entries (signs == 0) are re-zeroed; with kill, entries within threshold
    // of zero or whose sign changed die (gate and sign set to 0), keeping at
    // least min_live per gate.  Returns the live count per gate (int64, on the
    // gates' device), -1 for a gate holding a NaN (then nothing is modified).
    m.def("gate_prox_(Tensor(a!)[] gates, Tensor(b!)[] signs, float threshold, int min_live, "
          "bool kill) -> Tensor");
    // The whole rank-adaptation step on the gates, in place, in one call: the
    // NaN check (a NaN anywhere: nothing changes but nan_seen / nan_gates,
    // which record the first one), the saliency average of |g * grad| (an
    // empty grads[k]: no gradient), the shrink by amount[k] with the min_live
    // rescue (no amount, or frozen set: none), then gate_prox_'s rule.
    // Returns gate_prox_'s live counts (comera/gate_prox.h).
    m.def("gate_step_(Tensor(a!)[] gates, Tensor(b!)[] signs, Tensor[] grads, "
          "Tensor(c!)[] saliency, Tensor? amount, Tensor? frozen, Tensor(d!)? nan_seen, "
          "Tensor(e!)? nan_gates, float threshold, int min_live, bool kill) -> Tensor");

    // --- the C kernels' micro-kernel variant (docs/design.md section 5) ---
    m.def("cpu_isa() -> str");
    // --- the cache of large CPU output blocks (docs/design.md section 5) ---
    m.def("output_pool(bool release) -> int[]");
}

// No tensor arguments: one implementation for every device.
STABLE_TORCH_LIBRARY_IMPL(comera, CompositeExplicitAutograd, m) {
    m.impl("cpu_isa", TORCH_BOX(&cpu_isa));
    m.impl("output_pool", TORCH_BOX(&output_pool));
}

// An empty Python module: importing comera._C loads this shared library,
// whose static initialisers register the comera:: operators with torch.
extern "C" {
PyObject *PyInit__C(void) {
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
    return PyModule_Create(&def);
}
}
