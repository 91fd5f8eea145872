/* Host emulation of the little of CUDA that csrc/cuda uses, so that the
 * kernels and their cuBLAS orchestration can be compiled with g++
 * (-DCOMERA_CUDA_EMULATE) and checked on a machine without a GPU.
 *
 * The kernels are written to need no shared memory, barriers or atomics
 * (see csrc/cuda/common.cuh), so running every (block, thread) pair one after
 * another is exact.  cuBLAS and the runtime calls are emulated in
 * emu_runtime.cpp with their real signatures from the real headers. */
#ifndef COMERA_CUDA_EMULATE_H
#define COMERA_CUDA_EMULATE_H

#define __global__
#define __device__
#define __host__

#include <vector_types.h>

#include <functional>

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

namespace comera_emu {
/* counts launches, so tests can check how many kernels an op issues */
extern long launches;
void launch(unsigned grid, unsigned block, void *stream, const std::function<void()> &body);
}  // namespace comera_emu

#endif
