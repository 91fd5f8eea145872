// CPU implementations of the tt_linear operators: argument checks, output
// allocation, then a call into the C kernels (csrc/cpu).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "comera/tt_linear.h"
#include "tt_linear_desc.h"

namespace {

using comera_glue::Desc;
using comera_glue::describe;
using comera_glue::error_text;

template <typename T>
std::vector<const T *> data_ptrs(at::TensorList ts) {
    std::vector<const T *> out;
    for (const auto &t : ts) out.push_back(t.data_ptr<T>());
    return out;
}

std::vector<at::Tensor> contiguous_all(at::TensorList ts) {
    std::vector<at::Tensor> out;
    for (const auto &t : ts) out.push_back(t.contiguous());
    return out;
}

std::tuple<at::Tensor, at::Tensor> tt_linear_cpu(const at::Tensor &x_in, at::TensorList cores_in,
                                                 at::TensorList gates_in,
                                                 const std::optional<at::Tensor> &bias_in,
                                                 int64_t num_in, int64_t out_features,
                                                 int64_t path) {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kDouble,
                "comera::tt_linear: x must be float32 or float64, got ", x_in.scalar_type());
    at::Tensor x = x_in.contiguous();
    auto cores = contiguous_all(cores_in);
    auto gates = contiguous_all(gates_in);
    Desc desc = describe(x, cores, gates, num_in, out_features);
    at::Tensor bias;
    if (bias_in.has_value()) {
        bias = bias_in->contiguous();
        TORCH_CHECK(bias.dim() == 1 && bias.size(0) == out_features &&
                        bias.scalar_type() == x.scalar_type(),
                    "comera::tt_linear: bias must be a (", out_features, ",) tensor of ",
                    x.scalar_type());
    }
    int64_t batch = x.size(0);
    at::Tensor y = at::empty({batch, out_features}, x.options());
    at::Tensor t = at::empty({batch, desc.ranks[num_in]}, x.options());
    int nt = at::get_num_threads();
    int rc;
    if (x.scalar_type() == at::kFloat) {
        auto c = data_ptrs<float>(cores);
        auto g = data_ptrs<float>(gates);
        rc = comera_tt_linear_fwd_f32(&desc.d, static_cast<int>(path), batch, x.data_ptr<float>(),
                                      c.data(), g.data(),
                                      bias.defined() ? bias.data_ptr<float>() : nullptr,
                                      y.data_ptr<float>(), t.data_ptr<float>(), nt);
    } else {
        auto c = data_ptrs<double>(cores);
        auto g = data_ptrs<double>(gates);
        rc = comera_tt_linear_fwd_f64(&desc.d, static_cast<int>(path), batch,
                                      x.data_ptr<double>(), c.data(), g.data(),
                                      bias.defined() ? bias.data_ptr<double>() : nullptr,
                                      y.data_ptr<double>(), t.data_ptr<double>(), nt);
    }
    TORCH_CHECK(rc == COMERA_OK, "comera::tt_linear: ", error_text(rc));
    return {y, t};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
tt_linear_backward_cpu(const at::Tensor &grad_y_in, const at::Tensor &x_in, const at::Tensor &t_in,
                       at::TensorList cores_in, at::TensorList gates_in, bool has_bias,
                       bool needs_input_grad, int64_t num_in, int64_t out_features, int64_t path) {
    at::Tensor x = x_in.contiguous(), gy = grad_y_in.contiguous(), t = t_in.contiguous();
    auto cores = contiguous_all(cores_in);
    auto gates = contiguous_all(gates_in);
    Desc desc = describe(x, cores, gates, num_in, out_features);
    int64_t batch = x.size(0);
    TORCH_CHECK(gy.dim() == 2 && gy.size(0) == batch && gy.size(1) == out_features &&
                    gy.scalar_type() == x.scalar_type(),
                "comera::tt_linear_backward: grad_y must be (", batch, ", ", out_features, ")");
    TORCH_CHECK(t.dim() == 2 && t.size(0) == batch && t.size(1) == desc.ranks[num_in] &&
                    t.scalar_type() == x.scalar_type(),
                "comera::tt_linear_backward: t must be (", batch, ", ", desc.ranks[num_in], ")");
    at::Tensor gx = needs_input_grad ? at::empty_like(x) : at::empty({0}, x.options());
    std::vector<at::Tensor> gcores, ggates;
    for (const auto &c : cores) gcores.push_back(at::empty_like(c));
    for (const auto &g : gates) ggates.push_back(at::empty_like(g));
    at::Tensor gb = has_bias ? at::empty({out_features}, x.options()) : at::empty({0}, x.options());
    int nt = at::get_num_threads();
    int rc;
    if (x.scalar_type() == at::kFloat) {
        auto c = data_ptrs<float>(cores);
        auto g = data_ptrs<float>(gates);
        std::vector<float *> dc, dg;
        for (auto &v : gcores) dc.push_back(v.data_ptr<float>());
        for (auto &v : ggates) dg.push_back(v.data_ptr<float>());
        rc = comera_tt_linear_bwd_f32(&desc.d, static_cast<int>(path), batch, gy.data_ptr<float>(),
                                      x.data_ptr<float>(), t.data_ptr<float>(), c.data(), g.data(),
                                      needs_input_grad ? gx.data_ptr<float>() : nullptr, dc.data(),
                                      dg.data(), has_bias ? gb.data_ptr<float>() : nullptr, nt);
    } else {
        auto c = data_ptrs<double>(cores);
        auto g = data_ptrs<double>(gates);
        std::vector<double *> dc, dg;
        for (auto &v : gcores) dc.push_back(v.data_ptr<double>());
        for (auto &v : ggates) dg.push_back(v.data_ptr<double>());
        rc = comera_tt_linear_bwd_f64(&desc.d, static_cast<int>(path), batch,
                                      gy.data_ptr<double>(), x.data_ptr<double>(),
                                      t.data_ptr<double>(), c.data(), g.data(),
                                      needs_input_grad ? gx.data_ptr<double>() : nullptr,
                                      dc.data(), dg.data(),
                                      has_bias ? gb.data_ptr<double>() : nullptr, nt);
    }
    TORCH_CHECK(rc == COMERA_OK, "comera::tt_linear_backward: ", error_text(rc));
    return {gx, gcores, ggates, gb};
}

at::Tensor tt_linear_plan(at::IntArrayRef in_modes, at::IntArrayRef out_modes,
                          at::IntArrayRef ranks, int64_t in_features, int64_t out_features,
                          int64_t batch) {
    TORCH_CHECK(static_cast<int64_t>(ranks.size()) ==
                    static_cast<int64_t>(in_modes.size() + out_modes.size()) + 1,
                "comera::tt_linear_plan: ranks must have len(in_modes) + len(out_modes) + 1 "
                "entries");
    std::vector<int64_t> im(in_modes.begin(), in_modes.end());
    std::vector<int64_t> om(out_modes.begin(), out_modes.end());
    std::vector<int64_t> rk(ranks.begin(), ranks.end());
    comera_tt_linear_desc d{};
    d.num_in = static_cast<int32_t>(im.size());
    d.num_out = static_cast<int32_t>(om.size());
    d.in_modes = im.data();
    d.out_modes = om.data();
    d.ranks = rk.data();
    d.in_features = in_features;
    d.out_features = out_features;
    comera_tt_linear_plan plan;
    int rc = comera_tt_linear_make_plan(&d, batch, &plan);
    TORCH_CHECK(rc == COMERA_OK, "comera::tt_linear_plan: ", error_text(rc));
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
