/* CUDA launchers: C ABI (docs/design.md section 5).
 *
 * Plain declarations, no torch and no CUDA headers needed to include this:
 * the stream and the cuBLAS handle are opaque pointers here (the same
 * typedefs as cuda_runtime_api.h and cublas_api.h, which may be included
 * before or after).  The torch glue (csrc/<op>/op.cpp) passes in the current
 * stream, torch's cuBLAS handle, and a device workspace that it allocated
 * from the caching allocator, so nothing here allocates, frees or waits for
 * the device: every launcher only enqueues work on `stream` and can be
 * captured into a CUDA graph.
 *
 * Element types: COMERA_DT_* (comera/dtype.h).  Reduced precision (bfloat16, float16)
 * reads and writes its own type and accumulates in float32; float32
 * accumulates in float32, float64 in float64.
 */
#ifndef COMERA_CUDA_H
#define COMERA_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "comera/dtype.h"
#include "comera/gate_prox.h"
#include "comera/status.h"
#include "comera/tt_embedding.h"
#include "comera/tt_linear.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *cudaStream_t;
typedef struct cublasContext *cublasHandle_t;

/* Errors: comera/status.h (COMERA_ERR_CUDA and the ones after it are the
 * launchers' own).  Every launcher takes a call prepared on the host
 * (comera_tt_linear_prepare, comera_tt_embedding_prepare) and does not
 * check the descriptor again. */

/* ---- TT linear (merge path) ---------------------------------------------
 *
 * Same arguments and results as comera_tt_linear_fwd/bwd_* in tt_linear.h,
 * with device pointers.  `cores` and `gates` are host arrays of device
 * pointers.  The prepared path is ignored: on the GPU every path runs the
 * merge algorithm: its batch work is four large GEMMs on tensor cores, while
 * the sequential path is a chain of batched small products that cuBLAS runs
 * far below peak, and for tiny batches both are bound by launch latency,
 * where merge issues fewer kernels (see csrc/tt_linear/cuda.cu).
 *
 * comera_tt_linear_cuda_workspace gives the bytes of workspace that the
 * forward (backward != 0: the backward) needs for the prepared batch. */
int comera_tt_linear_cuda_workspace(const comera_tt_linear_prep *p, int dtype, int has_bias,
                                    int backward, size_t *bytes);

int comera_tt_linear_fwd_cuda(const comera_tt_linear_prep *p, int dtype, const void *x,
                              const void *const *cores, const void *const *gates,
                              const void *bias, void *y, void *t,
                              void *workspace, size_t workspace_bytes,
                              cublasHandle_t handle, cudaStream_t stream);

/* dx may be NULL (not needed), dbias NULL when the layer has no bias.  All
 * outputs are overwritten. */
int comera_tt_linear_bwd_cuda(const comera_tt_linear_prep *p, int dtype, const void *dy,
                              const void *x, const void *t, const void *const *cores,
                              const void *const *gates, void *dx,
                              void *const *dcores, void *const *dgates, void *dbias,
                              void *workspace, size_t workspace_bytes,
                              cublasHandle_t handle, cudaStream_t stream);

/* ---- gate proximal step (comera::gate_prox_) -----------------------------
 *
 * The rule of comera_gate_prox_f32/f64 (comera/gate_prox.h) on device
 * data, all gates of one dtype.  `gates`, `signs`, `sizes` are HOST arrays
 * of num_gates entries (the gates' and int8 sign vectors' device pointers,
 * the lengths), like the C kernel's; they reach the kernels by value, as
 * launch parameters in chunks of COMERA_GATE_CHUNK gates, so the call makes
 * no host-to-device copy, never waits for the device, and can be captured in
 * a CUDA graph.  `live` (DEVICE, num_gates int64) receives each gate's live
 * count, -1 for a gate holding a NaN (then no gate changes); it is left on
 * the device for the caller.  threshold < 0 disables the dead zone; NaN is
 * an argument error. */
#define COMERA_GATE_CHUNK 64
int comera_gate_prox_cuda(int dtype, int64_t num_gates, void *const *gates,
                          int8_t *const *signs, const int64_t *sizes, double threshold,
                          int64_t min_live, int kill, int64_t *live, cudaStream_t stream);

/* ---- the whole gate step (comera::gate_step_) ------------------------------
 *
 * comera_gate_step_f32/f64's step (comera/gate_prox.h) on device data, all
 * gates of one dtype: the struct's tables (gates, signs, grads, saliency,
 * sizes) are HOST arrays, of device pointers and of lengths, which reach the
 * kernel by value as launch parameters; amount, frozen, nan_seen, nan_gates
 * and live are device pointers.  Up to COMERA_GATE_STEP_CHUNK gates take ONE
 * launch: one block, a thread per gate, the NaN check agreed on by the block
 * (__syncthreads_or) before any thread writes.  40 bytes of parameters per
 * gate: 20 KB for a full chunk, within the 32 KB that CUDA 12.1 allows from
 * sm_70 on (the build targets sm_80 and later).  More gates take a NaN pass
 * per chunk and then a step per chunk (each step reads every chunk's NaN
 * flags from live).  No copy, no wait: graph-capturable. */
#define COMERA_GATE_STEP_CHUNK 512
int comera_gate_step_cuda(int dtype, const comera_gate_step_args *a, cudaStream_t stream);

/* ---- TT embedding (comera::tt_embedding, tt_embedding_backward) ----------
 *
 * The lookups of comera_tt_embedding_fwd/bwd_* (tt_embedding.h) on device
 * data: the batch's indices and offsets are device pointers, `cores` and
 * `gates` host arrays of device pointers, psw (sum bags only, else NULL)
 * and the outputs device pointers.  The prepared `reuse` (as asked): NONE
 * contracts every index;
 * DEDUP and PREFIX sort the indices and contract each distinct row once (no
 * prefix sharing on the GPU); AUTO dedups when a row costs more than
 * sorting an index.  The backward always sorts: its sums run in a fixed
 * order, with no float atomics, so gradients are the same from run to run.
 *
 * Nothing here reads device data on the host: every buffer is sized by the
 * number of indices n (not by the number of distinct rows), so the calls are
 * CUDA-graph capturable.  Hence the indices and offsets are NOT validated:
 * an index outside [0, num_embeddings) reads as a NaN row (its bag is NaN)
 * and gets no gradient, offsets are clamped to [0, n].  The caller checks
 * them first where it may synchronise.
 *
 * comera_tt_embedding_cuda_workspace gives the workspace bytes of the
 * forward (backward != 0: the backward) for this batch's n and num_bags. */
int comera_tt_embedding_cuda_workspace(const comera_tt_embedding_prep *p,
                                       const comera_tt_embedding_batch *b, int dtype,
                                       int backward, size_t *bytes);

int comera_tt_embedding_fwd_cuda(const comera_tt_embedding_prep *p,
                                 const comera_tt_embedding_batch *b, int dtype, const void *psw,
                                 const void *const *cores, const void *const *gates, void *out,
                                 void *workspace, size_t workspace_bytes, cudaStream_t stream);

int comera_tt_embedding_bwd_cuda(const comera_tt_embedding_prep *p,
                                 const comera_tt_embedding_batch *b, int dtype, const void *psw,
                                 const void *grad_out, const void *const *cores,
                                 const void *const *gates, void *const *dcores,
                                 void *const *dgates, void *workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
