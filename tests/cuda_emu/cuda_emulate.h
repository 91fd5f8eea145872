/* Host emulation of the little of CUDA that the kernels (csrc/<op>/cuda.cu)
 * use, so that the kernels and their cuBLAS orchestration can be compiled
 * with g++ (-DCOMERA_CUDA_EMULATE) and checked on a machine without a GPU.
 *
 * The kernels are written to need no shared memory, barriers or atomics
 * (see csrc/common/cuda_common.cuh), so running every (block, thread) pair
 * one after another, in any order, is exact; launch() shuffles the order.
 * The one-block kernels that meet at barriers (COMERA_LAUNCH_BLOCK) run
 * their threads as host threads instead (launch_block).  cuBLAS and the runtime calls are emulated in
 * emu_runtime.cpp with their real signatures from the real headers. */
#ifndef COMERA_CUDA_EMULATE_H
#define COMERA_CUDA_EMULATE_H

#define __global__
#define __device__
#define __host__
#define __launch_bounds__(...)

#include <vector_types.h>

#include <functional>
#include <vector>

/* per host thread: a block launched by launch_block runs its threads side by side */
extern thread_local uint3 threadIdx, blockIdx;
extern thread_local dim3 blockDim, gridDim;

/* The block barriers, for kernels launched by launch_block only. */
void __syncthreads();
int __syncthreads_or(int predicate);

namespace comera_emu {
/* What the emulated entry points have issued since the program started:
 * kernel launches (launch()), cuBLAS calls (every emulated cublas* product)
 * and copies (cudaMemcpy*Async, cudaMemsetAsync).  A test reads them before
 * and after one op call (Counts::now() and operator-) to check how many of
 * each the op issues: tests/cuda_emu/launch_counts.txt holds the expected
 * numbers. */
struct Counts {
    long kernels, blas, copies;
    static Counts now();
    long total() const { return kernels + blas + copies; }
    Counts operator-(const Counts &o) const {
        return Counts{kernels - o.kernels, blas - o.blas, copies - o.copies};
    }
    bool operator==(const Counts &o) const {
        return kernels == o.kernels && blas == o.blas && copies == o.copies;
    }
};
extern Counts counts;
void launch(unsigned grid, unsigned block, void *stream, const std::function<void()> &body);
/* One block of `threads` threads, each a host thread, that may meet at
 * __syncthreads / __syncthreads_or (COMERA_LAUNCH_BLOCK). */
void launch_block(unsigned threads, void *stream, const std::function<void()> &body);
}  // namespace comera_emu

/* A workspace with guard bytes after it.  Every byte starts as 0xFF, which
 * reads as NaN in float32, float64, bfloat16 and float16 (0xA5 read as a
 * tiny number and hid reads of unwritten workspace): a kernel that reads a
 * workspace entry it never wrote turns its result into NaN and fails the
 * comparison; one that writes past the end leaves a guard byte changed. */
struct Guarded {
    std::vector<unsigned char> buf;
    size_t bytes;
    explicit Guarded(size_t n) : buf(n + 4096, 0xFF), bytes(n) {}
    bool intact() const {
        for (size_t i = bytes; i < buf.size(); i++)
            if (buf[i] != 0xFF) return false;
        return true;
    }
};

#endif
