// CUDA implementations of the tt_embedding operators: argument checks on
// shapes, dtypes and devices, output and workspace allocation (torch's
// caching allocator), then a call into the launchers (csrc/cuda) on the
// current stream.  The index values are not read on the host (that would be
// a synchronisation, and would break CUDA graph capture): the Python wrapper
// checks them unless the layer is capturable; see comera/cuda.h for what the
// kernels do with bad ones.  tt_embedding_plan is an inspection op that
// returns host numbers: it copies the indices to the CPU and runs the C
// planner.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "comera/cuda.h"
#include "../tt_embedding_desc.h"

namespace {

using Desc = comera_glue::EmbeddingDesc;

struct Batch {
    at::Tensor indices, offsets;
    comera_tt_embedding_batch b{};
};

const char *error_text(int rc) {
    switch (rc) {
        case COMERA_ERR_ARG: return "invalid TT embedding arguments";
        case COMERA_ERR_OVERFLOW: return "TT embedding sizes overflow 64-bit integers";
        case COMERA_ERR_CUDA: return "a CUDA kernel or copy failed to launch";
        case COMERA_ERR_WORKSPACE: return "workspace too small (internal error)";
        default: return "unknown error in the TT embedding CUDA kernels";
    }
}

int dtype_code(at::ScalarType t, const char *op) {
    switch (t) {
        case at::kFloat: return COMERA_DT_F32;
        case at::kDouble: return COMERA_DT_F64;
        case at::kBFloat16: return COMERA_DT_BF16;
        case at::kHalf: return COMERA_DT_F16;
        default:
            TORCH_CHECK_TYPE(false, op, ": cores must be float32, float64, bfloat16 or float16 "
                             "on CUDA, got ", t);
    }
    return -1;
}

void check_cuda_dtype(at::ScalarType dtype, const char *op) { dtype_code(dtype, op); }

Desc describe(const char *op, const std::vector<at::Tensor> &cores,
              const std::vector<at::Tensor> &gates, int64_t num_embeddings,
              int64_t embedding_dim, int64_t padding_idx) {
    return comera_glue::describe_embedding(op, cores, gates, num_embeddings, embedding_dim,
                                           padding_idx, check_cuda_dtype);
}

at::Tensor as_int64(const char *op, const char *name, const at::Tensor &t,
                    const at::Device &device) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ", name,
                     " must be an int64 or int32 tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got ", t.dim(), "-D");
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(),
                      " but the cores are on ", device);
    return t.to(at::kLong).contiguous();
}

Batch make_batch(const char *op, const at::Tensor &indices,
                 const std::optional<at::Tensor> &offsets, int64_t mode,
                 const at::Device &device) {
    TORCH_CHECK_VALUE(mode >= COMERA_EMB_PLAIN && mode <= COMERA_EMB_MEAN, op,
                      ": mode must be 0 (plain), 1 (sum) or 2 (mean), got ", mode);
    Batch out;
    out.indices = as_int64(op, "indices", indices, device);
    out.b.mode = static_cast<int32_t>(mode);
    out.b.n = out.indices.numel();
    out.b.indices = out.indices.data_ptr<int64_t>();
    if (mode != COMERA_EMB_PLAIN) {
        TORCH_CHECK_VALUE(offsets.has_value(), op, ": bag modes need offsets");
        out.offsets = as_int64(op, "offsets", *offsets, device);
        TORCH_CHECK_VALUE(out.offsets.numel() >= 1, op,
                          ": offsets must have num_bags + 1 >= 1 entries, got none");
        out.b.num_bags = out.offsets.numel() - 1;
        out.b.offsets = out.offsets.data_ptr<int64_t>();
    } else {
        TORCH_CHECK_VALUE(!offsets.has_value(), op, ": offsets are only valid in bag modes");
    }
    return out;
}

at::Tensor check_psw(const char *op, const std::optional<at::Tensor> &psw, const Batch &batch,
                     at::ScalarType dtype, const at::Device &device) {
    if (!psw.has_value()) return at::Tensor();
    TORCH_CHECK_VALUE(batch.b.mode == COMERA_EMB_SUM, op,
                      ": per_sample_weights are only supported with mode 1 (sum), as in "
                      "nn.EmbeddingBag; got mode ", batch.b.mode);
    TORCH_CHECK_VALUE(psw->dim() == 1 && psw->size(0) == batch.b.n, op,
                      ": per_sample_weights must have shape (", batch.b.n, ",), got ",
                      psw->sizes());
    TORCH_CHECK_TYPE(psw->scalar_type() == dtype, op, ": per_sample_weights must be ", dtype,
                     ", got ", psw->scalar_type());
    TORCH_CHECK_VALUE(psw->device() == device, op, ": per_sample_weights is on ", psw->device(),
                      " but the cores are on ", device);
    return psw->contiguous();
}

std::vector<at::Tensor> contiguous_all(at::TensorList ts) {
    std::vector<at::Tensor> out;
    for (const auto &t : ts) out.push_back(t.contiguous());
    return out;
}

std::vector<const void *> ptrs(const std::vector<at::Tensor> &ts) {
    std::vector<const void *> out;
    for (const auto &t : ts) out.push_back(t.data_ptr());
    return out;
}

at::Tensor workspace(const comera_tt_embedding_desc &d, const comera_tt_embedding_batch &b,
                     int dt, int backward, const at::Device &device, const char *op) {
    size_t bytes = 0;
    int rc = comera_tt_embedding_cuda_workspace(&d, &b, dt, backward, &bytes);
    TORCH_CHECK(rc == COMERA_OK, op, ": ", error_text(rc));
    return at::empty({static_cast<int64_t>(bytes)},
                     at::TensorOptions().dtype(at::kByte).device(device));
}

at::Tensor tt_embedding_cuda(const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
                             const std::optional<at::Tensor> &psw_in, at::TensorList cores_in,
                             at::TensorList gates_in, int64_t num_embeddings,
                             int64_t embedding_dim, int64_t padding_idx, int64_t mode,
                             int64_t reuse) {
    const char *op = "comera::tt_embedding";
    auto cores = contiguous_all(cores_in);
    auto gates = contiguous_all(gates_in);
    TORCH_CHECK_VALUE(!cores.empty(), op, ": expected at least 2 cores, got none");
    const at::Device device = cores[0].device();
    c10::cuda::CUDAGuard guard(device);
    Desc desc = describe(op, cores, gates, num_embeddings, embedding_dim, padding_idx);
    TORCH_CHECK_VALUE(reuse >= COMERA_REUSE_AUTO && reuse <= COMERA_REUSE_PREFIX, op,
                      ": reuse must be 0 (auto), 1 (none), 2 (dedup) or 3 (prefix), got ", reuse);
    Batch batch = make_batch(op, indices, offsets, mode, device);
    const auto dtype = cores[0].scalar_type();
    const int dt = dtype_code(dtype, op);
    at::Tensor psw = check_psw(op, psw_in, batch, dtype, device);
    int64_t rows = mode == COMERA_EMB_PLAIN ? batch.b.n : batch.b.num_bags;
    at::Tensor out = at::empty({rows, embedding_dim}, cores[0].options());
    at::Tensor ws = workspace(desc.d, batch.b, dt, 0, device, op);
    auto c = ptrs(cores), g = ptrs(gates);
    int rc = comera_tt_embedding_fwd_cuda(&desc.d, &batch.b, dt,
                                          psw.defined() ? psw.data_ptr() : nullptr,
                                          static_cast<int>(reuse), c.data(), g.data(),
                                          out.data_ptr(), ws.data_ptr(),
                                          static_cast<size_t>(ws.numel()),
                                          at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(rc == COMERA_OK, op, ": ", error_text(rc));
    return out;
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> tt_embedding_backward_cuda(
    const at::Tensor &grad_in, const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
    const std::optional<at::Tensor> &psw_in, at::TensorList cores_in, at::TensorList gates_in,
    int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx, int64_t mode,
    int64_t reuse) {
    const char *op = "comera::tt_embedding_backward";
    auto cores = contiguous_all(cores_in);
    auto gates = contiguous_all(gates_in);
    TORCH_CHECK_VALUE(!cores.empty(), op, ": expected at least 2 cores, got none");
    const at::Device device = cores[0].device();
    c10::cuda::CUDAGuard guard(device);
    Desc desc = describe(op, cores, gates, num_embeddings, embedding_dim, padding_idx);
    TORCH_CHECK_VALUE(reuse >= COMERA_REUSE_AUTO && reuse <= COMERA_REUSE_PREFIX, op,
                      ": reuse must be 0 (auto), 1 (none), 2 (dedup) or 3 (prefix), got ", reuse);
    Batch batch = make_batch(op, indices, offsets, mode, device);
    const auto dtype = cores[0].scalar_type();
    const int dt = dtype_code(dtype, op);
    at::Tensor psw = check_psw(op, psw_in, batch, dtype, device);
    int64_t rows = mode == COMERA_EMB_PLAIN ? batch.b.n : batch.b.num_bags;
    at::Tensor grad = grad_in.contiguous();
    TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == rows && grad.size(1) == embedding_dim,
                      op, ": grad_out must have shape (", rows, ", ", embedding_dim, "), got ",
                      grad.sizes());
    TORCH_CHECK_TYPE(grad.scalar_type() == dtype, op, ": grad_out must be ", dtype, ", got ",
                     grad.scalar_type());
    TORCH_CHECK_VALUE(grad.device() == device, op, ": grad_out is on ", grad.device(),
                      " but the cores are on ", device);
    std::vector<at::Tensor> gcores, ggates;
    std::vector<void *> dc, dg;
    for (const auto &t : cores) gcores.push_back(at::empty_like(t));
    for (const auto &t : gates) ggates.push_back(at::empty_like(t));
    for (auto &t : gcores) dc.push_back(t.data_ptr());
    for (auto &t : ggates) dg.push_back(t.data_ptr());
    at::Tensor ws = workspace(desc.d, batch.b, dt, 1, device, op);
    auto c = ptrs(cores), g = ptrs(gates);
    int rc = comera_tt_embedding_bwd_cuda(&desc.d, &batch.b, dt,
                                          psw.defined() ? psw.data_ptr() : nullptr,
                                          static_cast<int>(reuse), grad.data_ptr(), c.data(),
                                          g.data(), dc.data(), dg.data(), ws.data_ptr(),
                                          static_cast<size_t>(ws.numel()),
                                          at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(rc == COMERA_OK, op, ": ", error_text(rc));
    return {gcores, ggates};
}

at::Tensor tt_embedding_plan_cuda(const at::Tensor &indices,
                                  const std::optional<at::Tensor> &offsets,
                                  at::IntArrayRef row_modes, at::IntArrayRef dim_modes,
                                  at::IntArrayRef ranks, int64_t num_embeddings,
                                  int64_t embedding_dim, int64_t padding_idx, int64_t mode) {
    static auto plan = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("comera::tt_embedding_plan", "")
                           .typed<at::Tensor(const at::Tensor &, const std::optional<at::Tensor> &,
                                             at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                             int64_t, int64_t, int64_t, int64_t)>();
    std::optional<at::Tensor> off;
    if (offsets.has_value()) off = offsets->cpu();
    return plan.call(indices.cpu(), off, row_modes, dim_modes, ranks, num_embeddings,
                     embedding_dim, padding_idx, mode);
}

}  // namespace

TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("tt_embedding", &tt_embedding_cuda);
    m.impl("tt_embedding_backward", &tt_embedding_backward_cuda);
    m.impl("tt_embedding_plan", &tt_embedding_plan_cuda);
}
