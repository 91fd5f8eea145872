// gate_prox: the fused proximal step on TT gates (rank adaptation,
// docs/design.md section 4).  This folder holds cpu.c (the C kernel, generic
// text in cpu_impl.h), cuda.cu (the CUDA launchers), and the torch glue:
// this file (CPU) and op_cuda.cpp (CUDA).
//
// CPU glue: argument checks, then one call into the C kernel for all gates.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "comera/gate_prox.h"
#include "common/glue.h"

namespace {

at::Tensor gate_prox_cpu(at::TensorList gates, at::TensorList signs, double threshold,
                         int64_t min_live, bool kill) {
    const int64_t n = static_cast<int64_t>(gates.size());
    TORCH_CHECK(static_cast<int64_t>(signs.size()) == n, "comera::gate_prox_: got ", n,
                " gates but ", signs.size(), " sign vectors");
    TORCH_CHECK(!std::isnan(threshold), "comera::gate_prox_: threshold must not be NaN");
    TORCH_CHECK(min_live >= 0, "comera::gate_prox_: min_live must be >= 0, got ", min_live);
    at::Tensor live = at::empty({n}, at::TensorOptions().dtype(at::kLong));
    if (n == 0) return live;
    const at::ScalarType dtype = gates[0].scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
                "comera::gate_prox_: gates must be float32 or float64, got ", dtype);
    std::vector<int64_t> sizes;
    std::vector<int8_t *> sp;
    for (int64_t k = 0; k < n; k++) {
        const at::Tensor &g = gates[k], &s = signs[k];
        TORCH_CHECK(g.dim() == 1 && g.is_contiguous() && g.device().is_cpu() &&
                        g.scalar_type() == dtype,
                    "comera::gate_prox_: gate ", k, " must be a contiguous 1-D CPU tensor of ",
                    dtype);
        TORCH_CHECK(s.dim() == 1 && s.is_contiguous() && s.device().is_cpu() &&
                        s.scalar_type() == at::kChar && s.size(0) == g.size(0),
                    "comera::gate_prox_: signs[", k, "] must be a contiguous int8 CPU tensor of "
                    "shape (", g.size(0), ",)");
        sizes.push_back(g.size(0));
        sp.push_back(s.data_ptr<int8_t>());
    }
    int nt = at::get_num_threads();
    int rc;
    if (dtype == at::kFloat) {
        std::vector<float *> gp;
        for (const auto &g : gates) gp.push_back(g.data_ptr<float>());
        rc = comera_gate_prox_f32(n, gp.data(), sp.data(), sizes.data(), threshold, min_live,
                                  kill ? 1 : 0, live.data_ptr<int64_t>(), nt);
    } else {
        std::vector<double *> gp;
        for (const auto &g : gates) gp.push_back(g.data_ptr<double>());
        rc = comera_gate_prox_f64(n, gp.data(), sp.data(), sizes.data(), threshold, min_live,
                                  kill ? 1 : 0, live.data_ptr<int64_t>(), nt);
    }
    // COMERA_GATE_NAN is reported through live (-1 per gate holding a NaN) so
    // that Python can name the layer; only argument errors raise here.
    if (rc != COMERA_GATE_NAN) comera_glue::check_status(rc, "comera::gate_prox_");
    return live;
}

}  // namespace

TORCH_LIBRARY_IMPL(comera, CPU, m) {
    m.impl("gate_prox_", &gate_prox_cpu);
}
