// tt_linear: the TT linear layer (docs/design.md section 2).  This folder
// holds the whole op: plan.c (checks, shape, planner, prepare), cpu_f32.c
// and cpu_f64.c (the C kernels, their shared body in cpu_impl.h), cuda.cu
// (the CUDA launchers), and this file, the torch glue for every device, on
// the LibTorch stable ABI (common/glue.h).
//
// Each op call: check the tensors and prepare once (prepare_linear), allocate
// the outputs, then call the kernel of the tensors' device: the C kernels
// (cpu_f32.c, cpu_f64.c, cpu_half.c) on the CPU, the CUDA launchers (cuda.cu) on torch's current stream
// with the extension's cuBLAS handle for that stream.  The CUDA path never
// synchronises with the host, so both ops can be captured in a CUDA graph.
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "comera/tt_linear.h"
#include "common/glue.h"

#ifdef COMERA_WITH_CUDA
#include "comera/cuda.h"
#endif

namespace {

using namespace comera_glue;

// One prepared call: contiguous inputs, the descriptor's arrays, the prep.
struct LinearCall {
    Tensor x;
    std::vector<Tensor> cores, gates;
    std::vector<int64_t> in_modes, out_modes, ranks;
    comera_tt_linear_desc d{};
    comera_tt_linear_prep prep{};
    ScalarType dtype;   // x's (and dx's)
    ScalarType act;     // y's, t's, dy's: dtype, but for set_types' pairs
    ScalarType param;   // the cores', gates' and bias's: dtype, but for set_types' pairs
    Device device;
    int32_t dtype_id;   // glue.h: cheap equality checks against x's
    int32_t act_id;
    int32_t param_id;
    int64_t device_id;
    LinearCall(const Tensor &x_in, std::vector<Tensor> &&cores_in, std::vector<Tensor> &&gates_in)
        : x(as_contiguous(x_in)),
          cores(std::move(cores_in)),
          gates(std::move(gates_in)),
          dtype(x_in.scalar_type()),
          act(dtype),
          param(dtype),
          device(x_in.device()),
          dtype_id(comera_glue::dtype_id(x_in)),
          act_id(dtype_id),
          param_id(dtype_id),
          device_id(comera_glue::device_id(x_in)) {
        make_contiguous(cores);
        make_contiguous(gates);
    }
    int64_t rmid() const { return ranks[d.num_in]; }
    bool like_act(const Tensor &t) const {
        return comera_glue::dtype_id(t) == act_id && comera_glue::device_id(t) == device_id;
    }
    bool like_param(const Tensor &t) const {
        return comera_glue::dtype_id(t) == param_id && comera_glue::device_id(t) == device_id;
    }
    bool half() const { return act == ScalarType::BFloat16 || act == ScalarType::Half; }
};

inline bool is_half(ScalarType t) { return t == ScalarType::BFloat16 || t == ScalarType::Half; }

// The CPU's 16-bit kernels also take a 16-bit x with float32 parameters, and
// a float32 x with 16-bit parameters (a float32 layer under autocast: its
// parameters as they are, or its float32 input as it is); y, t and dy are
// then of the 16-bit type.  Everywhere else x and the parameters share one
// dtype.
inline void set_types(const char *op, LinearCall &c) {
    if (c.cores.empty() || is_cuda(c.device)) return;
    const Tensor &core = c.cores[0];
    ScalarType pt = core.scalar_type();
    bool mixed = (is_half(c.dtype) && pt == ScalarType::Float) ||
                 (c.dtype == ScalarType::Float && is_half(pt));
    if (!mixed) return;
    COMERA_CHECK(comera_glue::device_id(core) == c.device_id, op,
                 ": core 0 must match x in dtype and device");
    c.param = pt;
    c.param_id = comera_glue::dtype_id(core);
    if (is_half(pt)) {
        c.act = pt;
        c.act_id = c.param_id;
    }
}

inline void describe_cores(const char *op, LinearCall &c, int64_t num_in) {
    int64_t D = static_cast<int64_t>(c.cores.size());
    COMERA_CHECK(num_in >= 1 && num_in < D, op, ": num_in_cores must be in [1, ", D - 1,
                 "], got ", num_in);
    COMERA_CHECK(D <= COMERA_MAX_CORES, op, ": at most ", COMERA_MAX_CORES, " cores, got ", D);
    COMERA_CHECK(static_cast<int64_t>(c.gates.size()) == D - 1, op, ": expected ", D - 1,
                 " gates, got ", c.gates.size());
    c.ranks.reserve(D + 1);
    c.ranks.push_back(1);
    for (int64_t k = 0; k < D; k++) {
        const Tensor &core = c.cores[k];
        const IntHeaderOnlyArrayRef cs = core.sizes();  // one shim call for dim and sizes
        COMERA_CHECK(cs.size() == 3, op, ": core ", k, " must be 3-D");
        COMERA_CHECK(cs[0] == c.ranks.back(), op, ": core ", k, " has left rank ", cs[0],
                     ", expected ", c.ranks.back());
        COMERA_CHECK(c.like_param(core), op, ": core ", k,
                     " must match x in dtype and device (on the CPU: or float32 with a 16-bit x, "
                     "or 16-bit with a float32 x, like every core)");
        (k < num_in ? c.in_modes : c.out_modes).push_back(cs[1]);
        c.ranks.push_back(cs[2]);
        if (k == D - 1) continue;
        const Tensor &g = c.gates[k];
        const IntHeaderOnlyArrayRef gs = g.sizes();
        COMERA_CHECK(gs.size() == 1 && gs[0] == cs[2], op, ": gate ", k, " must have shape (",
                     cs[2], ",)");
        COMERA_CHECK(c.like_param(g), op, ": gate ", k, " must match the cores in dtype and device");
    }
    COMERA_CHECK(c.ranks.back() == 1, op, ": last core must have right rank 1");
}

// float32, float64, bfloat16 or float16 on the CPU and on CUDA.
void check_dtype(const char *op, ScalarType dtype, const Device &) {
    COMERA_CHECK(dtype_code(dtype) >= 0, op,
                 ": x must be float32, float64, bfloat16 or float16, got ", dtype);
}

// Checks x (dtype for its device), the cores and gates and `path`, then
// prepares the call once.
inline LinearCall prepare_linear(const char *op, const Tensor &x, std::vector<Tensor> &&cores,
                                 std::vector<Tensor> &&gates, int64_t num_in,
                                 int64_t out_features, int64_t path) {
    check_dtype(op, x.scalar_type(), x.device());
    COMERA_CHECK(x.dim() == 2, op, ": x must be 2-D, got ", x.dim(), "-D");
    COMERA_CHECK(path >= COMERA_PATH_AUTO && path <= COMERA_PATH_SEQUENTIAL, op,
                 ": path must be 0 (auto), 1 (merge) or 2 (sequential), got ", path);
    LinearCall c(x, std::move(cores), std::move(gates));
    set_types(op, c);
    describe_cores(op, c, num_in);
    c.d.num_in = static_cast<int32_t>(num_in);
    c.d.num_out = static_cast<int32_t>(c.cores.size() - num_in);
    c.d.in_modes = c.in_modes.data();
    c.d.out_modes = c.out_modes.data();
    c.d.ranks = c.ranks.data();
    c.d.in_features = c.x.size(1);
    c.d.out_features = out_features;
    int rc = comera_tt_linear_prepare(&c.d, c.x.size(0), static_cast<int>(path), &c.prep);
    check_status(rc, op, [&](int) {
        return str(" (in_features ", c.d.in_features, ", out_features ", out_features, ")");
    });
    return c;
}

inline std::optional<Tensor> check_bias(const char *op, const LinearCall &c,
                                        const std::optional<Tensor> &bias) {
    if (!bias.has_value()) return std::nullopt;
    int64_t out = c.d.out_features;
    COMERA_CHECK(bias->dim() == 1 && bias->size(0) == out && c.like_param(*bias),
                 op, ": bias must be a (", out, ",) tensor of ", c.param, " on ",
                 device_name(c.device));
    return as_contiguous(*bias);
}

// grad_y and t of the backward, against the prepared call.
inline void check_backward_inputs(const char *op, const LinearCall &c, const Tensor &gy,
                                  const Tensor &t) {
    int64_t batch = c.x.size(0), out = c.d.out_features;
    COMERA_CHECK(gy.dim() == 2 && gy.size(0) == batch && gy.size(1) == out && c.like_act(gy),
                 op, ": grad_y must be (", batch, ", ", out, ") of ", c.act, " like y");
    COMERA_CHECK(t.dim() == 2 && t.size(0) == batch && t.size(1) == c.rmid() && c.like_act(t),
                 op, ": t must be (", batch, ", ", c.rmid(), ") of ", c.act, " like y");
}

// The backward's outputs: grad_x (empty when not needed), per-core and
// per-gate gradients, grad_bias (empty without a bias).
struct LinearGrads {
    Tensor gx, gb;
    std::vector<Tensor> gcores, ggates;
};

inline LinearGrads empty_linear_grads(const LinearCall &c, bool has_bias, bool needs_input_grad) {
    return LinearGrads{
        needs_input_grad ? empty({c.x.size(0), c.x.size(1)}, c.dtype, c.device)
                         : empty({0}, c.dtype, c.device),
        empty({has_bias ? c.d.out_features : 0}, c.param, c.device),
        empty_like_all(c.cores),
        empty_like_all(c.gates),
    };
}

// ---- CPU kernels (cpu_f32.c, cpu_f64.c)

template <typename T>
int forward_cpu(const LinearCall &c, const std::optional<Tensor> &bias, const Tensor &y,
                const Tensor &t) {
    auto cores = data_ptrs<T>(c.cores), gates = data_ptrs<T>(c.gates);
    const T *x = ptr<T>(c.x), *b = bias ? ptr<T>(*bias) : nullptr;
    int nt = num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_tt_linear_fwd_f32(&c.prep, x, cores.data(), gates.data(), b, ptr<T>(y),
                                        ptr<T>(t), nt);
    else
        return comera_tt_linear_fwd_f64(&c.prep, x, cores.data(), gates.data(), b, ptr<T>(y),
                                        ptr<T>(t), nt);
}

template <typename T>
int backward_cpu(const LinearCall &c, const Tensor &gy, const Tensor &t, LinearGrads &g,
                 bool has_bias, bool needs_input_grad) {
    auto cores = data_ptrs<T>(c.cores), gates = data_ptrs<T>(c.gates);
    auto dc = mutable_data_ptrs<T>(g.gcores), dg = mutable_data_ptrs<T>(g.ggates);
    T *dx = needs_input_grad ? ptr<T>(g.gx) : nullptr;
    T *db = has_bias ? ptr<T>(g.gb) : nullptr;
    int nt = num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_tt_linear_bwd_f32(&c.prep, ptr<T>(gy), ptr<T>(c.x), ptr<T>(t),
                                        cores.data(), gates.data(), dx, dc.data(), dg.data(), db,
                                        nt);
    else
        return comera_tt_linear_bwd_f64(&c.prep, ptr<T>(gy), ptr<T>(c.x), ptr<T>(t),
                                        cores.data(), gates.data(), dx, dc.data(), dg.data(), db,
                                        nt);
}

// bfloat16 and float16 (cpu_half.c), x and the parameters of their own types
comera_tt_half_types half_types(const LinearCall &c) {
    return {dtype_code(c.act), dtype_code(c.dtype), dtype_code(c.param)};
}

int forward_cpu_half(const LinearCall &c, const std::optional<Tensor> &bias, const Tensor &y,
                     const Tensor &t) {
    auto cores = data_ptrs<void>(c.cores), gates = data_ptrs<void>(c.gates);
    comera_tt_half_types ty = half_types(c);
    return comera_tt_linear_fwd_half(&c.prep, &ty, c.x.data_ptr(), cores.data(), gates.data(),
                                     bias ? bias->data_ptr() : nullptr, y.data_ptr(),
                                     t.data_ptr(), num_threads());
}

int backward_cpu_half(const LinearCall &c, const Tensor &gy, const Tensor &t, LinearGrads &g,
                      bool has_bias, bool needs_input_grad) {
    auto cores = data_ptrs<void>(c.cores), gates = data_ptrs<void>(c.gates);
    auto dc = mutable_data_ptrs<void>(g.gcores), dg = mutable_data_ptrs<void>(g.ggates);
    comera_tt_half_types ty = half_types(c);
    return comera_tt_linear_bwd_half(
        &c.prep, &ty, gy.data_ptr(), c.x.data_ptr(), t.data_ptr(), cores.data(), gates.data(),
        needs_input_grad ? g.gx.data_ptr() : nullptr, dc.data(), dg.data(),
        has_bias ? g.gb.data_ptr() : nullptr, num_threads());
}

// ---- CUDA launchers (cuda.cu)

#ifdef COMERA_WITH_CUDA
// Workspace from torch's caching allocator (stable aten::empty), sized by
// the launcher.
Tensor cuda_workspace(const char *op, const LinearCall &c, bool has_bias, bool backward) {
    size_t bytes = 0;
    int rc = comera_tt_linear_cuda_workspace(&c.prep, dtype_code(c.dtype), has_bias, backward,
                                             &bytes);
    check_status(rc, op);
    return empty({static_cast<int64_t>(bytes)}, ScalarType::Byte, c.device);
}

int forward_cuda(const char *op, const LinearCall &c, const std::optional<Tensor> &bias,
                 const Tensor &y, const Tensor &t) {
    Tensor ws = cuda_workspace(op, c, bias.has_value(), false);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    cudaStream_t stream = current_stream(c.device);
    return comera_tt_linear_fwd_cuda(
        &c.prep, dtype_code(c.dtype), c.x.data_ptr(), cp.data(), gp.data(),
        bias ? bias->data_ptr() : nullptr, y.data_ptr(), t.data_ptr(), ws.data_ptr(),
        static_cast<size_t>(ws.numel()), cublas_handle(c.device, stream), stream);
}

int backward_cuda(const char *op, const LinearCall &c, const Tensor &gy, const Tensor &t,
                  LinearGrads &g, bool has_bias, bool needs_input_grad) {
    Tensor ws = cuda_workspace(op, c, has_bias, true);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    auto dc = mutable_data_ptrs<void>(g.gcores), dg = mutable_data_ptrs<void>(g.ggates);
    void *dx = needs_input_grad && c.prep.batch > 0 ? g.gx.data_ptr() : nullptr;
    cudaStream_t stream = current_stream(c.device);
    return comera_tt_linear_bwd_cuda(
        &c.prep, dtype_code(c.dtype), gy.data_ptr(), c.x.data_ptr(), t.data_ptr(), cp.data(),
        gp.data(), dx, dc.data(), dg.data(), has_bias ? g.gb.data_ptr() : nullptr,
        ws.data_ptr(), static_cast<size_t>(ws.numel()), cublas_handle(c.device, stream),
        stream);
}
#else
// A build without CUDA registers no CUDA kernels, so these are never reached.
int forward_cuda(const char *, const LinearCall &, const std::optional<Tensor> &, const Tensor &,
                 const Tensor &) {
    return COMERA_ERR_ARG;
}
int backward_cuda(const char *, const LinearCall &, const Tensor &, const Tensor &, LinearGrads &,
                  bool, bool) {
    return COMERA_ERR_ARG;
}
#endif

// ---- the ops

std::tuple<Tensor, Tensor> tt_linear(Tensor x, std::vector<Tensor> cores,
                                     std::vector<Tensor> gates, std::optional<Tensor> bias_in,
                                     int64_t num_in, int64_t out_features, int64_t path) {
    const char *op = "comera::tt_linear";
    CudaGuard guard(x.device());
    LinearCall c = prepare_linear(op, x, std::move(cores), std::move(gates), num_in, out_features,
                                  path);
    std::optional<Tensor> bias = check_bias(op, c, bias_in);
    int64_t batch = c.x.size(0);
    Tensor y = empty({batch, out_features}, c.act, c.device);
    Tensor t = empty({batch, c.rmid()}, c.act, c.device);
    if (batch == 0) return {y, t};
    int rc = is_cuda(c.device)                ? forward_cuda(op, c, bias, y, t)
             : c.half()                       ? forward_cpu_half(c, bias, y, t)
             : c.dtype == ScalarType::Float   ? forward_cpu<float>(c, bias, y, t)
                                              : forward_cpu<double>(c, bias, y, t);
    check_status(rc, op);
    return {y, t};
}

std::tuple<Tensor, std::vector<Tensor>, std::vector<Tensor>, Tensor> tt_linear_backward(
    Tensor grad_y, Tensor x, Tensor t_in, std::vector<Tensor> cores, std::vector<Tensor> gates,
    bool has_bias, bool needs_input_grad, int64_t num_in, int64_t out_features, int64_t path) {
    const char *op = "comera::tt_linear_backward";
    CudaGuard guard(x.device());
    LinearCall c = prepare_linear(op, x, std::move(cores), std::move(gates), num_in, out_features,
                                  path);
    Tensor gy = as_contiguous(grad_y), t = as_contiguous(t_in);
    check_backward_inputs(op, c, gy, t);
    LinearGrads g = empty_linear_grads(c, has_bias, needs_input_grad);
    int rc = is_cuda(c.device) ? backward_cuda(op, c, gy, t, g, has_bias, needs_input_grad)
             : c.half()        ? backward_cpu_half(c, gy, t, g, has_bias, needs_input_grad)
             : c.dtype == ScalarType::Float
                 ? backward_cpu<float>(c, gy, t, g, has_bias, needs_input_grad)
                 : backward_cpu<double>(c, gy, t, g, has_bias, needs_input_grad);
    check_status(rc, op);
    return {g.gx, g.gcores, g.ggates, g.gb};
}

Tensor tt_linear_plan(std::vector<int64_t> in_modes, std::vector<int64_t> out_modes,
                      std::vector<int64_t> ranks, int64_t in_features, int64_t out_features,
                      int64_t batch, int64_t dtype, int64_t threads) {
    const char *op = "comera::tt_linear_plan";
    COMERA_CHECK(ranks.size() == in_modes.size() + out_modes.size() + 1, op,
                 ": ranks must have len(in_modes) + len(out_modes) + 1 entries");
    comera_tt_linear_desc d{};
    d.num_in = static_cast<int32_t>(in_modes.size());
    d.num_out = static_cast<int32_t>(out_modes.size());
    d.in_modes = in_modes.data();
    d.out_modes = out_modes.data();
    d.ranks = ranks.data();
    d.in_features = in_features;
    d.out_features = out_features;
    comera_tt_linear_plan plan;
    COMERA_CHECK(dtype >= COMERA_DT_F32 && dtype <= COMERA_DT_F16, op,
                 ": dtype must be a COMERA_DT_* code (0..3), got ", dtype);
    int nt = threads > 0 && threads < (1 << 20) ? static_cast<int>(threads) : 1;
    int rc = comera_tt_linear_plan_for(&d, batch, static_cast<int>(dtype), nt, &plan);
    check_status(rc, op, [&](int) {
        return str(": in_modes ", list_text(in_modes), ", out_modes ", list_text(out_modes),
                   ", ranks ", list_text(ranks), ", in_features ", in_features,
                   ", out_features ", out_features, " and batch ", batch,
                   rc == COMERA_ERR_OVERFLOW ? " give sizes that overflow int64" : "");
    });
    Tensor out = empty({10}, ScalarType::Double, Device(torch::headeronly::DeviceType::CPU));
    double *o = ptr<double>(out);
    o[0] = plan.path;
    for (int p = 1; p <= 2; p++) {
        o[3 * p - 2] = plan.flops[p];
        o[3 * p - 1] = plan.bytes[p];
        o[3 * p] = plan.seconds[p];
    }
    o[7] = plan.kernel;
    o[8] = plan.dtype;
    o[9] = plan.threads;
    return out;
}

}  // namespace

// comera._C (built without COMERA_WITH_CUDA) registers the CPU kernels;
// comera._C_cuda (this file compiled with it, csrc/cuda_module.cpp)
// registers the CUDA ones: each kernel is registered once.
#ifndef COMERA_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(comera, CPU, m) {
    m.impl("tt_linear", TORCH_BOX(&tt_linear));
    m.impl("tt_linear_backward", TORCH_BOX(&tt_linear_backward));
}

STABLE_TORCH_LIBRARY_IMPL(comera, CompositeExplicitAutograd, m) {
    m.impl("tt_linear_plan", TORCH_BOX(&tt_linear_plan));
}
#else
STABLE_TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("tt_linear", TORCH_BOX(&tt_linear));
    m.impl("tt_linear_backward", TORCH_BOX(&tt_linear_backward));
}
#endif
