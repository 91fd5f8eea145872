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
#include <optional>
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

// ---- comera::gate_step_: the whole gate step, one call (comera/gate_prox.h)

// The per-gate lists of gate_step_ besides gates and signs: grads (an empty
// tensor for a gate without a gradient) in the gates' dtype, saliency in
// float64, each a contiguous 1-D tensor of its gate's length on its device.
void check_step_lists(const char *op, const std::vector<Tensor> &gates,
                      const std::vector<Tensor> &grads, const std::vector<Tensor> &saliency) {
    const size_t n = gates.size();
    COMERA_CHECK(grads.size() == n && saliency.size() == n, op, ": got ", n, " gates, ",
                 grads.size(), " gradients and ", saliency.size(), " saliency vectors");
    if (n == 0) return;
    const int32_t dtype = dtype_id(gates[0]);
    const int64_t device = device_id(gates[0]);
    for (size_t k = 0; k < n; k++) {
        const Tensor &gr = grads[k], &sal = saliency[k];
        const int64_t len = gates[k].size(0);
        COMERA_CHECK(gr.numel() == 0 || (gr.dim() == 1 && gr.is_contiguous() &&
                                         gr.size(0) == len && dtype_id(gr) == dtype &&
                                         device_id(gr) == device),
                     op, ": grads[", k, "] must be empty (no gradient) or a contiguous 1-D ",
                     "tensor like gate ", k);
        COMERA_CHECK(sal.dim() == 1 && sal.is_contiguous() && sal.size(0) == len &&
                         sal.scalar_type() == ScalarType::Double && device_id(sal) == device,
                     op, ": saliency[", k, "] must be a contiguous float64 tensor of shape (",
                     len, ",) on the gates' device");
    }
}

// An optional tensor of gate_step_: `count` elements of `dtype` on `device`.
void check_optional(const char *op, const char *name, const std::optional<Tensor> &t,
                    ScalarType dtype, int64_t count, const Tensor &gate) {
    if (!t.has_value()) return;
    COMERA_CHECK(t->numel() == count && t->is_contiguous() && t->scalar_type() == dtype &&
                     device_id(*t) == device_id(gate),
                 op, ": ", name, " must be a contiguous tensor of ", count, " ", dtype,
                 " elements on ", device_name(gate.device()));
}

// The data of a bool flag tensor (nullptr when not given).
uint8_t *flag_ptr(const std::optional<Tensor> &t) {
    return t.has_value() ? static_cast<uint8_t *>(t->data_ptr()) : nullptr;
}

Tensor gate_step_(std::vector<Tensor> gates, std::vector<Tensor> signs, std::vector<Tensor> grads,
                  std::vector<Tensor> saliency, std::optional<Tensor> amount,
                  std::optional<Tensor> frozen, std::optional<Tensor> nan_seen,
                  std::optional<Tensor> nan_gates, double threshold, int64_t min_live,
                  bool kill) {
    const char *op = "comera::gate_step_";
    check_gates(op, gates, signs, threshold, min_live);
    check_step_lists(op, gates, grads, saliency);
    const int64_t n = static_cast<int64_t>(gates.size());
    COMERA_CHECK(nan_seen.has_value() == nan_gates.has_value(), op,
                 ": pass both nan_seen and nan_gates, or neither");
    if (n == 0) return empty({0}, ScalarType::Long, kCpu);
    const Device device = gates[0].device();
    const ScalarType dtype = gates[0].scalar_type();
    check_optional(op, "amount", amount, dtype, n, gates[0]);
    check_optional(op, "frozen", frozen, ScalarType::Bool, 1, gates[0]);
    check_optional(op, "nan_seen", nan_seen, ScalarType::Bool, 1, gates[0]);
    check_optional(op, "nan_gates", nan_gates, ScalarType::Bool, n, gates[0]);

    GateTables<void> t(gates, signs);
    std::vector<const void *> gp;
    bool any_grad = false;
    for (const Tensor &gr : grads) {
        gp.push_back(gr.numel() ? gr.data_ptr() : nullptr);
        any_grad = any_grad || gr.numel() > 0;
    }
    std::vector<double *> sp = mutable_data_ptrs<double>(saliency);
    Tensor live = empty({n}, ScalarType::Long, device);
    comera_gate_step_args a;
    a.num_gates = n;
    a.gates = t.gates.data();
    a.signs = t.signs.data();
    a.grads = any_grad ? gp.data() : nullptr;
    a.saliency = sp.data();
    a.sizes = t.sizes.data();
    a.amount = amount.has_value() ? amount->data_ptr() : nullptr;
    a.frozen = flag_ptr(frozen);
    a.nan_seen = flag_ptr(nan_seen);
    a.nan_gates = flag_ptr(nan_gates);
    a.live = ptr<int64_t>(live);
    a.threshold = threshold;
    a.min_live = min_live;
    a.kill = kill ? 1 : 0;
#ifdef COMERA_WITH_CUDA
    CudaGuard guard(device);
    if (is_cuda(device)) {
        check_status(comera_gate_step_cuda(dtype_code(dtype), &a, current_stream(device)), op);
        return live;
    }
#endif
    int rc = dtype == ScalarType::Float ? comera_gate_step_f32(&a, num_threads())
                                        : comera_gate_step_f64(&a, num_threads());
    // a NaN is reported through live (-1 per gate holding one), as by gate_prox_
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
    m.impl("gate_step_", TORCH_BOX(&gate_step_));
}
#else
STABLE_TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("gate_prox_", TORCH_BOX(&gate_prox_));
    m.impl("gate_step_", TORCH_BOX(&gate_step_));
}
#endif
