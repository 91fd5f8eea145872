// Helpers of the torch glue (csrc/<op>/op.cpp), written once: tensor lists,
// pointer tables, dtype codes, and the one mapping of C status codes to
// Python exceptions.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "comera/status.h"

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

}  // namespace comera_glue
