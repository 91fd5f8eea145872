// tt_linear: the TT linear layer (docs/design.md section 2).  This folder
// holds the whole op: plan.c (checks, shape, planner, prepare), cpu.c (the
// C kernels, generic text in cpu_impl.h), cuda.cu (the CUDA launchers),
// describe.h (argument checks shared by the glue), and the torch glue: this
// file (CPU, and the planner op) and op_cuda.cpp (CUDA).
//
// CPU glue: argument checks and one prepare (describe.h), output
// allocation, then a call into the C kernels (cpu.c).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "comera/tt_linear.h"
#include "common/glue.h"
#include "tt_linear/describe.h"

namespace {

using namespace comera_glue;

void check_cpu_dtype(const char *op, const at::Tensor &x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, op,
                ": x must be float32 or float64, got ", x.scalar_type());
}

template <typename T>
int forward(const LinearCall &c, const at::Tensor &bias, at::Tensor &y, at::Tensor &t) {
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

std::tuple<at::Tensor, at::Tensor> tt_linear_cpu(const at::Tensor &x, at::TensorList cores,
                                                 at::TensorList gates,
                                                 const std::optional<at::Tensor> &bias_in,
                                                 int64_t num_in, int64_t out_features,
                                                 int64_t path) {
    const char *op = "comera::tt_linear";
    check_cpu_dtype(op, x);
    LinearCall c = prepare_linear(op, x, cores, gates, num_in, out_features, path);
    at::Tensor bias = check_bias(op, c, bias_in);
    int64_t batch = c.x.size(0);
    at::Tensor y = at::empty({batch, out_features}, c.x.options());
    at::Tensor t = at::empty({batch, c.rmid()}, c.x.options());
    int rc = c.x.scalar_type() == at::kFloat ? forward<float>(c, bias, y, t)
                                             : forward<double>(c, bias, y, t);
    check_status(rc, op);
    return {y, t};
}

template <typename T>
int backward(const LinearCall &c, const at::Tensor &gy, const at::Tensor &t, LinearGrads &g,
             bool has_bias, bool needs_input_grad) {
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

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
tt_linear_backward_cpu(const at::Tensor &grad_y, const at::Tensor &x, const at::Tensor &t_in,
                       at::TensorList cores, at::TensorList gates, bool has_bias,
                       bool needs_input_grad, int64_t num_in, int64_t out_features, int64_t path) {
    const char *op = "comera::tt_linear_backward";
    check_cpu_dtype(op, x);
    LinearCall c = prepare_linear(op, x, cores, gates, num_in, out_features, path);
    at::Tensor gy = grad_y.contiguous(), t = t_in.contiguous();
    check_backward_inputs(op, c, gy, t);
    LinearGrads g = empty_linear_grads(c, has_bias, needs_input_grad);
    int rc = c.x.scalar_type() == at::kFloat
                 ? backward<float>(c, gy, t, g, has_bias, needs_input_grad)
                 : backward<double>(c, gy, t, g, has_bias, needs_input_grad);
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
    m.impl("tt_linear", &tt_linear_cpu);
    m.impl("tt_linear_backward", &tt_linear_backward_cpu);
}

TORCH_LIBRARY_IMPL(comera, CompositeExplicitAutograd, m) {
    m.impl("tt_linear_plan", &tt_linear_plan);
}
