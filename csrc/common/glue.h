// Helpers of the torch glue (csrc/<op>/op.cpp, op_cuda.cpp), written once:
// tensor lists, pointer tables, dtype codes, the one mapping of C status
// codes to Python exceptions, and the embedding batch checks that the CPU
// and CUDA ops share.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "comera/status.h"
#include "comera/tt_embedding.h"

namespace comera_glue {

inline std::vector<at::Tensor> contiguous_all(at::TensorList ts) {
    std::vector<at::Tensor> out;
    for (const auto &t : ts) out.push_back(t.contiguous());
    return out;
}

// Tables of data pointers for the C ABI (T = void for the CUDA launchers).
template <typename T>
std::vector<const T *> data_ptrs(const std::vector<at::Tensor> &ts) {
    std::vector<const T *> out;
    for (const auto &t : ts) out.push_back(static_cast<const T *>(t.data_ptr()));
    return out;
}

template <typename T>
std::vector<T *> mutable_data_ptrs(std::vector<at::Tensor> &ts) {
    std::vector<T *> out;
    for (auto &t : ts) out.push_back(static_cast<T *>(t.data_ptr()));
    return out;
}

// Fresh tensors shaped like each of ts (gradient outputs).
inline std::vector<at::Tensor> empty_like_all(const std::vector<at::Tensor> &ts) {
    std::vector<at::Tensor> out;
    for (const auto &t : ts) out.push_back(at::empty_like(t));
    return out;
}

// COMERA_DT_* (comera/cuda.h) of a dtype, or -1 where the C ABI has none.
inline int dtype_code(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return 0;     // COMERA_DT_F32
        case at::kDouble: return 1;    // COMERA_DT_F64
        case at::kBFloat16: return 2;  // COMERA_DT_BF16
        case at::kHalf: return 3;      // COMERA_DT_F16
        default: return -1;
    }
}

// How COMERA_ERR_ARG surfaces: tt_embedding documents its argument errors as
// ValueError, the other ops raise RuntimeError.
enum class ArgError { Runtime, Value };

// The one mapping of C status codes to exceptions.  `detail(rc)` gives the
// text after the op name and the status text (e.g. the sizes involved); it
// runs only on failure.  Overflow is a ValueError ("overflow" in the text),
// a bad index an IndexError, bad offsets a ValueError, the rest
// RuntimeError.
template <typename Detail>
void check_status(int rc, const char *op, Detail detail, ArgError arg = ArgError::Runtime) {
    if (rc == COMERA_OK) return;
    const std::string text = std::string(op) + ": " + comera_status_text(rc) + detail(rc);
    switch (rc) {
        case COMERA_ERR_OVERFLOW:
        case COMERA_ERR_OFFSETS: TORCH_CHECK_VALUE(false, text);
        case COMERA_ERR_INDEX: TORCH_CHECK_INDEX(false, text);
        case COMERA_ERR_ARG:
            TORCH_CHECK_VALUE(arg != ArgError::Value, text);
            TORCH_CHECK(false, text);
        default: TORCH_CHECK(false, text);
    }
}

inline void check_status(int rc, const char *op, ArgError arg = ArgError::Runtime) {
    check_status(rc, op, [](int) { return std::string(); }, arg);
}

// ---- tt_embedding: the index batch, checked the same way on every device.

// Keeps the converted index and offset tensors alive.
struct EmbeddingBatch {
    at::Tensor indices, offsets;
    comera_tt_embedding_batch b{};
    int64_t output_rows() const { return b.mode == COMERA_EMB_PLAIN ? b.n : b.num_bags; }
};

inline at::Tensor as_int64(const char *op, const char *name, const at::Tensor &t,
                           const at::Device &device) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ", name,
                     " must be an int64 or int32 tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got ", t.dim(), "-D");
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(),
                      " but the cores are on ", device);
    return t.to(at::kLong).contiguous();
}

// Mode, index and offset tensors (dtype, shape, device); the values are
// checked where they can be read (comera_tt_embedding_check_batch on the CPU).
inline EmbeddingBatch make_embedding_batch(const char *op, const at::Tensor &indices,
                                           const std::optional<at::Tensor> &offsets,
                                           int64_t mode, const at::Device &device) {
    TORCH_CHECK_VALUE(mode >= COMERA_EMB_PLAIN && mode <= COMERA_EMB_MEAN, op,
                      ": mode must be 0 (plain), 1 (sum) or 2 (mean), got ", mode);
    EmbeddingBatch out;
    out.indices = as_int64(op, "indices", indices, device);
    out.b.mode = static_cast<int32_t>(mode);
    out.b.n = out.indices.numel();
    out.b.indices = out.indices.data_ptr<int64_t>();
    if (mode == COMERA_EMB_PLAIN) {
        TORCH_CHECK_VALUE(!offsets.has_value(), op, ": offsets are only valid in bag modes");
        return out;
    }
    TORCH_CHECK_VALUE(offsets.has_value(), op, ": bag modes need offsets");
    out.offsets = as_int64(op, "offsets", *offsets, device);
    TORCH_CHECK_VALUE(out.offsets.numel() >= 1, op,
                      ": offsets must have num_bags + 1 >= 1 entries, got none");
    out.b.num_bags = out.offsets.numel() - 1;
    out.b.offsets = out.offsets.data_ptr<int64_t>();
    return out;
}

// The messages of a batch that comera_tt_embedding_check_batch refused.
inline std::string batch_error_detail(int rc, const EmbeddingBatch &batch, int64_t bad,
                                      int64_t num_embeddings) {
    if (rc == COMERA_ERR_INDEX)
        return c10::str(": index ", batch.b.indices[bad], " at position ", bad,
                        " is out of range for num_embeddings=", num_embeddings,
                        " (expected 0 <= index < ", num_embeddings, ")");
    if (rc == COMERA_ERR_OFFSETS)
        return c10::str(": offsets[", bad, "] = ", batch.b.offsets[bad],
                        " is invalid: offsets must start at 0, never decrease, and the last "
                        "one must equal the number of indices (", batch.b.n, ")");
    return "";
}

inline at::Tensor check_per_sample_weights(const char *op, const std::optional<at::Tensor> &psw,
                                           const EmbeddingBatch &batch, at::ScalarType dtype,
                                           const at::Device &device) {
    if (!psw.has_value()) return at::Tensor();
    TORCH_CHECK_VALUE(batch.b.mode == COMERA_EMB_SUM, op,
                      ": per_sample_weights are only supported with mode 1 (sum), as in "
                      "nn.EmbeddingBag; got mode ", batch.b.mode);
    TORCH_CHECK_VALUE(psw->dim() == 1 && psw->size(0) == batch.b.n, op,
                      ": per_sample_weights must have shape (", batch.b.n, ",), got ",
                      psw->sizes());
    TORCH_CHECK_TYPE(psw->scalar_type() == dtype, op, ": per_sample_weights must be ", dtype,
                     ", got ", psw->scalar_type());
    TORCH_CHECK_VALUE(psw->device() == device, op, ": per_sample_weights is on ", psw->device(),
                      " but the cores are on ", device);
    return psw->contiguous();
}

}  // namespace comera_glue
