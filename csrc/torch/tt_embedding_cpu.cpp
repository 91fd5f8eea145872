// CPU implementations of the tt_embedding operators: argument checks,
// output allocation, then a call into the C kernels (csrc/cpu).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "comera/tt_embedding.h"
#include "tt_embedding_desc.h"

namespace {

using Desc = comera_glue::EmbeddingDesc;

// The index batch; keeps the converted index and offset tensors alive.
struct Batch {
    at::Tensor indices, offsets;
    comera_tt_embedding_batch b{};
};

const char *error_text(int rc) {
    switch (rc) {
        case COMERA_ERR_ARG: return "invalid TT embedding description";
        case COMERA_ERR_OVERFLOW: return "TT embedding sizes overflow 64-bit integers";
        case COMERA_ERR_NOMEM: return "out of memory in the TT embedding kernel";
        default: return "unknown error in the TT embedding kernel";
    }
}

void check_cpu_dtype(at::ScalarType dtype, const char *op) {
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble, op,
                     ": cores must be float32 or float64, got ", dtype);
}

Desc describe(const char *op, at::TensorList cores, at::TensorList gates, int64_t num_embeddings,
              int64_t embedding_dim, int64_t padding_idx) {
    return comera_glue::describe_embedding(op, cores, gates, num_embeddings, embedding_dim,
                                           padding_idx, check_cpu_dtype);
}

at::Tensor as_int64(const char *op, const char *name, const at::Tensor &t) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ", name,
                     " must be an int64 or int32 tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got ", t.dim(), "-D");
    TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU");
    return t.to(at::kLong).contiguous();
}

Batch make_batch(const char *op, const Desc &desc, const at::Tensor &indices,
                 const std::optional<at::Tensor> &offsets, int64_t mode) {
    TORCH_CHECK_VALUE(mode >= COMERA_EMB_PLAIN && mode <= COMERA_EMB_MEAN, op,
                      ": mode must be 0 (plain), 1 (sum) or 2 (mean), got ", mode);
    Batch out;
    out.indices = as_int64(op, "indices", indices);
    out.b.mode = static_cast<int32_t>(mode);
    out.b.n = out.indices.numel();
    out.b.indices = out.indices.data_ptr<int64_t>();
    if (mode != COMERA_EMB_PLAIN) {
        TORCH_CHECK_VALUE(offsets.has_value(), op, ": bag modes need offsets");
        out.offsets = as_int64(op, "offsets", *offsets);
        TORCH_CHECK_VALUE(out.offsets.numel() >= 1, op,
                          ": offsets must have num_bags + 1 >= 1 entries, got none");
        out.b.num_bags = out.offsets.numel() - 1;
        out.b.offsets = out.offsets.data_ptr<int64_t>();
    } else {
        TORCH_CHECK_VALUE(!offsets.has_value(), op, ": offsets are only valid in bag modes");
    }
    int64_t bad = -1;
    int rc = comera_tt_embedding_check_batch(&desc.d, &out.b, &bad);
    if (rc == COMERA_ERR_INDEX) {
        TORCH_CHECK_INDEX(false, op, ": index ", out.b.indices[bad], " at position ", bad,
                          " is out of range for num_embeddings=", desc.d.num_embeddings,
                          " (expected 0 <= index < ", desc.d.num_embeddings, ")");
    }
    if (rc == COMERA_ERR_OFFSETS) {
        TORCH_CHECK_VALUE(false, op, ": offsets[", bad, "] = ", out.b.offsets[bad],
                          " is invalid: offsets must start at 0, never decrease, and the last "
                          "one must equal the number of indices (", out.b.n, ")");
    }
    TORCH_CHECK_VALUE(rc == COMERA_OK, op, ": ", error_text(rc));
    return out;
}

at::Tensor check_psw(const char *op, const std::optional<at::Tensor> &psw, const Batch &batch,
                     at::ScalarType dtype) {
    if (!psw.has_value()) return at::Tensor();
    TORCH_CHECK_VALUE(batch.b.mode == COMERA_EMB_SUM, op,
                      ": per_sample_weights are only supported with mode 1 (sum), as in "
                      "nn.EmbeddingBag; got mode ", batch.b.mode);
    TORCH_CHECK_VALUE(psw->dim() == 1 && psw->size(0) == batch.b.n, op,
                      ": per_sample_weights must have shape (", batch.b.n, ",), got ",
                      psw->sizes());
    TORCH_CHECK_TYPE(psw->scalar_type() == dtype, op, ": per_sample_weights must be ", dtype,
                     ", got ", psw->scalar_type());
    return psw->contiguous();
}

std::vector<at::Tensor> contiguous_all(at::TensorList ts) {
    std::vector<at::Tensor> out;
    for (const auto &t : ts) out.push_back(t.contiguous());
    return out;
}

template <typename T>
std::vector<const T *> data_ptrs(const std::vector<at::Tensor> &ts) {
    std::vector<const T *> out;
    for (const auto &t : ts) out.push_back(t.data_ptr<T>());
    return out;
}

template <typename T>
std::vector<T *> mutable_ptrs(std::vector<at::Tensor> &ts) {
    std::vector<T *> out;
    for (auto &t : ts) out.push_back(t.data_ptr<T>());
    return out;
}

at::Tensor tt_embedding_cpu(const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
                            const std::optional<at::Tensor> &psw_in, at::TensorList cores_in,
                            at::TensorList gates_in, int64_t num_embeddings,
                            int64_t embedding_dim, int64_t padding_idx, int64_t mode,
                            int64_t reuse) {
    const char *op = "comera::tt_embedding";
    auto cores = contiguous_all(cores_in);
    auto gates = contiguous_all(gates_in);
    Desc desc = describe(op, cores, gates, num_embeddings, embedding_dim, padding_idx);
    Batch batch = make_batch(op, desc, indices, offsets, mode);
    auto dtype = cores[0].scalar_type();
    at::Tensor psw = check_psw(op, psw_in, batch, dtype);
    int64_t rows = mode == COMERA_EMB_PLAIN ? batch.b.n : batch.b.num_bags;
    at::Tensor out = at::empty({rows, embedding_dim}, cores[0].options());
    int nt = at::get_num_threads();
    int rc;
    if (dtype == at::kFloat) {
        auto c = data_ptrs<float>(cores);
        auto g = data_ptrs<float>(gates);
        rc = comera_tt_embedding_fwd_f32(&desc.d, &batch.b,
                                         psw.defined() ? psw.data_ptr<float>() : nullptr,
                                         static_cast<int>(reuse), c.data(), g.data(),
                                         out.data_ptr<float>(), nt);
    } else {
        auto c = data_ptrs<double>(cores);
        auto g = data_ptrs<double>(gates);
        rc = comera_tt_embedding_fwd_f64(&desc.d, &batch.b,
                                         psw.defined() ? psw.data_ptr<double>() : nullptr,
                                         static_cast<int>(reuse), c.data(), g.data(),
                                         out.data_ptr<double>(), nt);
    }
    TORCH_CHECK_VALUE(rc != COMERA_ERR_ARG, op, ": reuse must be 0 (auto), 1 (none), 2 (dedup) "
                      "or 3 (prefix), got ", reuse);
    TORCH_CHECK(rc == COMERA_OK, op, ": ", error_text(rc));
    return out;
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> tt_embedding_backward_cpu(
    const at::Tensor &grad_in, const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
    const std::optional<at::Tensor> &psw_in, at::TensorList cores_in, at::TensorList gates_in,
    int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx, int64_t mode,
    int64_t reuse) {
    const char *op = "comera::tt_embedding_backward";
    auto cores = contiguous_all(cores_in);
    auto gates = contiguous_all(gates_in);
    Desc desc = describe(op, cores, gates, num_embeddings, embedding_dim, padding_idx);
    Batch batch = make_batch(op, desc, indices, offsets, mode);
    auto dtype = cores[0].scalar_type();
    at::Tensor psw = check_psw(op, psw_in, batch, dtype);
    int64_t rows = mode == COMERA_EMB_PLAIN ? batch.b.n : batch.b.num_bags;
    at::Tensor grad = grad_in.contiguous();
    TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == rows && grad.size(1) == embedding_dim,
                      op, ": grad_out must have shape (", rows, ", ", embedding_dim, "), got ",
                      grad.sizes());
    TORCH_CHECK_TYPE(grad.scalar_type() == dtype, op, ": grad_out must be ", dtype, ", got ",
                     grad.scalar_type());
    std::vector<at::Tensor> gcores, ggates;
    for (const auto &c : cores) gcores.push_back(at::empty_like(c));
    for (const auto &g : gates) ggates.push_back(at::empty_like(g));
    int nt = at::get_num_threads();
    int rc;
    if (dtype == at::kFloat) {
        auto c = data_ptrs<float>(cores);
        auto g = data_ptrs<float>(gates);
        auto dc = mutable_ptrs<float>(gcores);
        auto dg = mutable_ptrs<float>(ggates);
        rc = comera_tt_embedding_bwd_f32(&desc.d, &batch.b,
                                         psw.defined() ? psw.data_ptr<float>() : nullptr,
                                         static_cast<int>(reuse), grad.data_ptr<float>(),
                                         c.data(), g.data(), dc.data(), dg.data(), nt);
    } else {
        auto c = data_ptrs<double>(cores);
        auto g = data_ptrs<double>(gates);
        auto dc = mutable_ptrs<double>(gcores);
        auto dg = mutable_ptrs<double>(ggates);
        rc = comera_tt_embedding_bwd_f64(&desc.d, &batch.b,
                                         psw.defined() ? psw.data_ptr<double>() : nullptr,
                                         static_cast<int>(reuse), grad.data_ptr<double>(),
                                         c.data(), g.data(), dc.data(), dg.data(), nt);
    }
    TORCH_CHECK_VALUE(rc != COMERA_ERR_ARG, op, ": reuse must be 0 (auto), 1 (none), 2 (dedup) "
                      "or 3 (prefix), got ", reuse);
    TORCH_CHECK(rc == COMERA_OK, op, ": ", error_text(rc));
    return {gcores, ggates};
}

at::Tensor tt_embedding_plan_cpu(const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
                                 at::IntArrayRef row_modes, at::IntArrayRef dim_modes,
                                 at::IntArrayRef ranks, int64_t num_embeddings,
                                 int64_t embedding_dim, int64_t padding_idx, int64_t mode) {
    const char *op = "comera::tt_embedding_plan";
    int64_t D = static_cast<int64_t>(row_modes.size());
    TORCH_CHECK_VALUE(static_cast<int64_t>(dim_modes.size()) == D &&
                          static_cast<int64_t>(ranks.size()) == D + 1,
                      op, ": need as many dim modes as row modes and one more rank");
    Desc desc;
    desc.row_modes.assign(row_modes.begin(), row_modes.end());
    desc.dim_modes.assign(dim_modes.begin(), dim_modes.end());
    desc.ranks.assign(ranks.begin(), ranks.end());
    desc.d.num_cores = static_cast<int32_t>(D);
    desc.d.row_modes = desc.row_modes.data();
    desc.d.dim_modes = desc.dim_modes.data();
    desc.d.ranks = desc.ranks.data();
    desc.d.num_embeddings = num_embeddings;
    desc.d.embedding_dim = embedding_dim;
    desc.d.padding_idx = padding_idx;
    int rc = comera_tt_embedding_check(&desc.d);
    TORCH_CHECK_VALUE(rc == COMERA_OK, op, ": ", error_text(rc));
    Batch batch = make_batch(op, desc, indices, offsets, mode);
    comera_tt_embedding_plan plan;
    rc = comera_tt_embedding_make_plan(&desc.d, &batch.b, &plan);
    TORCH_CHECK(rc == COMERA_OK, op, ": ", error_text(rc));
    // [reuse, rows, unique, flops x3 (none, dedup, prefix), seconds x3, prefixes x D]
    at::Tensor out = at::empty({9 + D}, at::TensorOptions().dtype(at::kDouble));
    double *o = out.data_ptr<double>();
    o[0] = plan.reuse;
    o[1] = static_cast<double>(plan.rows);
    o[2] = static_cast<double>(plan.unique);
    for (int r = 1; r <= 3; r++) {
        o[2 + r] = plan.flops[r];
        o[5 + r] = plan.seconds[r];
    }
    for (int64_t k = 0; k < D; k++) o[9 + k] = static_cast<double>(plan.prefixes[k]);
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(comera, CPU, m) {
    m.impl("tt_embedding", &tt_embedding_cpu);
    m.impl("tt_embedding_backward", &tt_embedding_backward_cpu);
    m.impl("tt_embedding_plan", &tt_embedding_plan_cpu);
}
