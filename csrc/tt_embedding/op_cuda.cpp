// CUDA glue of the tt_embedding operators (see op.cpp for the folder): the
// checks and the one prepare of describe.h on shapes, dtypes and devices,
// output and workspace allocation (torch's caching allocator), then a call
// into the launchers (cuda.cu, cuda_bwd.cu) on the current stream.  The
// index values are not read on the host (that would be a synchronisation,
// and would break CUDA graph capture): the Python wrapper checks them unless
// the layer is capturable; see comera/cuda.h for what the kernels do with
// bad ones.  tt_embedding_plan is an inspection op that returns host
// numbers: it copies the indices to the CPU and runs the C planner.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "comera/cuda.h"
#include "common/glue.h"
#include "tt_embedding/describe.h"

namespace {

using namespace comera_glue;

void check_cuda_dtype(at::ScalarType dtype, const char *op) {
    TORCH_CHECK_TYPE(dtype_code(dtype) >= 0, op,
                     ": cores must be float32, float64, bfloat16 or float16 on CUDA, got ", dtype);
}

EmbeddingCall prepare_cuda(const char *op, const at::Tensor &indices,
                           const std::optional<at::Tensor> &offsets,
                           const std::optional<at::Tensor> &psw, at::TensorList cores,
                           at::TensorList gates, int64_t num_embeddings, int64_t embedding_dim,
                           int64_t padding_idx, int64_t mode, int64_t reuse) {
    return prepare_embedding(op, cores, gates, num_embeddings, embedding_dim, padding_idx, reuse,
                             indices, offsets, mode, psw, check_cuda_dtype);
}

at::Tensor workspace(const char *op, const EmbeddingCall &c, int backward) {
    size_t bytes = 0;
    int rc = comera_tt_embedding_cuda_workspace(&c.prep, &c.batch.b, dtype_code(c.dtype()),
                                                backward, &bytes);
    check_status(rc, op);
    return at::empty({static_cast<int64_t>(bytes)},
                     at::TensorOptions().dtype(at::kByte).device(c.device()));
}

at::Tensor tt_embedding_cuda(const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
                             const std::optional<at::Tensor> &psw, at::TensorList cores,
                             at::TensorList gates, int64_t num_embeddings,
                             int64_t embedding_dim, int64_t padding_idx, int64_t mode,
                             int64_t reuse) {
    const char *op = "comera::tt_embedding";
    TORCH_CHECK_VALUE(!cores.empty(), op, ": expected at least 2 cores, got none");
    c10::cuda::CUDAGuard guard(cores[0].device());
    EmbeddingCall c = prepare_cuda(op, indices, offsets, psw, cores, gates, num_embeddings,
                                   embedding_dim, padding_idx, mode, reuse);
    at::Tensor out = at::empty({c.batch.output_rows(), embedding_dim}, c.cores[0].options());
    at::Tensor ws = workspace(op, c, 0);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    int rc = comera_tt_embedding_fwd_cuda(&c.prep, &c.batch.b, dtype_code(c.dtype()),
                                          c.psw.defined() ? c.psw.data_ptr() : nullptr, cp.data(),
                                          gp.data(), out.data_ptr(), ws.data_ptr(),
                                          static_cast<size_t>(ws.numel()),
                                          at::cuda::getCurrentCUDAStream());
    check_status(rc, op);
    return out;
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> tt_embedding_backward_cuda(
    const at::Tensor &grad_out, const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
    const std::optional<at::Tensor> &psw, at::TensorList cores, at::TensorList gates,
    int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx, int64_t mode,
    int64_t reuse) {
    const char *op = "comera::tt_embedding_backward";
    TORCH_CHECK_VALUE(!cores.empty(), op, ": expected at least 2 cores, got none");
    c10::cuda::CUDAGuard guard(cores[0].device());
    EmbeddingCall c = prepare_cuda(op, indices, offsets, psw, cores, gates, num_embeddings,
                                   embedding_dim, padding_idx, mode, reuse);
    at::Tensor grad = check_grad_out(op, c, grad_out);
    std::vector<at::Tensor> gcores = empty_like_all(c.cores), ggates = empty_like_all(c.gates);
    auto dc = mutable_data_ptrs<void>(gcores), dg = mutable_data_ptrs<void>(ggates);
    at::Tensor ws = workspace(op, c, 1);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    int rc = comera_tt_embedding_bwd_cuda(&c.prep, &c.batch.b, dtype_code(c.dtype()),
                                          c.psw.defined() ? c.psw.data_ptr() : nullptr,
                                          grad.data_ptr(), cp.data(), gp.data(), dc.data(),
                                          dg.data(), ws.data_ptr(),
                                          static_cast<size_t>(ws.numel()),
                                          at::cuda::getCurrentCUDAStream());
    check_status(rc, op);
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
