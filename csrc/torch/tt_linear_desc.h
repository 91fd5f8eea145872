// Shared by the CPU and CUDA glue of comera::tt_linear: checks the cores and
// gates against x and builds the C descriptor (comera/tt_linear.h).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "comera/tt_linear.h"

namespace comera_glue {

struct Desc {
    std::vector<int64_t> in_modes, out_modes, ranks;
    comera_tt_linear_desc d{};
};

inline const char *error_text(int rc) {
    switch (rc) {
        case COMERA_ERR_ARG: return "invalid TT layer description";
        case COMERA_ERR_OVERFLOW: return "TT layer sizes overflow 64-bit integers";
        case COMERA_ERR_NOMEM: return "out of memory in the TT linear kernel";
        default: return "unknown error in the TT linear kernel";
    }
}

inline Desc describe(const at::Tensor &x, at::TensorList cores, at::TensorList gates,
                     int64_t num_in, int64_t out_features) {
    int64_t D = static_cast<int64_t>(cores.size());
    TORCH_CHECK(num_in >= 1 && num_in < D, "comera::tt_linear: num_in_cores must be in [1, ",
                D - 1, "], got ", num_in);
    TORCH_CHECK(D <= COMERA_MAX_CORES, "comera::tt_linear: at most ", COMERA_MAX_CORES,
                " cores, got ", D);
    TORCH_CHECK(static_cast<int64_t>(gates.size()) == D - 1,
                "comera::tt_linear: expected ", D - 1, " gates, got ", gates.size());
    TORCH_CHECK(x.dim() == 2, "comera::tt_linear: x must be 2-D, got ", x.dim(), "-D");
    Desc out;
    out.ranks.push_back(1);
    for (int64_t k = 0; k < D; k++) {
        const at::Tensor &c = cores[k];
        TORCH_CHECK(c.dim() == 3, "comera::tt_linear: core ", k, " must be 3-D");
        TORCH_CHECK(c.size(0) == out.ranks.back(), "comera::tt_linear: core ", k,
                    " has left rank ", c.size(0), ", expected ", out.ranks.back());
        TORCH_CHECK(c.scalar_type() == x.scalar_type() && c.device() == x.device(),
                    "comera::tt_linear: core ", k, " must match x in dtype and device");
        (k < num_in ? out.in_modes : out.out_modes).push_back(c.size(1));
        out.ranks.push_back(c.size(2));
        if (k < D - 1) {
            TORCH_CHECK(gates[k].dim() == 1 && gates[k].size(0) == c.size(2),
                        "comera::tt_linear: gate ", k, " must have shape (", c.size(2), ",)");
            TORCH_CHECK(gates[k].scalar_type() == x.scalar_type() &&
                            gates[k].device() == x.device(),
                        "comera::tt_linear: gate ", k, " must match x in dtype and device");
        }
    }
    TORCH_CHECK(out.ranks.back() == 1, "comera::tt_linear: last core must have right rank 1");
    out.d.num_in = static_cast<int32_t>(num_in);
    out.d.num_out = static_cast<int32_t>(D - num_in);
    out.d.in_modes = out.in_modes.data();
    out.d.out_modes = out.out_modes.data();
    out.d.ranks = out.ranks.data();
    out.d.in_features = x.size(1);
    out.d.out_features = out_features;
    int rc = comera_tt_linear_check(&out.d, x.size(0));
    TORCH_CHECK(rc == COMERA_OK, "comera::tt_linear: ", error_text(rc),
                " (in_features ", x.size(1), ", out_features ", out_features, ")");
    return out;
}

}  // namespace comera_glue
