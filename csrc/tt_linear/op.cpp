// tt_linear: the TT linear layer (docs/design.md section 2).  This folder
// holds the whole op: plan.c (checks, shape, planner, prepare), cpu.c (the
// C kernels, generic text in cpu_impl.h), cuda.cu (the CUDA launchers), and
// this file, the torch glue for every device.
//
// Each op call: check the tensors and prepare once (prepare_linear), allocate
// the outputs, then call the kernel of the tensors' device: the C kernels
// (cpu.c) on the CPU, the CUDA launchers (cuda.cu) on the current stream
// with torch's cuBLAS handle.  The CUDA path never synchronises with the
// host, so both ops can be captured in a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "comera/tt_linear.h"
#include "common/glue.h"

#ifdef COMERA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "comera/cuda.h"
#endif

namespace {

using namespace comera_glue;

// One prepared call: contiguous inputs, the descriptor's arrays, the prep.
struct LinearCall {
    at::Tensor x;
    std::vector<at::Tensor> cores, gates;
    std::vector<int64_t> in_modes, out_modes, ranks;
    comera_tt_linear_desc d{};
    comera_tt_linear_prep prep{};
    int64_t rmid() const { return ranks[d.num_in]; }
};

inline void describe_cores(const char *op, LinearCall &c, int64_t num_in) {
    const at::Tensor &x = c.x;
    int64_t D = static_cast<int64_t>(c.cores.size());
    TORCH_CHECK(num_in >= 1 && num_in < D, op, ": num_in_cores must be in [1, ", D - 1,
                "], got ", num_in);
    TORCH_CHECK(D <= COMERA_MAX_CORES, op, ": at most ", COMERA_MAX_CORES, " cores, got ", D);
    TORCH_CHECK(static_cast<int64_t>(c.gates.size()) == D - 1, op, ": expected ", D - 1,
                " gates, got ", c.gates.size());
    c.ranks.push_back(1);
    for (int64_t k = 0; k < D; k++) {
        const at::Tensor &core = c.cores[k];
        TORCH_CHECK(core.dim() == 3, op, ": core ", k, " must be 3-D");
        TORCH_CHECK(core.size(0) == c.ranks.back(), op, ": core ", k, " has left rank ",
                    core.size(0), ", expected ", c.ranks.back());
        TORCH_CHECK(core.scalar_type() == x.scalar_type() && core.device() == x.device(), op,
                    ": core ", k, " must match x in dtype and device");
        (k < num_in ? c.in_modes : c.out_modes).push_back(core.size(1));
        c.ranks.push_back(core.size(2));
        if (k == D - 1) continue;
        const at::Tensor &g = c.gates[k];
        TORCH_CHECK(g.dim() == 1 && g.size(0) == core.size(2), op, ": gate ", k,
                    " must have shape (", core.size(2), ",)");
        TORCH_CHECK(g.scalar_type() == x.scalar_type() && g.device() == x.device(), op,
                    ": gate ", k, " must match x in dtype and device");
    }
    TORCH_CHECK(c.ranks.back() == 1, op, ": last core must have right rank 1");
}

// Checks x, the cores and gates and `path`, then prepares the call once.
inline LinearCall prepare_linear(const char *op, const at::Tensor &x, at::TensorList cores,
                                 at::TensorList gates, int64_t num_in, int64_t out_features,
                                 int64_t path) {
    TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D, got ", x.dim(), "-D");
    TORCH_CHECK(path >= COMERA_PATH_AUTO && path <= COMERA_PATH_SEQUENTIAL, op,
                ": path must be 0 (auto), 1 (merge) or 2 (sequential), got ", path);
    LinearCall c;
    c.x = x.contiguous();
    c.cores = contiguous_all(cores);
    c.gates = contiguous_all(gates);
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
        return c10::str(" (in_features ", c.d.in_features, ", out_features ", out_features, ")");
    });
    return c;
}

inline at::Tensor check_bias(const char *op, const LinearCall &c,
                             const std::optional<at::Tensor> &bias) {
    if (!bias.has_value()) return at::Tensor();
    const at::Tensor &x = c.x;
    int64_t out = c.d.out_features;
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out &&
                    bias->scalar_type() == x.scalar_type() && bias->device() == x.device(),
                op, ": bias must be a (", out, ",) tensor of ", x.scalar_type(), " on ",
                x.device());
    return bias->contiguous();
}

// grad_y and t of the backward, against the prepared call.
inline void check_backward_inputs(const char *op, const LinearCall &c, const at::Tensor &gy,
                                  const at::Tensor &t) {
    const at::Tensor &x = c.x;
    int64_t batch = x.size(0), out = c.d.out_features;
    TORCH_CHECK(gy.dim() == 2 && gy.size(0) == batch && gy.size(1) == out &&
                    gy.scalar_type() == x.scalar_type() && gy.device() == x.device(),
                op, ": grad_y must be (", batch, ", ", out, ") like x");
    TORCH_CHECK(t.dim() == 2 && t.size(0) == batch && t.size(1) == c.rmid() &&
                    t.scalar_type() == x.scalar_type() && t.device() == x.device(),
                op, ": t must be (", batch, ", ", c.rmid(), ") like x");
}

// The backward's outputs: grad_x (empty when not needed), per-core and
// per-gate gradients, grad_bias (empty without a bias).
struct LinearGrads {
    at::Tensor gx, gb;
    std::vector<at::Tensor> gcores, ggates;
};

inline LinearGrads empty_linear_grads(const LinearCall &c, bool has_bias, bool needs_input_grad) {
    LinearGrads g;
    const auto opts = c.x.options();
    g.gx = needs_input_grad ? at::empty_like(c.x) : at::empty({0}, opts);
    g.gb = has_bias ? at::empty({c.d.out_features}, opts) : at::empty({0}, opts);
    g.gcores = empty_like_all(c.cores);
    g.ggates = empty_like_all(c.gates);
    return g;
}

// float32/float64 on the CPU; CUDA also takes bfloat16 and float16.
void check_dtype(const char *op, const at::Tensor &x) {
    if (x.is_cuda()) {
        TORCH_CHECK(dtype_code(x.scalar_type()) >= 0, op,
                    ": x must be float32, float64, bfloat16 or float16 on CUDA, got ",
                    x.scalar_type());
        return;
    }
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, op,
                ": x must be float32 or float64, got ", x.scalar_type());
}

// ---- CPU kernels (cpu.c)

template <typename T>
int forward_cpu(const LinearCall &c, const at::Tensor &bias, at::Tensor &y, at::Tensor &t) {
    auto cores = data_ptrs<T>(c.cores), gates = data_ptrs<T>(c.gates);
    const T *x = c.x.data_ptr<T>(), *b = bias.defined() ? bias.data_ptr<T>() : nullptr;
    int nt = at::get_num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_tt_linear_fwd_f32(&c.prep, x, cores.data(), gates.data(), b,
                                        y.data_ptr<T>(), t.data_ptr<T>(), nt);
    else
        return comera_tt_linear_fwd_f64(&c.prep, x, cores.data(), gates.data(), b,
                                        y.data_ptr<T>(), t.data_ptr<T>(), nt);
}

template <typename T>
int backward_cpu(const LinearCall &c, const at::Tensor &gy, const at::Tensor &t,
                 LinearGrads &g, bool has_bias, bool needs_input_grad) {
    auto cores = data_ptrs<T>(c.cores), gates = data_ptrs<T>(c.gates);
    auto dc = mutable_data_ptrs<T>(g.gcores), dg = mutable_data_ptrs<T>(g.ggates);
    T *dx = needs_input_grad ? g.gx.data_ptr<T>() : nullptr;
    T *db = has_bias ? g.gb.data_ptr<T>() : nullptr;
    int nt = at::get_num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_tt_linear_bwd_f32(&c.prep, gy.data_ptr<T>(), c.x.data_ptr<T>(),
                                        t.data_ptr<T>(), cores.data(), gates.data(), dx,
                                        dc.data(), dg.data(), db, nt);
    else
        return comera_tt_linear_bwd_f64(&c.prep, gy.data_ptr<T>(), c.x.data_ptr<T>(),
                                        t.data_ptr<T>(), cores.data(), gates.data(), dx,
                                        dc.data(), dg.data(), db, nt);
}

// ---- CUDA launchers (cuda.cu)

#ifdef COMERA_WITH_CUDA
// Workspace from torch's caching allocator, sized by the launcher.
at::Tensor cuda_workspace(const char *op, const LinearCall &c, bool has_bias, bool backward) {
    size_t bytes = 0;
    int rc = comera_tt_linear_cuda_workspace(&c.prep, dtype_code(c.x.scalar_type()), has_bias,
                                             backward, &bytes);
    check_status(rc, op);
    return at::empty({static_cast<int64_t>(bytes)}, c.x.options().dtype(at::kByte));
}

int forward_cuda(const char *op, const LinearCall &c, const at::Tensor &bias, at::Tensor &y,
                 at::Tensor &t) {
    at::Tensor ws = cuda_workspace(op, c, bias.defined(), false);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    return comera_tt_linear_fwd_cuda(
        &c.prep, dtype_code(c.x.scalar_type()), c.x.data_ptr(), cp.data(), gp.data(),
        bias.defined() ? bias.data_ptr() : nullptr, y.data_ptr(), t.data_ptr(), ws.data_ptr(),
        static_cast<size_t>(ws.numel()), at::cuda::getCurrentCUDABlasHandle(),
        at::cuda::getCurrentCUDAStream());
}

int backward_cuda(const char *op, const LinearCall &c, const at::Tensor &gy, const at::Tensor &t,
                  LinearGrads &g, bool has_bias, bool needs_input_grad) {
    at::Tensor ws = cuda_workspace(op, c, has_bias, true);
    auto cp = data_ptrs<void>(c.cores), gp = data_ptrs<void>(c.gates);
    auto dc = mutable_data_ptrs<void>(g.gcores), dg = mutable_data_ptrs<void>(g.ggates);
    void *dx = needs_input_grad && c.prep.batch > 0 ? g.gx.data_ptr() : nullptr;
    return comera_tt_linear_bwd_cuda(
        &c.prep, dtype_code(c.x.scalar_type()), gy.data_ptr(), c.x.data_ptr(), t.data_ptr(),
        cp.data(), gp.data(), dx, dc.data(), dg.data(), has_bias ? g.gb.data_ptr() : nullptr,
        ws.data_ptr(), static_cast<size_t>(ws.numel()), at::cuda::getCurrentCUDABlasHandle(),
        at::cuda::getCurrentCUDAStream());
}
#endif

// ---- the ops

std::tuple<at::Tensor, at::Tensor> tt_linear(const at::Tensor &x, at::TensorList cores,
                                             at::TensorList gates,
                                             const std::optional<at::Tensor> &bias_in,
                                             int64_t num_in, int64_t out_features, int64_t path) {
    const char *op = "comera::tt_linear";
    check_dtype(op, x);
    c10::OptionalDeviceGuard guard(x.device());
    LinearCall c = prepare_linear(op, x, cores, gates, num_in, out_features, path);
    at::Tensor bias = check_bias(op, c, bias_in);
    int64_t batch = c.x.size(0);
    at::Tensor y = at::empty({batch, out_features}, c.x.options());
    at::Tensor t = at::empty({batch, c.rmid()}, c.x.options());
    if (batch == 0) return {y, t};
    int rc;
#ifdef COMERA_WITH_CUDA
    if (c.x.is_cuda())
        rc = forward_cuda(op, c, bias, y, t);
    else
#endif
        rc = c.x.scalar_type() == at::kFloat ? forward_cpu<float>(c, bias, y, t)
                                             : forward_cpu<double>(c, bias, y, t);
    check_status(rc, op);
    return {y, t};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
tt_linear_backward(const at::Tensor &grad_y, const at::Tensor &x, const at::Tensor &t_in,
                   at::TensorList cores, at::TensorList gates, bool has_bias,
                   bool needs_input_grad, int64_t num_in, int64_t out_features, int64_t path) {
    const char *op = "comera::tt_linear_backward";
    check_dtype(op, x);
    c10::OptionalDeviceGuard guard(x.device());
    LinearCall c = prepare_linear(op, x, cores, gates, num_in, out_features, path);
    at::Tensor gy = grad_y.contiguous(), t = t_in.contiguous();
    check_backward_inputs(op, c, gy, t);
    LinearGrads g = empty_linear_grads(c, has_bias, needs_input_grad);
    int rc;
#ifdef COMERA_WITH_CUDA
    if (c.x.is_cuda())
        rc = backward_cuda(op, c, gy, t, g, has_bias, needs_input_grad);
    else
#endif
        rc = c.x.scalar_type() == at::kFloat
                 ? backward_cpu<float>(c, gy, t, g, has_bias, needs_input_grad)
                 : backward_cpu<double>(c, gy, t, g, has_bias, needs_input_grad);
    check_status(rc, op);
    return {g.gx, g.gcores, g.ggates, g.gb};
}

at::Tensor tt_linear_plan(at::IntArrayRef in_modes, at::IntArrayRef out_modes,
                          at::IntArrayRef ranks, int64_t in_features, int64_t out_features,
                          int64_t batch) {
    const char *op = "comera::tt_linear_plan";
    TORCH_CHECK(ranks.size() == in_modes.size() + out_modes.size() + 1, op,
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
    int rc = comera_tt_linear_make_plan(&d, batch, &plan);
    check_status(rc, op, [&](int) {
        return c10::str(": in_modes ", in_modes, ", out_modes ", out_modes, ", ranks ", ranks,
                        ", in_features ", in_features, ", out_features ", out_features,
                        " and batch ", batch, rc == COMERA_ERR_OVERFLOW ? " give sizes that overflow int64" : "");
    });
    at::Tensor out = at::empty({7}, at::TensorOptions().dtype(at::kDouble));
    double *o = out.data_ptr<double>();
    o[0] = plan.path;
    for (int p = 1; p <= 2; p++) {
        o[3 * p - 2] = plan.flops[p];
        o[3 * p - 1] = plan.bytes[p];
        o[3 * p] = plan.seconds[p];
    }
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(comera, CPU, m) {
    m.impl("tt_linear", &tt_linear);
    m.impl("tt_linear_backward", &tt_linear_backward);
}

#ifdef COMERA_WITH_CUDA
TORCH_LIBRARY_IMPL(comera, CUDA, m) {
    m.impl("tt_linear", &tt_linear);
    m.impl("tt_linear_backward", &tt_linear_backward);
}
#endif

TORCH_LIBRARY_IMPL(comera, CompositeExplicitAutograd, m) {
    m.impl("tt_linear_plan", &tt_linear_plan);
}
