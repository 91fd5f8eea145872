// Shared by the CPU and CUDA glue of comera::tt_embedding (op.cpp,
// op_cuda.cpp): checks the cores and gates (count, shapes, ranks, one dtype
// and one device for all), builds the C descriptor (comera/tt_embedding.h),
// prepares the table once (comera_tt_embedding_prepare), and checks the
// batch tensors and per-sample weights (common/glue.h).  Which dtypes a
// device supports is the caller's: it passes its own check.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "comera/tt_embedding.h"
#include "common/glue.h"

namespace comera_glue {

// One prepared call: contiguous cores and gates, the descriptor's arrays,
// the prep, the batch and the per-sample weights (undefined when absent).
struct EmbeddingCall {
    std::vector<at::Tensor> cores, gates;
    std::vector<int64_t> row_modes, dim_modes, ranks;
    comera_tt_embedding_desc d{};
    comera_tt_embedding_prep prep{};
    EmbeddingBatch batch;
    at::Tensor psw;
    at::ScalarType dtype() const { return cores[0].scalar_type(); }
    at::Device device() const { return cores[0].device(); }
};

inline void describe_cores(const char *op, EmbeddingCall &c) {
    int64_t D = static_cast<int64_t>(c.cores.size());
    const auto dtype = c.dtype();
    const auto device = c.device();
    c.ranks.push_back(1);
    for (int64_t k = 0; k < D; k++) {
        const at::Tensor &core = c.cores[k];
        TORCH_CHECK_VALUE(core.dim() == 4, op, ": core ", k,
                          " must be 4-D (rank, row mode, dim mode, rank), got ", core.dim(), "-D");
        TORCH_CHECK_VALUE(core.size(0) == c.ranks.back(), op, ": core ", k, " has left rank ",
                          core.size(0), ", expected ", c.ranks.back());
        TORCH_CHECK_TYPE(core.scalar_type() == dtype, op, ": core ", k, " has dtype ",
                         core.scalar_type(), ", expected ", dtype);
        TORCH_CHECK_VALUE(core.device() == device, op, ": core ", k, " is on ", core.device(),
                          ", expected ", device);
        c.row_modes.push_back(core.size(1));
        c.dim_modes.push_back(core.size(2));
        c.ranks.push_back(core.size(3));
        if (k == D - 1) continue;
        const at::Tensor &g = c.gates[k];
        TORCH_CHECK_VALUE(g.dim() == 1 && g.size(0) == core.size(3), op, ": gate ", k,
                          " must have shape (", core.size(3), ",), got ", g.sizes());
        TORCH_CHECK_TYPE(g.scalar_type() == dtype, op, ": gate ", k, " has dtype ",
                         g.scalar_type(), ", expected ", dtype);
        TORCH_CHECK_VALUE(g.device() == device, op, ": gate ", k, " is on ", g.device(),
                          ", expected ", device);
    }
    TORCH_CHECK_VALUE(c.ranks.back() == 1, op, ": the last core must have right rank 1, got ",
                      c.ranks.back());
}

// Fills c.d from the mode and rank arrays of c.
inline void fill_embedding_desc(EmbeddingCall &c, int64_t num_embeddings, int64_t embedding_dim,
                                int64_t padding_idx) {
    c.d.num_cores = static_cast<int32_t>(c.row_modes.size());
    c.d.row_modes = c.row_modes.data();
    c.d.dim_modes = c.dim_modes.data();
    c.d.ranks = c.ranks.data();
    c.d.num_embeddings = num_embeddings;
    c.d.embedding_dim = embedding_dim;
    c.d.padding_idx = padding_idx;
}

// comera_tt_embedding_prepare, with the descriptor in the error message.
inline void prepare_table(const char *op, EmbeddingCall &c, int64_t reuse) {
    TORCH_CHECK_VALUE(reuse >= COMERA_REUSE_AUTO && reuse <= COMERA_REUSE_PREFIX, op,
                      ": reuse must be 0 (auto), 1 (none), 2 (dedup) or 3 (prefix), got ", reuse);
    int rc = comera_tt_embedding_prepare(&c.d, static_cast<int>(reuse), &c.prep);
    check_status(rc, op, [&](int) {
        return c10::str(" (num_embeddings ", c.d.num_embeddings, ", embedding_dim ",
                        c.d.embedding_dim, ", padding_idx ", c.d.padding_idx, ", row modes ",
                        at::IntArrayRef(c.row_modes), ", dim modes ",
                        at::IntArrayRef(c.dim_modes), ")");
    }, ArgError::Value);
}

// Everything but the index values (which only the CPU can read cheaply).
inline EmbeddingCall prepare_embedding(const char *op, at::TensorList cores, at::TensorList gates,
                                       int64_t num_embeddings, int64_t embedding_dim,
                                       int64_t padding_idx, int64_t reuse,
                                       const at::Tensor &indices,
                                       const std::optional<at::Tensor> &offsets, int64_t mode,
                                       const std::optional<at::Tensor> &psw,
                                       void (*check_dtype)(at::ScalarType, const char *)) {
    int64_t D = static_cast<int64_t>(cores.size());
    TORCH_CHECK_VALUE(D >= 2 && D <= COMERA_MAX_CORES, op, ": expected 2 to ", COMERA_MAX_CORES,
                      " cores, got ", D);
    TORCH_CHECK_VALUE(static_cast<int64_t>(gates.size()) == D - 1, op, ": expected ", D - 1,
                      " gates, got ", gates.size());
    EmbeddingCall c;
    c.cores = contiguous_all(cores);
    c.gates = contiguous_all(gates);
    check_dtype(c.dtype(), op);
    describe_cores(op, c);
    fill_embedding_desc(c, num_embeddings, embedding_dim, padding_idx);
    prepare_table(op, c, reuse);
    c.batch = make_embedding_batch(op, indices, offsets, mode, c.device());
    c.psw = check_per_sample_weights(op, psw, c.batch, c.dtype(), c.device());
    return c;
}

// grad_out of the backward, against the call's output shape.
inline at::Tensor check_grad_out(const char *op, const EmbeddingCall &c, const at::Tensor &grad) {
    int64_t rows = c.batch.output_rows(), dim = c.d.embedding_dim;
    TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == rows && grad.size(1) == dim, op,
                      ": grad_out must have shape (", rows, ", ", dim, "), got ", grad.sizes());
    TORCH_CHECK_TYPE(grad.scalar_type() == c.dtype(), op, ": grad_out must be ", c.dtype(),
                     ", got ", grad.scalar_type());
    TORCH_CHECK_VALUE(grad.device() == c.device(), op, ": grad_out is on ", grad.device(),
                      " but the cores are on ", c.device());
    return grad.contiguous();
}

}  // namespace comera_glue
