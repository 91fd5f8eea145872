// Helpers of the torch glue (csrc/<op>/op.cpp), written once, on the LibTorch
// stable ABI (torch/csrc/stable, torch/headeronly; setup.py sets
// TORCH_TARGET_VERSION to the oldest torch the binary loads into): tensor
// lists, pointer tables, dtype codes, message text, the checks that raise
// typed Python exceptions, the one mapping of C status codes to them, and
// (CUDA builds) the extension's own cuBLAS handles.
//
// Nothing here may use ATen or c10 C++ (version-bound symbols): tensors are
// torch::stable::Tensor, outputs come from torch::stable ops, RuntimeError
// checks are STD_TORCH_CHECK.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

// TYPED-ERROR FALLBACK.  The stable ABI has one error macro, STD_TORCH_CHECK,
// which throws std::runtime_error (Python RuntimeError); it has no
// counterpart of TORCH_CHECK_VALUE / _INDEX / _TYPE (c10::ValueError etc. are
// version-bound C++ classes).  The ops document ValueError, IndexError and
// TypeError, so those checks throw C++ exceptions that torch's Python op
// binding (pybind11) translates by type: std::invalid_argument -> ValueError,
// std::out_of_range -> IndexError (pybind11's standard translations, no
// torch symbol involved), and pybind11::type_error -> TypeError (pybind11's
// header-only builtin exception, which torch rethrows to pybind11 unchanged;
// the one pybind11 header below, nothing linked).  Called from C++ (not
// through Python) they are plain std::exception subclasses.
// torch < 2.13 refuses this header under TORCH_TARGET_VERSION (an #error
// meant for headers that link libtorch_python); this one links nothing.
#pragma push_macro("TORCH_TARGET_VERSION")
#undef TORCH_TARGET_VERSION
#include <pybind11/detail/common.h>
#pragma pop_macro("TORCH_TARGET_VERSION")

#include "comera/status.h"
#include "comera/tt_linear.h" /* COMERA_MAX_CORES */
#include "common/outpool.h"
#include "common/pages.h"

#ifdef COMERA_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/headeronly/version.h>

#include <map>
#include <utility>
#endif

// hidden: nothing of the glue enters the dynamic symbol table
namespace comera_glue __attribute__((visibility("hidden"))) {

using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::headeronly::ScalarType;
using torch::stable::Device;
using torch::stable::Tensor;

// ---- message text (c10::str's formats: Float, cpu, cuda:0, [2, 3])

template <typename... Args>
std::string str(const Args &...args) {
    std::ostringstream out;
    ((out << args), ...);
    return out.str();
}

inline std::string device_name(const Device &d) {
    std::string type;
    switch (d.type()) {
        case torch::headeronly::DeviceType::CPU: type = "cpu"; break;
        case torch::headeronly::DeviceType::CUDA: type = "cuda"; break;
        case torch::headeronly::DeviceType::Meta: type = "meta"; break;
        default: type = str("device type ", static_cast<int>(d.type()));
    }
    return d.has_index() ? str(type, ":", static_cast<int>(d.index())) : type;
}

inline std::string list_text(IntHeaderOnlyArrayRef v) {
    std::ostringstream out;
    out << "[";
    for (size_t i = 0; i < v.size(); i++) out << (i ? ", " : "") << v[i];
    out << "]";
    return out.str();
}

inline std::string shape_text(const Tensor &t) { return list_text(t.sizes()); }

// ---- checks: RuntimeError through the stable ABI, the typed ones through
// the fallback above.  Arguments are streamed (str) only on failure.

[[noreturn]] inline void raise_value_error(const std::string &msg) {
    throw std::invalid_argument(msg);
}
[[noreturn]] inline void raise_index_error(const std::string &msg) {
    throw std::out_of_range(msg);
}
[[noreturn]] inline void raise_type_error(const std::string &msg) {
    throw pybind11::type_error(msg);
}
[[noreturn]] inline void raise_runtime_error(const std::string &msg) {
    throw std::runtime_error(msg);
}

#define COMERA_CHECK(cond, ...)              \
    do {                                     \
        STD_TORCH_CHECK(cond, __VA_ARGS__); \
    } while (0)
#define COMERA_CHECK_VALUE(cond, ...)                                                \
    do {                                                                             \
        if (C10_UNLIKELY(!(cond)))                                                   \
            ::comera_glue::raise_value_error(::comera_glue::str(__VA_ARGS__));       \
    } while (0)
#define COMERA_CHECK_INDEX(cond, ...)                                                \
    do {                                                                             \
        if (C10_UNLIKELY(!(cond)))                                                   \
            ::comera_glue::raise_index_error(::comera_glue::str(__VA_ARGS__));       \
    } while (0)
#define COMERA_CHECK_TYPE(cond, ...)                                                 \
    do {                                                                             \
        if (C10_UNLIKELY(!(cond)))                                                   \
            ::comera_glue::raise_type_error(::comera_glue::str(__VA_ARGS__));        \
    } while (0)

// ---- tensors

// torch < 2.13 names the shim's error check TORCH_ERROR_CODE_CHECK
// (source builds against the torch of a GPU image; the wheel needs 2.13)
#ifndef STABLE_TORCH_ERROR_CODE_CHECK
#define STABLE_TORCH_ERROR_CODE_CHECK TORCH_ERROR_CODE_CHECK
#endif

inline bool is_cuda(const Device &d) { return d.type() == torch::headeronly::DeviceType::CUDA; }
inline bool is_cpu(const Device &d) { return d.type() == torch::headeronly::DeviceType::CPU; }

// Identities for the per-tensor checks, one or two shim calls each and no
// enum translation (scalar_type() and device() translate the shim's codes
// through a chain of calls): equal ids, equal dtype / device.
inline int32_t dtype_id(const Tensor &t) {
    int32_t v;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &v));
    return v;
}
inline int64_t device_id(const Tensor &t) {
    int32_t type, index;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &type));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(t.get(), &index));
    return (static_cast<int64_t>(type) << 32) | static_cast<uint32_t>(index);
}

// Each of ts made contiguous in place (most already are: one shim call each).
inline void make_contiguous(std::vector<Tensor> &ts) {
    for (auto &t : ts)
        if (!t.is_contiguous()) t = torch::stable::contiguous(t);
}

// t itself when already contiguous (one shim call), else a contiguous copy.
inline Tensor as_contiguous(const Tensor &t) {
    return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

// The data pointers of a layer's cores or of its gates, for the C ABI (T =
// void for the CUDA launchers), in a fixed table: no allocation per call.
template <typename T>
struct CorePtrs {
    const T *p[COMERA_MAX_CORES];
    const T *const *data() const { return p; }
};

template <typename T>
CorePtrs<T> data_ptrs(const std::vector<Tensor> &ts) {
    STD_TORCH_CHECK(ts.size() <= COMERA_MAX_CORES, "comera: ", ts.size(),
                    " cores or gates, at most ", COMERA_MAX_CORES, " are supported");
    CorePtrs<T> out;
    for (size_t k = 0; k < ts.size(); k++) out.p[k] = static_cast<const T *>(ts[k].data_ptr());
    return out;
}

template <typename T>
std::vector<T *> mutable_data_ptrs(const std::vector<Tensor> &ts) {
    std::vector<T *> out;
    out.reserve(ts.size());
    for (const auto &t : ts) out.push_back(static_cast<T *>(t.data_ptr()));
    return out;
}

template <typename T>
T *ptr(const Tensor &t) {
    return static_cast<T *>(t.data_ptr());
}

// aoti_torch_dtype_* code of a dtype (the stable C shim's numbering).
inline int32_t shim_dtype(ScalarType t) {
    switch (t) {
        case ScalarType::Float: return aoti_torch_dtype_float32();
        case ScalarType::Double: return aoti_torch_dtype_float64();
        case ScalarType::BFloat16: return aoti_torch_dtype_bfloat16();
        case ScalarType::Half: return aoti_torch_dtype_float16();
        case ScalarType::Long: return aoti_torch_dtype_int64();
        case ScalarType::Int: return aoti_torch_dtype_int32();
        case ScalarType::Char: return aoti_torch_dtype_int8();
        case ScalarType::Byte: return aoti_torch_dtype_uint8();
        default: raise_runtime_error(str("comera: no output dtype ", t));
    }
}

// A CPU tensor over a block of the output pool (common/outpool.h) whose
// storage gives the block back when it dies.  Such a storage cannot be
// resized (resize_ to more elements raises); everything else is a tensor.
inline void give_back_block(void *data, void *) { comera_outpool_give(data); }

inline Tensor pooled_tensor(void *block, size_t ndim, const int64_t *sizes,
                            const int64_t *strides, ScalarType dtype) {
    AtenTensorHandle out = nullptr;
    AOTITorchError err = torch_from_blob(block, static_cast<int64_t>(ndim), sizes, strides, 0,
                                         shim_dtype(dtype), aoti_torch_device_type_cpu(), -1,
                                         &out, aoti_torch_layout_strided(), nullptr, 0,
                                         &give_back_block, nullptr);
    if (err != AOTI_TORCH_SUCCESS) {
        comera_outpool_give(block);
        STABLE_TORCH_ERROR_CODE_CHECK(err);
    }
    return Tensor(out);
}

// A fresh contiguous tensor (an output): a large CPU one from the output
// pool (its block reused across calls, already mapped), else from torch's
// allocator through the stable C shim's aoti_torch_empty_strided: one direct
// call into at::empty_strided.  (torch::stable::empty goes through the boxed
// dispatcher by op name, a lookup and a stack per call: measurably slower
// for one-row calls.)  A large CPU one gets the huge-page advice before the
// kernel's first write (common/pages.h: a fresh 48 MB y otherwise costs
// ~12k page faults per call).
inline Tensor empty(IntHeaderOnlyArrayRef sizes, ScalarType dtype, const Device &device) {
    constexpr size_t kMaxDim = 8;
    const size_t ndim = sizes.size();
    COMERA_CHECK(ndim <= kMaxDim, "comera: outputs have at most ", kMaxDim, " dims");
    int64_t strides[kMaxDim];
    int64_t stride = 1;
    for (size_t i = ndim; i-- > 0;) {
        strides[i] = stride;
        stride *= sizes[i] > 1 ? sizes[i] : 1;
    }
    const bool cpu = device.type() == torch::headeronly::DeviceType::CPU;
    uint64_t bytes = 0;
    if (cpu) {
        bytes = aoti_torch_dtype_element_size(shim_dtype(dtype));
        for (size_t i = 0; i < ndim; i++) bytes *= static_cast<uint64_t>(sizes[i]);
        if (bytes >= COMERA_OUTPOOL_MIN_BYTES)
            if (void *block = comera_outpool_take(static_cast<size_t>(bytes)))
                return pooled_tensor(block, ndim, sizes.data(), strides, dtype);
    }
    AtenTensorHandle out = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
        static_cast<int64_t>(ndim), sizes.data(), strides, shim_dtype(dtype),
        is_cuda(device) ? aoti_torch_device_type_cuda() : aoti_torch_device_type_cpu(),
        is_cuda(device) ? static_cast<int32_t>(device.index()) : 0, &out));
    Tensor t(out);
    if (cpu && bytes >= COMERA_HUGE_ADVICE_MIN_BYTES)  // spares small outputs the data_ptr call
        comera_advise_huge_pages(t.data_ptr(), static_cast<size_t>(bytes));
    return t;
}

// Fresh tensors shaped like each of ts (gradient outputs; ts are contiguous).
inline std::vector<Tensor> empty_like_all(const std::vector<Tensor> &ts) {
    std::vector<Tensor> out;
    out.reserve(ts.size());
    for (const auto &t : ts) out.push_back(empty(t.sizes(), t.scalar_type(), t.device()));
    return out;
}

// Threads for the C kernels: torch's intra-op setting (torch.set_num_threads).
inline int num_threads() { return static_cast<int>(torch::stable::get_num_threads()); }

// COMERA_DT_* (comera/cuda.h) of a dtype, or -1 where the C ABI has none.
inline int dtype_code(ScalarType t) {
    switch (t) {
        case ScalarType::Float: return 0;     // COMERA_DT_F32
        case ScalarType::Double: return 1;    // COMERA_DT_F64
        case ScalarType::BFloat16: return 2;  // COMERA_DT_BF16
        case ScalarType::Half: return 3;      // COMERA_DT_F16
        default: return -1;
    }
}

// ---- C status codes

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
        case COMERA_ERR_OFFSETS: raise_value_error(text);
        case COMERA_ERR_INDEX: raise_index_error(text);
        case COMERA_ERR_ARG:
            if (arg == ArgError::Value) raise_value_error(text);
            raise_runtime_error(text);
        default: raise_runtime_error(text);
    }
}

inline void check_status(int rc, const char *op, ArgError arg = ArgError::Runtime) {
    check_status(rc, op, [](int) { return std::string(); }, arg);
}

#ifdef COMERA_WITH_CUDA
// ---- CUDA: device guard, current stream, the extension's cuBLAS handles

// Sets the current CUDA device to the tensors' for the call (a no-op holder
// on the CPU).
struct CudaGuard {
    std::optional<torch::stable::accelerator::DeviceGuard> guard;
    explicit CudaGuard(const Device &d) {
        if (is_cuda(d)) guard.emplace(d.index());
    }
};

// torch's current stream of a device, through the stable accelerator API.
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 13
inline cudaStream_t current_stream(const Device &d) {
    return static_cast<cudaStream_t>(
        torch::stable::accelerator::getCurrentStream(d.index()).nativeHandle());
}
#else
// torch < 2.13 (a source build against a GPU image's torch): its stable
// Stream has no native handle; the CUDA shim has one, in libtorch_cuda, which
// this module does not link, so it is looked up in the loaded library.
inline cudaStream_t current_stream(const Device &d) {
    using Fn = AOTITorchError (*)(int32_t, void **);
    static Fn fn = [] {
        void *lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
        return lib ? reinterpret_cast<Fn>(dlsym(lib, "aoti_torch_get_current_cuda_stream"))
                   : nullptr;
    }();
    COMERA_CHECK(fn != nullptr, "comera: libtorch_cuda.so is not loaded (import torch first)");
    void *stream = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(fn(static_cast<int32_t>(d.index()), &stream));
    return static_cast<cudaStream_t>(stream);
}
#endif

// One cuBLAS handle per (thread, device), owned by the extension: torch's
// handle pool (at::cuda::getCurrentCUDABlasHandle) is not in the stable ABI.
// Per thread, not per stream: a CUDA graph captures on a stream of its own,
// and cublasCreate fails during a capture (seen on an H200), while the
// warm-up before a capture runs on the same threads (the caller's and
// autograd's device thread) and creates the handles there.  The kernels bind
// the call's stream (cublasSetStream, allowed during a capture) every call;
// a handle used by one thread only needs no lock.  Default math mode: no
// TF32 (torch.backends.cuda.matmul.allow_tf32 does not reach these handles).
// Handles live until the process ends (as torch's do).
inline cublasHandle_t cublas_handle(const Device &d, cudaStream_t stream) {
    thread_local std::map<int, cublasHandle_t> handles;
    const int device = static_cast<int>(d.index());
    auto it = handles.find(device);
    if (it != handles.end()) return it->second;
    cublasHandle_t h = nullptr;
    cublasStatus_t st = cublasCreate(&h);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (st != CUBLAS_STATUS_SUCCESS && cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
        capture != cudaStreamCaptureStatusNone)
        raise_runtime_error(str("comera: this thread's first TT op on ", device_name(d),
                                " ran inside a CUDA graph capture, where cuBLAS cannot "
                                "start; run the step once before capturing it (a warm-up)"));
    COMERA_CHECK(st == CUBLAS_STATUS_SUCCESS, "comera: cublasCreate failed with status ",
                 static_cast<int>(st), " on ", device_name(d));
    handles.emplace(device, h);
    return h;
}
#else
// A build without CUDA registers no CUDA kernels: nothing to guard.
struct CudaGuard {
    explicit CudaGuard(const Device &) {}
};
#endif

}  // namespace comera_glue
