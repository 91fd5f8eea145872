// gate_prox: the fused proximal step on TT gates (rank adaptation,
// docs/design.md section 4; the rule is in comera/gate_prox.h).  This folder
// holds cpu_f32.c and cpu_f64.c (the C kernel, its shared body in
// cpu_impl.h), cuda.cu (the CUDA launchers), and this file, the torch glue for every device, on the LibTorch
// stable ABI (common/glue.h): argument checks, then one call for all gates.
// On CUDA the gate and sign pointers reach the kernels as launch parameters
// and the live counts stay on the device (the op returns them on the gates'
// device): the call neither copies to the device nor waits for it, so rank
// adaptation can run without host synchronisation and inside CUDA graphs.
#include <cmath>
#include <type_traits>
#include <vector>

#include "comera/gate_prox.h"
#include "common/glue.h"

#ifdef COMERA_WITH_CUDA
#include "comera/cuda.h"
#endif

namespace {

using namespace comera_glue;

const Device kCpu(torch::headeronly::DeviceType::CPU);

// Gates of one dtype on one device, each with an int8 sign vector of its
// length.  float32/float64 on the CPU; CUDA also takes bfloat16 and float16.
void check_gates(const char *op, const std::vector<Tensor> &gates,
                 const std::vector<Tensor> &signs, double threshold, int64_t min_live) {
    const int64_t n = static_cast<int64_t>(gates.size());
    COMERA_CHECK(static_cast<int64_t>(signs.size()) == n, op, ": got ", n, " gates but ",
                 signs.size(), " sign vectors");
    COMERA_CHECK(!std::isnan(threshold), op, ": threshold must not be NaN");
    COMERA_CHECK(min_live >= 0, op, ": min_live must be >= 0, got ", min_live);
    if (n == 0) return;
    const ScalarType dtype = gates[0].scalar_type();
    const Device device = gates[0].device();
    if (is_cuda(device)) {
        COMERA_CHECK(dtype_code(dtype) >= 0, op,
                     ": gates must be float32, float64, bfloat16 or float16, got ", dtype);
    } else {
        COMERA_CHECK(dtype == ScalarType::Float || dtype == ScalarType::Double, op,
                     ": gates must be float32 or float64, got ", dtype);
    }
    for (int64_t k = 0; k < n; k++) {
        const Tensor &g = gates[k], &s = signs[k];
        COMERA_CHECK(g.dim() == 1 && g.is_contiguous() && g.device() == device &&
                         g.scalar_type() == dtype,
                     op, ": gate ", k, " must be a contiguous 1-D tensor of ", dtype, " on ",
                     device_name(device));
        COMERA_CHECK(s.dim() == 1 && s.is_contiguous() && s.device() == device &&
                         s.scalar_type() == ScalarType::Char && s.size(0) == g.size(0),
                     op, ": signs[", k, "] must be a contiguous int8 tensor of shape (",
                     g.size(0), ",) on ", device_name(device));
    }
}

// The tables the C ABI takes for the gates: their data pointers (T: the
// element type; void for the CUDA launcher), their sign vectors' and their
// lengths.
template <typename T>
struct GateTables {
    std::vector<T *> gates;
    std::vector<int8_t *> signs;
    std::vector<int64_t> sizes;

    GateTables(const std::vector<Tensor> &g, const std::vector<Tensor> &s)
        : gates(mutable_data_ptrs<T>(g)), signs(mutable_data_ptrs<int8_t>(s)) {
        for (const Tensor &t : g) sizes.push_back(t.size(0));
    }
    int64_t count() const { return static_cast<int64_t>(sizes.size()); }
};

template <typename T>
int prox_cpu(const std::vector<Tensor> &gates, const std::vector<Tensor> &signs,
             double threshold, int64_t min_live, bool kill, int64_t *live) {
    GateTables<T> t(gates, signs);
    int nt = num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_gate_prox_f32(t.count(), t.gates.data(), t.signs.data(), t.sizes.data(),
                                    threshold, min_live, kill ? 1 : 0, live, nt);
    else
        return comera_gate_prox_f64(t.count(), t.gates.data(), t.signs.data(), t.sizes.data(),
                                    threshold, min_live, kill ? 1 : 0, live, nt);
}

#ifdef COMERA_WITH_CUDA
// Pointers and sizes go by value (host arrays read at launch); live stays on the device.
Tensor prox_cuda(const std::vector<Tensor> &gates, const std::vector<Tensor> &signs,
                 double threshold, int64_t min_live, bool kill, int *rc) {
    GateTables<void> t(gates, signs);
    const Device device = gates[0].device();
    Tensor live = empty({t.count()}, ScalarType::Long, device);
    *rc = comera_gate_prox_cuda(dtype_code(gates[0].scalar_type()), t.count(), t.gates.data(),
                                t.signs.data(), t.sizes.data(), threshold, min_live,
                                kill ? 1 : 0, ptr<int64_t>(live), current_stream(device));
    return live;
}
#endif

Tensor gate_prox_(std::vector<Tensor> gates, std::vector<Tensor> signs, double threshold,
                  int64_t min_live, bool kill) {
    const char *op = "comera::gate_prox_";
    check_gates(op, gates, signs, threshold, min_live);
    const int64_t n = static_cast<int64_t>(gates.size());
    if (n == 0) return empty({0}, ScalarType::Long, kCpu);  // no gates: no device to name
#ifdef COMERA_WITH_CUDA
    const Device device = gates[0].device();
    CudaGuard guard(device);
    if (is_cuda(device)) {
        int rc = COMERA_OK;
        Tensor live = prox_cuda(gates, signs, threshold, min_live, kill, &rc);
        check_status(rc, op);
        return live;
    }
#endif
    Tensor live = empty({n}, ScalarType::Long, kCpu);
    int64_t *lp = ptr<int64_t>(live);
    int rc = gates[0].scalar_type() == ScalarType::Float
                 ? prox_cpu<float>(gates, signs, threshold, min_live, kill, lp)
                 : prox_cpu<double>(gates, signs, threshold, min_live, kill, lp);
    // COMERA_GATE_NAN is reported through live (-1 per gate holding a NaN) so
    // that Python can name the layer; only argument errors raise here.
    if (rc != COMERA_GATE_NAN) check_status(rc, op);
    return live;
}

}  // namespace

// comera._C (built without COMERA_WITH_CUDA) registers the CPU kernels;
// comera._C_cuda (this file compiled with it, csrc/cuda_module.cpp)
// registers the CUDA ones: each kernel is registered once.
#ifndef COMERA_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(comera, CPU, m) {
    m.impl("gate_prox_", TORCH_BOX(&gate_prox_));
}
#else
STABLE_TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("gate_prox_", TORCH_BOX(&gate_prox_));
}
#endif
