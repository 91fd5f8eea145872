// CUDA implementations of the tt_linear operators: argument checks, output
// and workspace allocation (torch's caching allocator), then a call into the
// CUDA launchers (csrc/cuda) on the current stream with torch's cuBLAS
// handle.  No host synchronisation, so both ops can be captured in a CUDA
// graph.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../tt_linear_desc.h"
#include "comera/cuda.h"

namespace {

using comera_glue::Desc;
using comera_glue::describe;

const char *cuda_error_text(int rc) {
    switch (rc) {
        case COMERA_ERR_CUDA: return "a CUDA kernel or copy failed to launch";
        case COMERA_ERR_CUBLAS: return "a cuBLAS call failed";
        case COMERA_ERR_WORKSPACE: return "workspace too small (internal error)";
        case COMERA_ERR_TOO_BIG: return "a dimension exceeds 2^31 - 1, cuBLAS's limit";
        default: return comera_glue::error_text(rc);
    }
}

int dtype_code(at::ScalarType t, const char *op) {
    switch (t) {
        case at::kFloat: return COMERA_DT_F32;
        case at::kDouble: return COMERA_DT_F64;
        case at::kBFloat16: return COMERA_DT_BF16;
        case at::kHalf: return COMERA_DT_F16;
        default:
            TORCH_CHECK(false, op, ": x must be float32, float64, bfloat16 or float16 on CUDA, got ",
                        t);
    }
    return -1;
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

std::vector<void *> mut_ptrs(std::vector<at::Tensor> &ts) {
    std::vector<void *> out;
    for (auto &t : ts) out.push_back(t.data_ptr());
    return out;
}

at::Tensor workspace(const Desc &desc, int64_t batch, int dt, bool has_bias, bool backward,
                     const at::Tensor &like, const char *op) {
    size_t bytes = 0;
    int rc = comera_tt_linear_cuda_workspace(&desc.d, batch, dt, has_bias, backward, &bytes);
    TORCH_CHECK(rc == COMERA_OK, op, ": ", cuda_error_text(rc));
    return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor> tt_linear_cuda(const at::Tensor &x_in, at::TensorList cores_in,
                                                  at::TensorList gates_in,
                                                  const std::optional<at::Tensor> &bias_in,
                                                  int64_t num_in, int64_t out_features,
                                                  int64_t path) {
    const char *op = "comera::tt_linear";
    int dt = dtype_code(x_in.scalar_type(), op);
    c10::cuda::CUDAGuard guard(x_in.device());
    at::Tensor x = x_in.contiguous();
    auto cores = contiguous_all(cores_in);
    auto gates = contiguous_all(gates_in);
    Desc desc = describe(x, cores, gates, num_in, out_features);
    TORCH_CHECK(path >= 0 && path <= 2, op, ": path must be 0 (auto), 1 (merge) or 2 (sequential), got ",
                path);
    at::Tensor bias;
    if (bias_in.has_value()) {
        bias = bias_in->contiguous();
        TORCH_CHECK(bias.dim() == 1 && bias.size(0) == out_features &&
                        bias.scalar_type() == x.scalar_type() && bias.device() == x.device(),
                    op, ": bias must be a (", out_features, ",) tensor of ", x.scalar_type(),
                    " on ", x.device());
    }
    int64_t batch = x.size(0);
    at::Tensor y = at::empty({batch, out_features}, x.options());
    at::Tensor t = at::empty({batch, desc.ranks[num_in]}, x.options());
    if (batch == 0) return {y, t};
    at::Tensor ws = workspace(desc, batch, dt, bias.defined(), false, x, op);
    auto c = ptrs(cores), g = ptrs(gates);
    int rc = comera_tt_linear_fwd_cuda(&desc.d, static_cast<int>(path), dt, batch, x.data_ptr(),
                                       c.data(), g.data(), bias.defined() ? bias.data_ptr() : nullptr,
                                       y.data_ptr(), t.data_ptr(), ws.data_ptr(),
                                       static_cast<size_t>(ws.numel()),
                                       at::cuda::getCurrentCUDABlasHandle(),
                                       at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(rc == COMERA_OK, op, ": ", cuda_error_text(rc));
    return {y, t};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
tt_linear_backward_cuda(const at::Tensor &grad_y_in, const at::Tensor &x_in, const at::Tensor &t_in,
                        at::TensorList cores_in, at::TensorList gates_in, bool has_bias,
                        bool needs_input_grad, int64_t num_in, int64_t out_features, int64_t path) {
    const char *op = "comera::tt_linear_backward";
    int dt = dtype_code(x_in.scalar_type(), op);
    c10::cuda::CUDAGuard guard(x_in.device());
    at::Tensor x = x_in.contiguous(), gy = grad_y_in.contiguous(), t = t_in.contiguous();
    auto cores = contiguous_all(cores_in);
    auto gates = contiguous_all(gates_in);
    Desc desc = describe(x, cores, gates, num_in, out_features);
    TORCH_CHECK(path >= 0 && path <= 2, op, ": path must be 0 (auto), 1 (merge) or 2 (sequential), got ",
                path);
    int64_t batch = x.size(0);
    TORCH_CHECK(gy.dim() == 2 && gy.size(0) == batch && gy.size(1) == out_features &&
                    gy.scalar_type() == x.scalar_type() && gy.device() == x.device(),
                op, ": grad_y must be (", batch, ", ", out_features, ") like x");
    TORCH_CHECK(t.dim() == 2 && t.size(0) == batch && t.size(1) == desc.ranks[num_in] &&
                    t.scalar_type() == x.scalar_type() && t.device() == x.device(),
                op, ": t must be (", batch, ", ", desc.ranks[num_in], ") like x");
    at::Tensor gx = needs_input_grad ? at::empty_like(x) : at::empty({0}, x.options());
    std::vector<at::Tensor> gcores, ggates;
    for (const auto &c : cores) gcores.push_back(at::empty_like(c));
    for (const auto &g : gates) ggates.push_back(at::empty_like(g));
    at::Tensor gb = has_bias ? at::empty({out_features}, x.options()) : at::empty({0}, x.options());
    at::Tensor ws = workspace(desc, batch, dt, has_bias, true, x, op);
    auto c = ptrs(cores), g = ptrs(gates);
    auto dc = mut_ptrs(gcores), dg = mut_ptrs(ggates);
    int rc = comera_tt_linear_bwd_cuda(
        &desc.d, static_cast<int>(path), dt, batch, gy.data_ptr(), x.data_ptr(), t.data_ptr(),
        c.data(), g.data(), needs_input_grad && batch > 0 ? gx.data_ptr() : nullptr, dc.data(),
        dg.data(), has_bias ? gb.data_ptr() : nullptr, ws.data_ptr(),
        static_cast<size_t>(ws.numel()), at::cuda::getCurrentCUDABlasHandle(),
        at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(rc == COMERA_OK, op, ": ", cuda_error_text(rc));
    return {gx, gcores, ggates, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("tt_linear", &tt_linear_cuda);
    m.impl("tt_linear_backward", &tt_linear_backward_cuda);
}
