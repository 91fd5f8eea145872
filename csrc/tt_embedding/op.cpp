// tt_embedding: the TT (TTM-format) embedding table (docs/design.md
// section 3).  This folder holds the whole op: plan.c (checks, shape, index
// grouping, planner, prepare), cpu.c (the C kernels, generic text in
// cpu_impl.h), cuda.cu + cuda_bwd.cu + cuda.cuh (the CUDA launchers),
// describe.h (argument checks shared by the glue), and the torch glue: this
// file (CPU, and the planner op) and op_cuda.cpp (CUDA).
//
// CPU glue: argument checks and one prepare (describe.h), the index values
// checked (comera_tt_embedding_check_batch), output allocation, then a call
// into the C kernels (cpu.c).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "comera/tt_embedding.h"
#include "common/glue.h"
#include "tt_embedding/describe.h"

namespace {

using namespace comera_glue;

void check_cpu_dtype(at::ScalarType dtype, const char *op) {
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble, op,
                     ": cores must be float32 or float64, got ", dtype);
}

// The index and offset values, which the C kernels trust.
void check_batch_values(const char *op, const EmbeddingCall &c) {
    int64_t bad = -1;
    int rc = comera_tt_embedding_check_batch(&c.prep, &c.batch.b, &bad);
    check_status(rc, op, [&](int code) {
        return batch_error_detail(code, c.batch, bad, c.d.num_embeddings);
    }, ArgError::Value);
}

EmbeddingCall prepare_cpu(const char *op, const at::Tensor &indices,
                          const std::optional<at::Tensor> &offsets,
                          const std::optional<at::Tensor> &psw, at::TensorList cores,
                          at::TensorList gates, int64_t num_embeddings, int64_t embedding_dim,
                          int64_t padding_idx, int64_t mode, int64_t reuse) {
    EmbeddingCall c = prepare_embedding(op, cores, gates, num_embeddings, embedding_dim,
                                        padding_idx, reuse, indices, offsets, mode, psw,
                                        check_cpu_dtype);
    check_batch_values(op, c);
    return c;
}

template <typename T>
int forward(const EmbeddingCall &c, at::Tensor &out) {
    auto cores = data_ptrs<T>(c.cores), gates = data_ptrs<T>(c.gates);
    const T *psw = c.psw.defined() ? c.psw.data_ptr<T>() : nullptr;
    int nt = at::get_num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_tt_embedding_fwd_f32(&c.prep, &c.batch.b, psw, cores.data(), gates.data(),
                                           out.data_ptr<T>(), nt);
    else
        return comera_tt_embedding_fwd_f64(&c.prep, &c.batch.b, psw, cores.data(), gates.data(),
                                           out.data_ptr<T>(), nt);
}

at::Tensor tt_embedding_cpu(const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
                            const std::optional<at::Tensor> &psw, at::TensorList cores,
                            at::TensorList gates, int64_t num_embeddings,
                            int64_t embedding_dim, int64_t padding_idx, int64_t mode,
                            int64_t reuse) {
    const char *op = "comera::tt_embedding";
    EmbeddingCall c = prepare_cpu(op, indices, offsets, psw, cores, gates, num_embeddings,
                                  embedding_dim, padding_idx, mode, reuse);
    at::Tensor out = at::empty({c.batch.output_rows(), embedding_dim}, c.cores[0].options());
    int rc = c.dtype() == at::kFloat ? forward<float>(c, out) : forward<double>(c, out);
    check_status(rc, op);
    return out;
}

template <typename T>
int backward(const EmbeddingCall &c, const at::Tensor &grad, std::vector<at::Tensor> &gcores,
             std::vector<at::Tensor> &ggates) {
    auto cores = data_ptrs<T>(c.cores), gates = data_ptrs<T>(c.gates);
    auto dc = mutable_data_ptrs<T>(gcores), dg = mutable_data_ptrs<T>(ggates);
    const T *psw = c.psw.defined() ? c.psw.data_ptr<T>() : nullptr;
    int nt = at::get_num_threads();
    if constexpr (std::is_same_v<T, float>)
        return comera_tt_embedding_bwd_f32(&c.prep, &c.batch.b, psw, grad.data_ptr<T>(),
                                           cores.data(), gates.data(), dc.data(), dg.data(), nt);
    else
        return comera_tt_embedding_bwd_f64(&c.prep, &c.batch.b, psw, grad.data_ptr<T>(),
                                           cores.data(), gates.data(), dc.data(), dg.data(), nt);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> tt_embedding_backward_cpu(
    const at::Tensor &grad_out, const at::Tensor &indices, const std::optional<at::Tensor> &offsets,
    const std::optional<at::Tensor> &psw, at::TensorList cores, at::TensorList gates,
    int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx, int64_t mode,
    int64_t reuse) {
    const char *op = "comera::tt_embedding_backward";
    EmbeddingCall c = prepare_cpu(op, indices, offsets, psw, cores, gates, num_embeddings,
                                  embedding_dim, padding_idx, mode, reuse);
    at::Tensor grad = check_grad_out(op, c, grad_out);
    std::vector<at::Tensor> gcores = empty_like_all(c.cores), ggates = empty_like_all(c.gates);
    int rc = c.dtype() == at::kFloat ? backward<float>(c, grad, gcores, ggates)
                                     : backward<double>(c, grad, gcores, ggates);
    check_status(rc, op);
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
    EmbeddingCall c;
    c.row_modes.assign(row_modes.begin(), row_modes.end());
    c.dim_modes.assign(dim_modes.begin(), dim_modes.end());
    c.ranks.assign(ranks.begin(), ranks.end());
    fill_embedding_desc(c, num_embeddings, embedding_dim, padding_idx);
    prepare_table(op, c, COMERA_REUSE_AUTO);
    c.batch = make_embedding_batch(op, indices, offsets, mode, at::Device(at::kCPU));
    check_batch_values(op, c);
    comera_tt_embedding_plan plan;
    check_status(comera_tt_embedding_make_plan(&c.d, &c.batch.b, &plan), op);
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
