// Shared pieces of the comera CUDA kernels: element types, conversions, the
// launch helper, and the row-major wrapper around cublasGemmEx.
//
// Every kernel here is written so that each thread works alone (grid-stride
// loops, no shared memory, no __syncthreads, no atomics).  That keeps them
// simple and deterministic, and lets tests/cuda_emu compile this very code
// with a host compiler (COMERA_CUDA_EMULATE) and run it on the CPU against
// the C kernels: the only way to test it on a machine without a GPU.  The
// one exception, the gate step (gate_prox/step.cu), is a single block whose
// threads agree through __syncthreads_or (COMERA_LAUNCH_BLOCK); the
// emulation runs such a block's threads side by side.
#ifndef COMERA_CUDA_COMMON_CUH
#define COMERA_CUDA_COMMON_CUH

#ifdef COMERA_CUDA_EMULATE
#include "cuda_emulate.h"  // defines __global__ & co. before any CUDA header
#endif

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <limits.h>
#include <stdint.h>

#include <initializer_list>

#include "comera/cuda.h"

namespace comera_cuda {

// Accumulator type per element type: double for double, float otherwise.
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

template <typename T> __host__ __device__ __forceinline__ float to_f(T v) { return (float)v; }
template <> __host__ __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
template <> __host__ __device__ __forceinline__ float to_f<__half>(__half v) {
    return __half2float(v);
}

template <typename A, typename T> __host__ __device__ __forceinline__ A to_acc(T v) {
    return (A)to_f<T>(v);
}
template <> __host__ __device__ __forceinline__ double to_acc<double, double>(double v) {
    return v;
}

template <typename T, typename A> __host__ __device__ __forceinline__ T from_acc(A v) {
    return (T)v;
}
template <> __host__ __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) {
    return __float2bfloat16(v);
}
template <> __host__ __device__ __forceinline__ __half from_acc<__half, float>(float v) {
    return __float2half(v);
}

template <typename T> struct DType;
template <> struct DType<float> {
    static const cudaDataType_t cuda = CUDA_R_32F;
    static const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
};
template <> struct DType<double> {
    static const cudaDataType_t cuda = CUDA_R_64F;
    static const cublasComputeType_t compute = CUBLAS_COMPUTE_64F;
};
template <> struct DType<__nv_bfloat16> {
    static const cudaDataType_t cuda = CUDA_R_16BF;
    static const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
};
template <> struct DType<__half> {
    static const cudaDataType_t cuda = CUDA_R_16F;
    static const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
};

// One-dimensional launch shape for `n` independent work items; kernels loop
// with a grid stride, so the grid is capped.
const int kThreads = 256;
inline unsigned grid_for(int64_t n) {
    int64_t b = (n + kThreads - 1) / kThreads;
    if (b < 1) b = 1;
    if (b > 65535) b = 65535;
    return (unsigned)b;
}

#define COMERA_FOR_EACH(i, n)                                                         \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (int64_t)(n); \
         i += (int64_t)gridDim.x * blockDim.x)

// kernel<<<grid, block, 0, stream>>>(args...), or its CPU emulation.
#ifdef COMERA_CUDA_EMULATE
#define COMERA_LAUNCH(kernel, n, stream, ...) \
    comera_emu::launch(grid_for(n), kThreads, stream, [&]() { kernel(__VA_ARGS__); })
#else
#define COMERA_LAUNCH(kernel, n, stream, ...) \
    kernel<<<grid_for(n), kThreads, 0, stream>>>(__VA_ARGS__)
#endif

// kernel<<<1, threads, 0, stream>>>(args...): one block whose threads may
// synchronise; the emulation runs them as concurrent host threads.
#ifdef COMERA_CUDA_EMULATE
#define COMERA_LAUNCH_BLOCK(kernel, threads, stream, ...) \
    comera_emu::launch_block(threads, stream, [&]() { kernel(__VA_ARGS__); })
#else
#define COMERA_LAUNCH_BLOCK(kernel, threads, stream, ...) \
    kernel<<<1, threads, 0, stream>>>(__VA_ARGS__)
#endif

// Row-major GEMM on cuBLAS (column-major): C (M x N, ldc) = op(A) op(B) +
// beta C, with op(A) M x K (A stored K x M when ta), op(B) K x N (B stored
// N x K when tb).  Row-major C is column-major C^T = op(B)^T op(A)^T, so the
// operands swap places.  Types may differ (bfloat16 inputs, float32 output);
// `compute` is CUBLAS_COMPUTE_32F except for float64.
inline int gemm_rm(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                   const void *A, cudaDataType_t at, int64_t lda, const void *B,
                   cudaDataType_t bt, int64_t ldb, void *C, cudaDataType_t ct, int64_t ldc,
                   cublasComputeType_t compute, double beta) {
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
        ldc > INT_MAX)
        return COMERA_ERR_TOO_BIG;
    if (M == 0 || N == 0) return COMERA_OK;
    float alpha32 = 1.0f, beta32 = (float)beta;
    double alpha64 = 1.0, beta64 = beta;
    bool f64 = compute == CUBLAS_COMPUTE_64F;
    cublasStatus_t st = cublasGemmEx(
        h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M,
        (int)K, f64 ? (const void *)&alpha64 : (const void *)&alpha32, B, bt, (int)ldb, A, at,
        (int)lda, f64 ? (const void *)&beta64 : (const void *)&beta32, C, ct, (int)ldc,
        compute, CUBLAS_GEMM_DEFAULT);
    return st == CUBLAS_STATUS_SUCCESS ? (int)COMERA_OK : (int)COMERA_ERR_CUBLAS;
}

inline int launched() {
    return cudaGetLastError() == cudaSuccess ? (int)COMERA_OK : (int)COMERA_ERR_CUDA;
}

// A byte arena over the caller's workspace: hands out 256-byte aligned
// pieces in order (or, with base == nullptr, just counts the bytes).
struct Arena {
    char *base;
    size_t used;
    template <typename U> U *take(int64_t count) {
        size_t off = (used + 255) & ~(size_t)255;
        used = off + sizeof(U) * (size_t)(count > 0 ? count : 0);
        return base ? (U *)(base + off) : nullptr;
    }
    // One piece of `count` elements for each pointer in `out`, in order: the
    // runs of same-sized index arrays of the workspace layouts.
    template <typename U> void take_each(int64_t count, std::initializer_list<U **> out) {
        for (U **p : out) *p = take<U>(count);
    }
};


// ---- pieces of the split sums shared by the TT kernels: index arithmetic in
// 32 bits where it fits, dot products and strided sums in four partial sums,
// and the chunk of a split sum.

// o % mod in 32 bits where both fit (always, for a core's offsets): a 64-bit
// remainder costs several times more on a GPU, once per element read.
__host__ __device__ __forceinline__ int64_t mod_small(int64_t o, int64_t mod) {
    return ((o | mod) >> 32) == 0 ? (int64_t)((uint32_t)o % (uint32_t)mod) : o % mod;
}

// sum over k < n of a[k as] b[k bs] in four partial sums, added in a fixed
// order at the end: the four loads of a round are independent, so they are
// in flight together instead of one memory latency per term.  b may be in
// the element type (converted to a's accumulator type term by term).
template <typename A, typename B, typename I>
__host__ __device__ __forceinline__ A dot(const A *a, I as, const B *b, I bs, I n) {
    A s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    I k = 0;
    for (; k + 4 <= n; k += 4) {
        s0 += a[k * as] * to_acc<A>(b[k * bs]);
        s1 += a[(k + 1) * as] * to_acc<A>(b[(k + 1) * bs]);
        s2 += a[(k + 2) * as] * to_acc<A>(b[(k + 2) * bs]);
        s3 += a[(k + 3) * as] * to_acc<A>(b[(k + 3) * bs]);
    }
    for (; k < n; k++) s0 += a[k * as] * to_acc<A>(b[k * bs]);
    return (s0 + s1) + (s2 + s3);
}

// p[0] + p[stride] + ... + p[(n - 1) stride], four partial sums as in dot:
// the sums over split-K parts and gate chunks.
template <typename A>
__host__ __device__ __forceinline__ A sum_strided(const A *p, int64_t stride, int64_t n) {
    A s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        s0 += p[k * stride];
        s1 += p[(k + 1) * stride];
        s2 += p[(k + 2) * stride];
        s3 += p[(k + 3) * stride];
    }
    for (; k < n; k++) s0 += p[k * stride];
    return (s0 + s1) + (s2 + s3);
}

// a / b in 32 bits where both fit (the usual case): a 64-bit division costs
// several times more on a GPU, and the split kernels run millions of threads.
__host__ __device__ __forceinline__ int64_t div_small(int64_t a, int64_t b) {
    return ((a | b) >> 32) == 0 ? (int64_t)((uint32_t)a / (uint32_t)b) : a / b;
}

// The K chunk of a split product: about sqrt(K), within [16, 256], so that
// both a thread's share of the sum and the later sum over the parts are
// short.  A fixed chunk of 256 had threads run 256 steps for d(eff) over
// 5760 merged rows (91 us of a 415 us step on an H200); now 76 parts of 76.
inline int64_t split_chunk(int64_t K) {
    int64_t c = 16;
    while (c < 256 && c * c < K) c++;
    return c;
}

inline int64_t split_count(int64_t K) {
    int64_t c = split_chunk(K);
    return K > c ? (K + c - 1) / c : 1;
}

}  // namespace comera_cuda

#endif
