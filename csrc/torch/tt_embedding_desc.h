// Shared by the CPU and CUDA glue of comera::tt_embedding: checks the cores
// and gates (count, shapes, ranks, one dtype and one device for all) and
// builds the C descriptor (comera/tt_embedding.h).  Which dtypes a device
// supports is the caller's: it passes its own check.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "comera/tt_embedding.h"

namespace comera_glue {

struct EmbeddingDesc {
    std::vector<int64_t> row_modes, dim_modes, ranks;
    comera_tt_embedding_desc d{};
};

inline const char *embedding_check_text(int rc) {
    switch (rc) {
        case COMERA_ERR_ARG: return "invalid TT embedding description";
        case COMERA_ERR_OVERFLOW: return "TT embedding sizes overflow 64-bit integers";
        default: return "unknown error in the TT embedding checks";
    }
}

inline EmbeddingDesc describe_embedding(const char *op, at::TensorList cores, at::TensorList gates,
                                        int64_t num_embeddings, int64_t embedding_dim,
                                        int64_t padding_idx,
                                        void (*check_dtype)(at::ScalarType, const char *)) {
    int64_t D = static_cast<int64_t>(cores.size());
    TORCH_CHECK_VALUE(D >= 2 && D <= COMERA_MAX_CORES, op, ": expected 2 to ", COMERA_MAX_CORES,
                      " cores, got ", D);
    TORCH_CHECK_VALUE(static_cast<int64_t>(gates.size()) == D - 1, op, ": expected ", D - 1,
                      " gates, got ", gates.size());
    const auto dtype = cores[0].scalar_type();
    const auto device = cores[0].device();
    check_dtype(dtype, op);
    EmbeddingDesc out;
    out.ranks.push_back(1);
    for (int64_t k = 0; k < D; k++) {
        const at::Tensor &c = cores[k];
        TORCH_CHECK_VALUE(c.dim() == 4, op, ": core ", k,
                          " must be 4-D (rank, row mode, dim mode, rank), got ", c.dim(), "-D");
        TORCH_CHECK_VALUE(c.size(0) == out.ranks.back(), op, ": core ", k, " has left rank ",
                          c.size(0), ", expected ", out.ranks.back());
        TORCH_CHECK_TYPE(c.scalar_type() == dtype, op, ": core ", k, " has dtype ",
                         c.scalar_type(), ", expected ", dtype);
        TORCH_CHECK_VALUE(c.device() == device, op, ": core ", k, " is on ", c.device(),
                          ", expected ", device);
        out.row_modes.push_back(c.size(1));
        out.dim_modes.push_back(c.size(2));
        out.ranks.push_back(c.size(3));
        if (k < D - 1) {
            const at::Tensor &g = gates[k];
            TORCH_CHECK_VALUE(g.dim() == 1 && g.size(0) == c.size(3), op, ": gate ", k,
                              " must have shape (", c.size(3), ",), got ", g.sizes());
            TORCH_CHECK_TYPE(g.scalar_type() == dtype, op, ": gate ", k, " has dtype ",
                             g.scalar_type(), ", expected ", dtype);
            TORCH_CHECK_VALUE(g.device() == device, op, ": gate ", k, " is on ", g.device(),
                              ", expected ", device);
        }
    }
    TORCH_CHECK_VALUE(out.ranks.back() == 1, op, ": the last core must have right rank 1, got ",
                      out.ranks.back());
    out.d.num_cores = static_cast<int32_t>(D);
    out.d.row_modes = out.row_modes.data();
    out.d.dim_modes = out.dim_modes.data();
    out.d.ranks = out.ranks.data();
    out.d.num_embeddings = num_embeddings;
    out.d.embedding_dim = embedding_dim;
    out.d.padding_idx = padding_idx;
    int rc = comera_tt_embedding_check(&out.d);
    TORCH_CHECK_VALUE(rc == COMERA_OK, op, ": ", embedding_check_text(rc), " (num_embeddings ",
                      num_embeddings, ", embedding_dim ", embedding_dim, ", padding_idx ",
                      padding_idx, ", row modes ", at::IntArrayRef(out.row_modes),
                      ", dim modes ", at::IntArrayRef(out.dim_modes), ")");
    return out;
}

}  // namespace comera_glue
