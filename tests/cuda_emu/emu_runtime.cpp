/* CPU stand-ins for the CUDA runtime and cuBLAS calls that the kernels make,
 * defined with the signatures of the real headers.  cublasGemmEx checks its
 * arguments the way cuBLAS documents (leading dimensions, supported type
 * combinations) and computes in the requested compute type. */
#include "cuda_emulate.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

thread_local uint3 threadIdx, blockIdx;
thread_local dim3 blockDim, gridDim;

namespace comera_emu {
Counts counts = {0, 0, 0};
Counts Counts::now() { return counts; }

// A GPU runs blocks and threads in no fixed order; the kernels must not
// depend on one.  Each launch runs its (block, thread) pairs in a fresh
// random order (seed: COMERA_EMU_SEED, default 1), so a kernel that reads
// what another thread of the same launch writes fails here too.
static std::mt19937_64 &order_rng() {
    static std::mt19937_64 rng([] {
        const char *s = std::getenv("COMERA_EMU_SEED");
        unsigned long long seed = s ? std::strtoull(s, nullptr, 10) : 1;
        std::printf("cuda_emu: (block, thread) order shuffled with COMERA_EMU_SEED=%llu\n", seed);
        return seed;
    }());
    return rng;
}

void launch(unsigned grid, unsigned block, void *, const std::function<void()> &body) {
    counts.kernels++;
    gridDim = dim3(grid, 1, 1);
    blockDim = dim3(block, 1, 1);
    std::vector<uint64_t> order((size_t)grid * block);
    for (size_t i = 0; i < order.size(); i++) order[i] = i;
    std::shuffle(order.begin(), order.end(), order_rng());
    for (uint64_t i : order) {
        blockIdx = make_uint3((unsigned)(i / block), 0, 0);
        threadIdx = make_uint3((unsigned)(i % block), 0, 0);
        body();
    }
}

// The barrier of the block that launch_block runs (one at a time): the last
// thread to arrive publishes the OR of the predicates and opens the next round.
struct BlockBarrier {
    std::mutex m;
    std::condition_variable cv;
    unsigned threads = 0, waiting = 0;
    unsigned long round = 0;
    int pending = 0, result = 0;
};
static BlockBarrier block_barrier;

static int block_sync(int predicate) {
    BlockBarrier &b = block_barrier;
    std::unique_lock<std::mutex> lock(b.m);
    const unsigned long round = b.round;
    b.pending |= predicate != 0;
    if (++b.waiting == b.threads) {
        b.result = b.pending;
        b.pending = 0;
        b.waiting = 0;
        b.round++;
        b.cv.notify_all();
        return b.result;
    }
    b.cv.wait(lock, [&] { return b.round != round; });
    return b.result;  // no later round can end before this thread arrives there
}

void launch_block(unsigned threads, void *, const std::function<void()> &body) {
    counts.kernels++;
    block_barrier.threads = threads;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; t++)
        pool.emplace_back([t, threads, &body] {
            gridDim = dim3(1, 1, 1);
            blockDim = dim3(threads, 1, 1);
            blockIdx = make_uint3(0, 0, 0);
            threadIdx = make_uint3(t, 0, 0);
            body();
        });
    for (std::thread &th : pool) th.join();
}
}  // namespace comera_emu

void __syncthreads() { comera_emu::block_sync(0); }
int __syncthreads_or(int predicate) { return comera_emu::block_sync(predicate); }

cudaError_t cudaGetLastError(void) { return cudaSuccess; }

cudaError_t cudaMemsetAsync(void *p, int value, size_t count, cudaStream_t) {
    comera_emu::counts.copies++;
    memset(p, value, count);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t) {
    comera_emu::counts.copies++;
    if (kind != cudaMemcpyDeviceToDevice) return cudaErrorInvalidValue;
    if (count) memmove(dst, src, count);
    return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, enum cudaMemcpyKind kind,
                              cudaStream_t) {
    comera_emu::counts.copies++;
    if (width > dpitch || width > spitch || kind != cudaMemcpyDeviceToDevice)
        return cudaErrorInvalidValue;
    for (size_t r = 0; r < height; r++)
        memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return cudaSuccess;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }

namespace {
double load(const void *p, cudaDataType t, size_t i) {
    switch (t) {
        case CUDA_R_32F: return ((const float *)p)[i];
        case CUDA_R_64F: return ((const double *)p)[i];
        case CUDA_R_16BF: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
        case CUDA_R_16F: return __half2float(((const __half *)p)[i]);
        default: return 0;
    }
}
void store(void *p, cudaDataType t, size_t i, double v) {
    switch (t) {
        case CUDA_R_32F: ((float *)p)[i] = (float)v; break;
        case CUDA_R_64F: ((double *)p)[i] = v; break;
        case CUDA_R_16BF: ((__nv_bfloat16 *)p)[i] = __float2bfloat16((float)v); break;
        case CUDA_R_16F: ((__half *)p)[i] = __float2half((float)v); break;
        default: break;
    }
}
}  // namespace

/* column-major C (m x n) = op(A) (m x k) op(B) (k x n) (alpha) + beta C */
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType at,
                            int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                            void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
    comera_emu::counts.blas++;
    if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    int arows = ta == CUBLAS_OP_N ? m : k, brows = tb == CUBLAS_OP_N ? k : n;
    if (lda < (arows > 1 ? arows : 1) || ldb < (brows > 1 ? brows : 1) || ldc < (m > 1 ? m : 1)) {
        fprintf(stderr, "emulated cublasGemmEx: bad leading dimension\n");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    bool f64 = compute == CUBLAS_COMPUTE_64F;
    bool ok = f64 ? (at == CUDA_R_64F && bt == CUDA_R_64F && ct == CUDA_R_64F)
                  : compute == CUBLAS_COMPUTE_32F && at == bt &&
                        (ct == at || (ct == CUDA_R_32F && at != CUDA_R_64F)) &&
                        at != CUDA_R_64F;
    if (!ok) {
        fprintf(stderr, "emulated cublasGemmEx: unsupported type combination\n");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    double al = f64 ? *(const double *)alpha : *(const float *)alpha;
    double be = f64 ? *(const double *)beta : *(const float *)beta;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s64 = 0;
            float s32 = 0;
            for (int l = 0; l < k; l++) {
                size_t ai = ta == CUBLAS_OP_N ? (size_t)i + (size_t)l * lda : (size_t)l + (size_t)i * lda;
                size_t bi = tb == CUBLAS_OP_N ? (size_t)l + (size_t)j * ldb : (size_t)j + (size_t)l * ldb;
                double p = load(A, at, ai) * load(B, bt, bi);
                if (f64) s64 += p; else s32 += (float)p;
            }
            double s = f64 ? s64 : (double)s32;
            size_t ci = (size_t)i + (size_t)j * ldc;
            double prev = be != 0 ? load(C, ct, ci) : 0.0;
            store(C, ct, ci, al * s + be * prev);
        }
    return CUBLAS_STATUS_SUCCESS;
}
