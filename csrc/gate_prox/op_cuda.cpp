// CUDA glue of comera::gate_prox_ (see op.cpp for the folder; the rule is
// in comera/gate_prox.h): argument checks, a device table of the
// gate and sign pointers, one launch pair for all gates.  The op returns the
// live counts as a CPU tensor, so it ends with one device-to-host copy.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "comera/cuda.h"
#include "common/glue.h"

namespace {

at::Tensor gate_prox_cuda(at::TensorList gates, at::TensorList signs, double threshold,
                          int64_t min_live, bool kill) {
    const char *op = "comera::gate_prox_";
    const int64_t n = static_cast<int64_t>(gates.size());
    TORCH_CHECK(static_cast<int64_t>(signs.size()) == n, op, ": got ", n, " gates but ",
                signs.size(), " sign vectors");
    TORCH_CHECK(!std::isnan(threshold), op, ": threshold must not be NaN");
    TORCH_CHECK(min_live >= 0, op, ": min_live must be >= 0, got ", min_live);
    if (n == 0) return at::empty({0}, at::TensorOptions().dtype(at::kLong));
    const at::ScalarType dtype = gates[0].scalar_type();
    const at::Device device = gates[0].device();
    int dt = comera_glue::dtype_code(dtype);
    TORCH_CHECK(dt >= 0, op, ": gates must be float32, float64, bfloat16 or float16, got ", dtype);
    c10::cuda::CUDAGuard guard(device);
    at::Tensor table = at::empty({3 * n}, at::TensorOptions().dtype(at::kLong));
    int64_t *tp = table.data_ptr<int64_t>();
    for (int64_t k = 0; k < n; k++) {
        const at::Tensor &g = gates[k], &s = signs[k];
        TORCH_CHECK(g.dim() == 1 && g.is_contiguous() && g.device() == device &&
                        g.scalar_type() == dtype,
                    op, ": gate ", k, " must be a contiguous 1-D tensor of ", dtype, " on ", device);
        TORCH_CHECK(s.dim() == 1 && s.is_contiguous() && s.device() == device &&
                        s.scalar_type() == at::kChar && s.size(0) == g.size(0),
                    op, ": signs[", k, "] must be a contiguous int8 tensor of shape (", g.size(0),
                    ",) on ", device);
        tp[k] = reinterpret_cast<int64_t>(g.data_ptr());
        tp[n + k] = reinterpret_cast<int64_t>(s.data_ptr());
        tp[2 * n + k] = g.size(0);
    }
    at::Tensor table_dev = table.to(device);
    at::Tensor live = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(device));
    int rc = comera_gate_prox_cuda(dt, n, table_dev.data_ptr<int64_t>(), threshold, min_live,
                                   kill ? 1 : 0, live.data_ptr<int64_t>(),
                                   at::cuda::getCurrentCUDAStream());
    comera_glue::check_status(rc, op);
    return live.to(at::kCPU);
}

}  // namespace

TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("gate_prox_", &gate_prox_cuda);
}
