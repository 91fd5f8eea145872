// gate_prox: the fused proximal step on TT gates (rank adaptation,
// docs/design.md section 4; the rule is in comera/gate_prox.h).  This folder
// holds cpu.c (the C kernel, generic text in cpu_impl.h), cuda.cu (the CUDA
// launchers), and this file, the torch glue for every device: argument
// checks, then one call for all gates.  On CUDA the gate and sign pointers
// go to the device as one table, and the live counts come back to the host
// (the op returns them as a CPU tensor).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "comera/gate_prox.h"
#include "common/glue.h"

#ifdef COMERA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "comera/cuda.h"
#endif

namespace {

using comera_glue::check_status;

// Gates of one dtype on one device, each with an int8 sign vector of its
// length.  float32/float64 on the CPU; CUDA also takes bfloat16 and float16.
void check_gates(const char *op, at::TensorList gates, at::TensorList signs, double threshold,
                 int64_t min_live) {
    const int64_t n = static_cast<int64_t>(gates.size());
    TORCH_CHECK(static_cast<int64_t>(signs.size()) == n, op, ": got ", n, " gates but ",
                signs.size(), " sign vectors");
    TORCH_CHECK(!std::isnan(threshold), op, ": threshold must not be NaN");
    TORCH_CHECK(min_live >= 0, op, ": min_live must be >= 0, got ", min_live);
    if (n == 0) return;
    const at::ScalarType dtype = gates[0].scalar_type();
    const at::Device device = gates[0].device();
    if (device.is_cuda()) {
        TORCH_CHECK(comera_glue::dtype_code(dtype) >= 0, op,
                    ": gates must be float32, float64, bfloat16 or float16, got ", dtype);
    } else {
        TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, op,
                    ": gates must be float32 or float64, got ", dtype);
    }
    for (int64_t k = 0; k < n; k++) {
        const at::Tensor &g = gates[k], &s = signs[k];
        TORCH_CHECK(g.dim() == 1 && g.is_contiguous() && g.device() == device &&
                        g.scalar_type() == dtype,
                    op, ": gate ", k, " must be a contiguous 1-D tensor of ", dtype, " on ",
                    device);
        TORCH_CHECK(s.dim() == 1 && s.is_contiguous() && s.device() == device &&
                        s.scalar_type() == at::kChar && s.size(0) == g.size(0),
                    op, ": signs[", k, "] must be a contiguous int8 tensor of shape (", g.size(0),
                    ",) on ", device);
    }
}

template <typename T>
int prox_cpu(at::TensorList gates, at::TensorList signs, double threshold, int64_t min_live,
             bool kill, int64_t *live) {
    const int64_t n = static_cast<int64_t>(gates.size());
    std::vector<T *> gp;
    std::vector<int8_t *> sp;
    std::vector<int64_t> sizes;
    for (int64_t k = 0; k < n; k++) {
        gp.push_back(gates[k].data_ptr<T>());
        sp.push_back(signs[k].data_ptr<int8_t>());
        sizes.push_back(gates[k].size(0));
    }
    int nt = at::get_num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_gate_prox_f32(n, gp.data(), sp.data(), sizes.data(), threshold, min_live,
                                    kill ? 1 : 0, live, nt);
    else
        return comera_gate_prox_f64(n, gp.data(), sp.data(), sizes.data(), threshold, min_live,
                                    kill ? 1 : 0, live, nt);
}

#ifdef COMERA_WITH_CUDA
// One launch pair for all gates; pointers and sizes travel as a device table.
at::Tensor prox_cuda(at::TensorList gates, at::TensorList signs, double threshold,
                     int64_t min_live, bool kill, int *rc) {
    const int64_t n = static_cast<int64_t>(gates.size());
    at::Tensor table = at::empty({3 * n}, at::TensorOptions().dtype(at::kLong));
    int64_t *tp = table.data_ptr<int64_t>();
    for (int64_t k = 0; k < n; k++) {
        tp[k] = reinterpret_cast<int64_t>(gates[k].data_ptr());
        tp[n + k] = reinterpret_cast<int64_t>(signs[k].data_ptr());
        tp[2 * n + k] = gates[k].size(0);
    }
    const at::Device device = gates[0].device();
    at::Tensor table_dev = table.to(device);
    at::Tensor live = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(device));
    *rc = comera_gate_prox_cuda(comera_glue::dtype_code(gates[0].scalar_type()), n,
                                table_dev.data_ptr<int64_t>(), threshold, min_live, kill ? 1 : 0,
                                live.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream());
    return live.to(at::kCPU);
}
#endif

at::Tensor gate_prox_(at::TensorList gates, at::TensorList signs, double threshold,
                      int64_t min_live, bool kill) {
    const char *op = "comera::gate_prox_";
    check_gates(op, gates, signs, threshold, min_live);
    const int64_t n = static_cast<int64_t>(gates.size());
    if (n == 0) return at::empty({0}, at::TensorOptions().dtype(at::kLong));
    c10::OptionalDeviceGuard guard(gates[0].device());
#ifdef COMERA_WITH_CUDA
    if (gates[0].is_cuda()) {
        int rc = COMERA_OK;
        at::Tensor live = prox_cuda(gates, signs, threshold, min_live, kill, &rc);
        check_status(rc, op);
        return live;
    }
#endif
    at::Tensor live = at::empty({n}, at::TensorOptions().dtype(at::kLong));
    int64_t *lp = live.data_ptr<int64_t>();
    int rc = gates[0].scalar_type() == at::kFloat
                 ? prox_cpu<float>(gates, signs, threshold, min_live, kill, lp)
                 : prox_cpu<double>(gates, signs, threshold, min_live, kill, lp);
    // COMERA_GATE_NAN is reported through live (-1 per gate holding a NaN) so
    // that Python can name the layer; only argument errors raise here.
    if (rc != COMERA_GATE_NAN) check_status(rc, op);
    return live;
}

}  // namespace

TORCH_LIBRARY_IMPL(comera, CPU, m) {
    m.impl("gate_prox_", &gate_prox_);
}

#ifdef COMERA_WITH_CUDA
TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("gate_prox_", &gate_prox_);
}
#endif
