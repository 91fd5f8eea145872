// tt_embedding: the TT (TTM-format) embedding table (docs/design.md
// section 3).  This folder holds the whole op: plan.c (checks, shape, index
// grouping, planner, prepare), cpu_f32.c and cpu_f64.c (the C kernels,
// their shared body in cpu_impl.h and cpu_bwd_impl.h), cuda.cu + cuda_bwd.cu + cuda.cuh (the CUDA launchers), and
// this file, the torch glue for every device, on the LibTorch stable ABI
// (common/glue.h).
//
// Each op call: check the cores, gates and batch tensors and prepare the
// table once (prepare_embedding), allocate the output, then call the kernel
// of the cores' device.  On the CPU the index and offset values are checked
// first (comera_tt_embedding_check_batch), since the C kernels trust them.
// On CUDA they are not read on the host (that would be a synchronisation
// and would break CUDA graph capture): the Python wrapper checks them unless
// the layer is capturable; comera/cuda.h says what the kernels do with bad
// ones.
#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "comera/tt_embedding.h"
#include "common/glue.h"

#ifdef COMERA_WITH_CUDA
#include "comera/cuda.h"
#endif

namespace {

using namespace comera_glue;

const Device kCpu(torch::headeronly::DeviceType::CPU);

// ---- the index batch, checked the same way on every device

// Keeps the converted index and offset tensors alive.
struct EmbeddingBatch {
    std::optional<Tensor> indices, offsets;
    comera_tt_embedding_batch b{};
    int64_t output_rows() const { return b.mode == COMERA_EMB_PLAIN ? b.n : b.num_bags; }
};

inline Tensor as_int64(const char *op, const char *name, const Tensor &t, const Device &device) {
    const ScalarType dtype = t.scalar_type();
    COMERA_CHECK_TYPE(dtype == ScalarType::Long || dtype == ScalarType::Int, op, ": ", name,
                      " must be an int64 or int32 tensor, got ", dtype);
    COMERA_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got ", t.dim(), "-D");
    const Device td = t.device();
    COMERA_CHECK_VALUE(td == device, op, ": ", name, " is on ", device_name(td),
                       " but the cores are on ", device_name(device));
    return as_contiguous(dtype == ScalarType::Long ? t : torch::stable::to(t, ScalarType::Long));
}

// Mode, index and offset tensors (dtype, shape, device); the values are
// checked where they can be read (comera_tt_embedding_check_batch on the CPU).
inline EmbeddingBatch make_embedding_batch(const char *op, const Tensor &indices,
                                           const std::optional<Tensor> &offsets, int64_t mode,
                                           const Device &device) {
    COMERA_CHECK_VALUE(mode >= COMERA_EMB_PLAIN && mode <= COMERA_EMB_MEAN, op,
                       ": mode must be 0 (plain), 1 (sum) or 2 (mean), got ", mode);
    EmbeddingBatch out;
    out.indices = as_int64(op, "indices", indices, device);
    out.b.mode = static_cast<int32_t>(mode);
    out.b.n = out.indices->numel();
    out.b.indices = ptr<int64_t>(*out.indices);
    if (mode == COMERA_EMB_PLAIN) {
        COMERA_CHECK_VALUE(!offsets.has_value(), op, ": offsets are only valid in bag modes");
        return out;
    }
    COMERA_CHECK_VALUE(offsets.has_value(), op, ": bag modes need offsets");
    out.offsets = as_int64(op, "offsets", *offsets, device);
    COMERA_CHECK_VALUE(out.offsets->numel() >= 1, op,
                       ": offsets must have num_bags + 1 >= 1 entries, got none");
    out.b.num_bags = out.offsets->numel() - 1;
    out.b.offsets = ptr<int64_t>(*out.offsets);
    return out;
}

// The messages of a batch that comera_tt_embedding_check_batch refused.
inline std::string batch_error_detail(int rc, const EmbeddingBatch &batch, int64_t bad,
                                      int64_t num_embeddings) {
    if (rc == COMERA_ERR_INDEX)
        return str(": index ", batch.b.indices[bad], " at position ", bad,
                   " is out of range for num_embeddings=", num_embeddings,
                   " (expected 0 <= index < ", num_embeddings, ")");
    if (rc == COMERA_ERR_OFFSETS)
        return str(": offsets[", bad, "] = ", batch.b.offsets[bad],
                   " is invalid: offsets must start at 0, never decrease, and the last "
                   "one must equal the number of indices (", batch.b.n, ")");
    return "";
}

inline std::optional<Tensor> check_per_sample_weights(const char *op,
                                                      const std::optional<Tensor> &psw,
                                                      const EmbeddingBatch &batch,
                                                      ScalarType dtype, const Device &device) {
    if (!psw.has_value()) return std::nullopt;
    COMERA_CHECK_VALUE(batch.b.mode == COMERA_EMB_SUM, op,
                       ": per_sample_weights are only supported with mode 1 (sum), as in "
                       "nn.EmbeddingBag; got mode ", batch.b.mode);
    COMERA_CHECK_VALUE(psw->dim() == 1 && psw->size(0) == batch.b.n, op,
                       ": per_sample_weights must have shape (", batch.b.n, ",), got ",
                       shape_text(*psw));
    COMERA_CHECK_TYPE(psw->scalar_type() == dtype, op, ": per_sample_weights must be ", dtype,
                      ", got ", psw->scalar_type());
    const Device pd = psw->device();
    COMERA_CHECK_VALUE(pd == device, op, ": per_sample_weights is on ", device_name(pd),
                       " but the cores are on ", device_name(device));
    return as_contiguous(*psw);
}

// float32/float64 on the CPU; CUDA also takes bfloat16 and float16.
void check_dtype(ScalarType dtype, const Device &device, const char *op) {
    if (is_cuda(device)) {
        COMERA_CHECK_TYPE(dtype_code(dtype) >= 0, op,
                          ": cores must be float32, float64, bfloat16 or float16 on CUDA, got ",
                          dtype);
        return;
    }
    COMERA_CHECK_TYPE(dtype == ScalarType::Float || dtype == ScalarType::Double, op,
                      ": cores must be float32 or float64, got ", dtype);
}

// One prepared call: contiguous cores and gates, the descriptor's arrays,
// the prep, the batch and the per-sample weights (empty when absent).  The
// guard, first so that it is released last, keeps the cores' device current
// while the call lives (the plan op, on the CPU, has none).
struct EmbeddingCall {
    std::optional<CudaGuard> guard;
    std::vector<Tensor> cores, gates;
    int64_t num_cores = 0; /* the arrays' used lengths: num_cores and num_cores + 1 */
    int64_t row_modes[COMERA_MAX_CORES], dim_modes[COMERA_MAX_CORES], ranks[COMERA_MAX_CORES + 1];
    comera_tt_embedding_desc d{};
    comera_tt_embedding_prep prep{};
    EmbeddingBatch batch;
    std::optional<Tensor> psw;
    ScalarType dtype = ScalarType::Float;
    Device device = kCpu;
};

inline void describe_cores(const char *op, EmbeddingCall &c) {
    int64_t D = static_cast<int64_t>(c.cores.size());
    const auto dtype = c.dtype;
    const auto &device = c.device;
    c.num_cores = D;
    c.ranks[0] = 1;
    for (int64_t k = 0; k < D; k++) {
        const Tensor &core = c.cores[k];
        COMERA_CHECK_VALUE(core.dim() == 4, op, ": core ", k,
                           " must be 4-D (rank, row mode, dim mode, rank), got ", core.dim(),
                           "-D");
        COMERA_CHECK_VALUE(core.size(0) == c.ranks[k], op, ": core ", k, " has left rank ",
                           core.size(0), ", expected ", c.ranks[k]);
        COMERA_CHECK_TYPE(core.scalar_type() == dtype, op, ": core ", k, " has dtype ",
                          core.scalar_type(), ", expected ", dtype);
        COMERA_CHECK_VALUE(core.device() == device, op, ": core ", k, " is on ",
                           device_name(core.device()), ", expected ", device_name(device));
        c.row_modes[k] = core.size(1);
        c.dim_modes[k] = core.size(2);
        c.ranks[k + 1] = core.size(3);
        if (k == D - 1) continue;
        const Tensor &g = c.gates[k];
        COMERA_CHECK_VALUE(g.dim() == 1 && g.size(0) == core.size(3), op, ": gate ", k,
                           " must have shape (", core.size(3), ",), got ", shape_text(g));
        COMERA_CHECK_TYPE(g.scalar_type() == dtype, op, ": gate ", k, " has dtype ",
                          g.scalar_type(), ", expected ", dtype);
        COMERA_CHECK_VALUE(g.device() == device, op, ": gate ", k, " is on ",
                           device_name(g.device()), ", expected ", device_name(device));
    }
    COMERA_CHECK_VALUE(c.ranks[D] == 1, op,
                       ": the last core must have right rank 1, got ", c.ranks[D]);
}

// Fills c.d from the mode and rank arrays of c.
inline void fill_embedding_desc(EmbeddingCall &c, int64_t num_embeddings, int64_t embedding_dim,
                                int64_t padding_idx) {
    c.d.num_cores = static_cast<int32_t>(c.num_cores);
    c.d.row_modes = c.row_modes;
    c.d.dim_modes = c.dim_modes;
    c.d.ranks = c.ranks;
    c.d.num_embeddings = num_embeddings;
    c.d.embedding_dim = embedding_dim;
    c.d.padding_idx = padding_idx;
}

// comera_tt_embedding_prepare, with the descriptor in the error message.
inline void prepare_table(const char *op, EmbeddingCall &c, int64_t reuse) {
    COMERA_CHECK_VALUE(reuse >= COMERA_REUSE_AUTO && reuse <= COMERA_REUSE_PREFIX, op,
                       ": reuse must be 0 (auto), 1 (none), 2 (dedup) or 3 (prefix), got ",
                       reuse);
    int rc = comera_tt_embedding_prepare(&c.d, static_cast<int>(reuse), &c.prep);
    check_status(rc, op, [&](int) {
        return str(" (num_embeddings ", c.d.num_embeddings, ", embedding_dim ",
                   c.d.embedding_dim, ", padding_idx ", c.d.padding_idx, ", row modes ",
                   list_text({c.row_modes, static_cast<size_t>(c.num_cores)}), ", dim modes ",
                   list_text({c.dim_modes, static_cast<size_t>(c.num_cores)}), ")");
    }, ArgError::Value);
}

// The index and offset values, which the C kernels trust.
void check_batch_values(const char *op, const EmbeddingCall &c) {
    int64_t bad = -1;
    int rc = comera_tt_embedding_check_batch(&c.prep, &c.batch.b, &bad);
    check_status(rc, op, [&](int code) {
        return batch_error_detail(code, c.batch, bad, c.d.num_embeddings);
    }, ArgError::Value);
}

// The device of the call: the cores' (checked non-empty before the guard).
Device call_device(const char *op, const std::vector<Tensor> &cores) {
    COMERA_CHECK_VALUE(!cores.empty(), op, ": expected at least 2 cores, got none");
    return cores[0].device();
}

// Everything for one call, on the cores' device; on the CPU the index and
// offset values too.
inline EmbeddingCall prepare_embedding(const char *op, std::vector<Tensor> &&cores,
                                       std::vector<Tensor> &&gates, int64_t num_embeddings,
                                       int64_t embedding_dim, int64_t padding_idx, int64_t reuse,
                                       const Tensor &indices,
                                       const std::optional<Tensor> &offsets, int64_t mode,
                                       const std::optional<Tensor> &psw) {
    EmbeddingCall c;
    c.guard.emplace(call_device(op, cores));
    int64_t D = static_cast<int64_t>(cores.size());
    COMERA_CHECK_VALUE(D >= 2 && D <= COMERA_MAX_CORES, op, ": expected 2 to ",
                       COMERA_MAX_CORES, " cores, got ", D);
    COMERA_CHECK_VALUE(static_cast<int64_t>(gates.size()) == D - 1, op, ": expected ", D - 1,
                       " gates, got ", gates.size());
    c.cores = std::move(cores);
    c.gates = std::move(gates);
    make_contiguous(c.cores);
    make_contiguous(c.gates);
    c.dtype = c.cores[0].scalar_type();
    c.device = c.cores[0].device();
    check_dtype(c.dtype, c.device, op);
    describe_cores(op, c);
    fill_embedding_desc(c, num_embeddings, embedding_dim, padding_idx);
    prepare_table(op, c, reuse);
    c.batch = make_embedding_batch(op, indices, offsets, mode, c.device);
    c.psw = check_per_sample_weights(op, psw, c.batch, c.dtype, c.device);
    if (is_cpu(c.device)) check_batch_values(op, c);
    return c;
}

// grad_out of the backward, against the call's output shape.
inline Tensor check_grad_out(const char *op, const EmbeddingCall &c, const Tensor &grad) {
    int64_t rows = c.batch.output_rows(), dim = c.d.embedding_dim;
    COMERA_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == rows && grad.size(1) == dim, op,
                       ": grad_out must have shape (", rows, ", ", dim, "), got ",
                       shape_text(grad));
    COMERA_CHECK_TYPE(grad.scalar_type() == c.dtype, op, ": grad_out must be ", c.dtype,
                      ", got ", grad.scalar_type());
    const Device gd = grad.device();
    COMERA_CHECK_VALUE(gd == c.device, op, ": grad_out is on ", device_name(gd),
                       " but the cores are on ", device_name(c.device));
    return as_contiguous(grad);
}

// ---- CPU kernels (cpu_f32.c, cpu_f64.c)

template <typename T>
int forward_cpu(const EmbeddingCall &c, const Tensor &out) {
    auto cores = data_ptrs<T>(c.cores), gates = data_ptrs<T>(c.gates);
    const T *psw = c.psw ? ptr<T>(*c.psw) : nullptr;
    int nt = num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_tt_embedding_fwd_f32(&c.prep, &c.batch.b, psw, cores.data(), gates.data(),
                                           ptr<T>(out), nt);
    else
        return comera_tt_embedding_fwd_f64(&c.prep, &c.batch.b, psw, cores.data(), gates.data(),
                                           ptr<T>(out), nt);
}

template <typename T>
int backward_cpu(const EmbeddingCall &c, const Tensor &grad, const std::vector<Tensor> &gcores,
                 const std::vector<Tensor> &ggates) {
    auto cores = data_ptrs<T>(c.cores), gates = data_ptrs<T>(c.gates);
    auto dc = mutable_data_ptrs<T>(gcores), dg = mutable_data_ptrs<T>(ggates);
    const T *psw = c.psw ? ptr<T>(*c.psw) : nullptr;
    int nt = num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_tt_embedding_bwd_f32(&c.prep, &c.batch.b, psw, ptr<T>(grad), cores.data(),
                                           gates.data(), dc.data(), dg.data(), nt);
    else
        return comera_tt_embedding_bwd_f64(&c.prep, &c.batch.b, psw, ptr<T>(grad), cores.data(),
                                           gates.data(), dc.data(), dg.data(), nt);
}

// ---- CUDA launchers (cuda.cu, cuda_bwd.cu)

#ifdef COMERA_WITH_CUDA
Tensor cuda_workspace(const char *op, const EmbeddingCall &c, int backward) {
    size_t bytes = 0;
    int rc = comera_tt_embedding_cuda_workspace(&c.prep, &c.batch.b, dtype_code(c.dtype),
                                                backward, &bytes);
    check_status(rc, op);
    return empty({static_cast<int64_t>(bytes)}, ScalarType::Byte, c.device);
}

int forward_cuda(const char *op, const EmbeddingCall &c, const Tensor &out) {
    Tensor ws = cuda_workspace(op, c, 0);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    return comera_tt_embedding_fwd_cuda(&c.prep, &c.batch.b, dtype_code(c.dtype),
                                        c.psw ? c.psw->data_ptr() : nullptr, cp.data(),
                                        gp.data(), out.data_ptr(), ws.data_ptr(),
                                        static_cast<size_t>(ws.numel()),
                                        current_stream(c.device));
}

int backward_cuda(const char *op, const EmbeddingCall &c, const Tensor &grad,
                  const std::vector<Tensor> &gcores, const std::vector<Tensor> &ggates) {
    Tensor ws = cuda_workspace(op, c, 1);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    auto dc = mutable_data_ptrs<void>(gcores), dg = mutable_data_ptrs<void>(ggates);
    return comera_tt_embedding_bwd_cuda(&c.prep, &c.batch.b, dtype_code(c.dtype),
                                        c.psw ? c.psw->data_ptr() : nullptr, grad.data_ptr(),
                                        cp.data(), gp.data(), dc.data(), dg.data(),
                                        ws.data_ptr(), static_cast<size_t>(ws.numel()),
                                        current_stream(c.device));
}
#else
// A build without CUDA registers no CUDA kernels, so these are never reached.
int forward_cuda(const char *, const EmbeddingCall &, const Tensor &) { return COMERA_ERR_ARG; }
int backward_cuda(const char *, const EmbeddingCall &, const Tensor &, const std::vector<Tensor> &,
                  const std::vector<Tensor> &) {
    return COMERA_ERR_ARG;
}
#endif

// ---- the ops

Tensor tt_embedding(Tensor indices, std::optional<Tensor> offsets, std::optional<Tensor> psw,
                    std::vector<Tensor> cores, std::vector<Tensor> gates, int64_t num_embeddings,
                    int64_t embedding_dim, int64_t padding_idx, int64_t mode, int64_t reuse) {
    const char *op = "comera::tt_embedding";
    EmbeddingCall c = prepare_embedding(op, std::move(cores), std::move(gates), num_embeddings,
                                        embedding_dim, padding_idx, reuse, indices, offsets, mode,
                                        psw);
    Tensor out = empty({c.batch.output_rows(), embedding_dim}, c.dtype, c.device);
    int rc = is_cuda(c.device) ? forward_cuda(op, c, out)
             : c.dtype == ScalarType::Float ? forward_cpu<float>(c, out)
                                            : forward_cpu<double>(c, out);
    check_status(rc, op);
    return out;
}

std::tuple<std::vector<Tensor>, std::vector<Tensor>> tt_embedding_backward(
    Tensor grad_out, Tensor indices, std::optional<Tensor> offsets, std::optional<Tensor> psw,
    std::vector<Tensor> cores, std::vector<Tensor> gates, int64_t num_embeddings,
    int64_t embedding_dim, int64_t padding_idx, int64_t mode, int64_t reuse) {
    const char *op = "comera::tt_embedding_backward";
    EmbeddingCall c = prepare_embedding(op, std::move(cores), std::move(gates), num_embeddings,
                                        embedding_dim, padding_idx, reuse, indices, offsets, mode,
                                        psw);
    Tensor grad = check_grad_out(op, c, grad_out);
    std::vector<Tensor> gcores = empty_like_all(c.cores), ggates = empty_like_all(c.gates);
    int rc = is_cuda(c.device) ? backward_cuda(op, c, grad, gcores, ggates)
             : c.dtype == ScalarType::Float ? backward_cpu<float>(c, grad, gcores, ggates)
                                            : backward_cpu<double>(c, grad, gcores, ggates);
    check_status(rc, op);
    return {gcores, ggates};
}

// An inspection op that returns host numbers: device indices are copied to
// the CPU and planned there.
Tensor tt_embedding_plan(Tensor indices_in, std::optional<Tensor> offsets_in,
                         std::vector<int64_t> row_modes, std::vector<int64_t> dim_modes,
                         std::vector<int64_t> ranks, int64_t num_embeddings,
                         int64_t embedding_dim, int64_t padding_idx, int64_t mode) {
    const char *op = "comera::tt_embedding_plan";
    auto on_cpu = [](const Tensor &t) { return t.is_cpu() ? t : torch::stable::to(t, kCpu); };
    const Tensor indices = on_cpu(indices_in);
    std::optional<Tensor> offsets;
    if (offsets_in.has_value()) offsets = on_cpu(*offsets_in);
    int64_t D = static_cast<int64_t>(row_modes.size());
    COMERA_CHECK_VALUE(static_cast<int64_t>(dim_modes.size()) == D &&
                           static_cast<int64_t>(ranks.size()) == D + 1,
                       op, ": need as many dim modes as row modes and one more rank");
    COMERA_CHECK_VALUE(D >= 2 && D <= COMERA_MAX_CORES, op, ": expected 2 to ",
                       COMERA_MAX_CORES, " row modes, got ", D);
    EmbeddingCall c;
    c.num_cores = D;
    std::copy(row_modes.begin(), row_modes.end(), c.row_modes);
    std::copy(dim_modes.begin(), dim_modes.end(), c.dim_modes);
    std::copy(ranks.begin(), ranks.end(), c.ranks);
    fill_embedding_desc(c, num_embeddings, embedding_dim, padding_idx);
    prepare_table(op, c, COMERA_REUSE_AUTO);
    c.batch = make_embedding_batch(op, indices, offsets, mode, kCpu);
    check_batch_values(op, c);
    comera_tt_embedding_plan plan;
    check_status(comera_tt_embedding_make_plan(&c.d, &c.batch.b, &plan), op);
    // [reuse, rows, unique, flops x3 (none, dedup, prefix), seconds x3, prefixes x D]
    Tensor out = empty({9 + D}, ScalarType::Double, kCpu);
    double *o = ptr<double>(out);
    o[0] = plan.reuse;
    o[1] = static_cast<double>(plan.rows);
    o[2] = static_cast<double>(plan.unique);
    for (int r = 1; r <= 3; r++) {
        o[2 + r] = plan.flops[r];
        o[5 + r] = plan.seconds[r];
    }
    for (int64_t k = 0; k < D; k++) o[9 + k] = static_cast<double>(plan.prefixes[k]);
    return out;
}

}  // namespace

// comera._C (built without COMERA_WITH_CUDA) registers the CPU kernels;
// comera._C_cuda (this file compiled with it, csrc/cuda_module.cpp)
// registers the CUDA ones: each kernel is registered once.
#ifndef COMERA_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(comera, CPU, m) {
    m.impl("tt_embedding", TORCH_BOX(&tt_embedding));
    m.impl("tt_embedding_backward", TORCH_BOX(&tt_embedding_backward));
    m.impl("tt_embedding_plan", TORCH_BOX(&tt_embedding_plan));
}
#else
STABLE_TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("tt_embedding", TORCH_BOX(&tt_embedding));
    m.impl("tt_embedding_backward", TORCH_BOX(&tt_embedding_backward));
    m.impl("tt_embedding_plan", TORCH_BOX(&tt_embedding_plan));
}
#endif
