// CUDA glue of the tt_linear operators (see op.cpp for the folder): the
// checks and the one prepare of describe.h, output and workspace allocation
// (torch's caching allocator), then a call into the CUDA launchers
// (cuda.cu) on the current stream with torch's cuBLAS handle.  No host
// synchronisation, so both ops can be captured in a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "comera/cuda.h"
#include "common/glue.h"
#include "tt_linear/describe.h"

namespace {

using namespace comera_glue;

int cuda_dtype(const char *op, const at::Tensor &x) {
    int dt = dtype_code(x.scalar_type());
    TORCH_CHECK(dt >= 0, op, ": x must be float32, float64, bfloat16 or float16 on CUDA, got ",
                x.scalar_type());
    return dt;
}

at::Tensor workspace(const char *op, const LinearCall &c, int dt, bool has_bias, bool backward) {
    size_t bytes = 0;
    int rc = comera_tt_linear_cuda_workspace(&c.prep, dt, has_bias, backward, &bytes);
    check_status(rc, op);
    return at::empty({static_cast<int64_t>(bytes)}, c.x.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor> tt_linear_cuda(const at::Tensor &x, at::TensorList cores,
                                                  at::TensorList gates,
                                                  const std::optional<at::Tensor> &bias_in,
                                                  int64_t num_in, int64_t out_features,
                                                  int64_t path) {
    const char *op = "comera::tt_linear";
    int dt = cuda_dtype(op, x);
    c10::cuda::CUDAGuard guard(x.device());
    LinearCall c = prepare_linear(op, x, cores, gates, num_in, out_features, path);
    at::Tensor bias = check_bias(op, c, bias_in);
    int64_t batch = c.x.size(0);
    at::Tensor y = at::empty({batch, out_features}, c.x.options());
    at::Tensor t = at::empty({batch, c.rmid()}, c.x.options());
    if (batch == 0) return {y, t};
    at::Tensor ws = workspace(op, c, dt, bias.defined(), false);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    int rc = comera_tt_linear_fwd_cuda(&c.prep, dt, c.x.data_ptr(), cp.data(), gp.data(),
                                       bias.defined() ? bias.data_ptr() : nullptr, y.data_ptr(),
                                       t.data_ptr(), ws.data_ptr(),
                                       static_cast<size_t>(ws.numel()),
                                       at::cuda::getCurrentCUDABlasHandle(),
                                       at::cuda::getCurrentCUDAStream());
    check_status(rc, op);
    return {y, t};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
tt_linear_backward_cuda(const at::Tensor &grad_y, const at::Tensor &x, const at::Tensor &t_in,
                        at::TensorList cores, at::TensorList gates, bool has_bias,
                        bool needs_input_grad, int64_t num_in, int64_t out_features, int64_t path) {
    const char *op = "comera::tt_linear_backward";
    int dt = cuda_dtype(op, x);
    c10::cuda::CUDAGuard guard(x.device());
    LinearCall c = prepare_linear(op, x, cores, gates, num_in, out_features, path);
    at::Tensor gy = grad_y.contiguous(), t = t_in.contiguous();
    check_backward_inputs(op, c, gy, t);
    LinearGrads g = empty_linear_grads(c, has_bias, needs_input_grad);
    at::Tensor ws = workspace(op, c, dt, has_bias, true);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    auto dc = mutable_data_ptrs<void>(g.gcores), dg = mutable_data_ptrs<void>(g.ggates);
    void *dx = needs_input_grad && c.prep.batch > 0 ? g.gx.data_ptr() : nullptr;
    int rc = comera_tt_linear_bwd_cuda(
        &c.prep, dt, gy.data_ptr(), c.x.data_ptr(), t.data_ptr(), cp.data(), gp.data(), dx,
        dc.data(), dg.data(), has_bias ? g.gb.data_ptr() : nullptr, ws.data_ptr(),
        static_cast<size_t>(ws.numel()), at::cuda::getCurrentCUDABlasHandle(),
        at::cuda::getCurrentCUDAStream());
    check_status(rc, op);
    return {g.gx, g.gcores, g.ggates, g.gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("tt_linear", &tt_linear_cuda);
    m.impl("tt_linear_backward", &tt_linear_backward_cuda);
}
