// Shared by the CPU and CUDA glue of comera::tt_linear (op.cpp, op_cuda.cpp):
// checks the tensors, builds the C descriptor (comera/tt_linear.h) and
// prepares the call once (comera_tt_linear_prepare), then allocates the
// outputs.  Each device file only adds its dtype check and the kernel call.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "comera/tt_linear.h"
#include "common/glue.h"

namespace comera_glue {

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

}  // namespace comera_glue
