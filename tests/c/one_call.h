/* One-call forms of the comera C entry points for the tests (tests/c,
 * tests/fuzz, tests/cuda_emu): prepare, then run, as the torch glue does.
 * The library itself takes a prepared call (comera_*_prepare) and its
 * kernels do not check it again; these wrappers keep each test's meaning
 * (a refused argument still comes back as the kernel call's status). */
#ifndef COMERA_TEST_ONE_CALL_H
#define COMERA_TEST_ONE_CALL_H

#include <stddef.h>

#include "comera/tt_embedding.h"
#include "comera/tt_linear.h"

static inline int linear_fwd_f32(const comera_tt_linear_desc *d, int path, int64_t batch,
                                 const float *x, const float *const *cores,
                                 const float *const *gates, const float *bias, float *y,
                                 float *t, int nthreads) {
    comera_tt_linear_prep p;
    int rc = comera_tt_linear_prepare(d, batch, path, &p);
    return rc ? rc : comera_tt_linear_fwd_f32(&p, x, cores, gates, bias, y, t, nthreads);
}

static inline int linear_fwd_f64(const comera_tt_linear_desc *d, int path, int64_t batch,
                                 const double *x, const double *const *cores,
                                 const double *const *gates, const double *bias, double *y,
                                 double *t, int nthreads) {
    comera_tt_linear_prep p;
    int rc = comera_tt_linear_prepare(d, batch, path, &p);
    return rc ? rc : comera_tt_linear_fwd_f64(&p, x, cores, gates, bias, y, t, nthreads);
}

static inline int linear_bwd_f32(const comera_tt_linear_desc *d, int path, int64_t batch,
                                 const float *dy, const float *x, const float *t,
                                 const float *const *cores, const float *const *gates,
                                 float *dx, float *const *dcores, float *const *dgates,
                                 float *dbias, int nthreads) {
    comera_tt_linear_prep p;
    int rc = comera_tt_linear_prepare(d, batch, path, &p);
    return rc ? rc
              : comera_tt_linear_bwd_f32(&p, dy, x, t, cores, gates, dx, dcores, dgates, dbias,
                                         nthreads);
}

static inline int linear_bwd_f64(const comera_tt_linear_desc *d, int path, int64_t batch,
                                 const double *dy, const double *x, const double *t,
                                 const double *const *cores, const double *const *gates,
                                 double *dx, double *const *dcores, double *const *dgates,
                                 double *dbias, int nthreads) {
    comera_tt_linear_prep p;
    int rc = comera_tt_linear_prepare(d, batch, path, &p);
    return rc ? rc
              : comera_tt_linear_bwd_f64(&p, dy, x, t, cores, gates, dx, dcores, dgates, dbias,
                                         nthreads);
}

/* comera_tt_embedding_prepare + comera_tt_embedding_check_batch. */
static inline int embedding_check_batch(const comera_tt_embedding_desc *d,
                                        const comera_tt_embedding_batch *b, int64_t *bad) {
    comera_tt_embedding_prep p;
    int rc = comera_tt_embedding_prepare(d, COMERA_REUSE_AUTO, &p);
    return rc ? rc : comera_tt_embedding_check_batch(&p, b, bad);
}

static inline int embedding_prepare_checked(const comera_tt_embedding_desc *d,
                                            const comera_tt_embedding_batch *b, int reuse,
                                            comera_tt_embedding_prep *p) {
    /* the batch is checked before `reuse`, as the one-call kernels did */
    int rc = comera_tt_embedding_prepare(d, COMERA_REUSE_AUTO, p);
    if (!rc) rc = comera_tt_embedding_check_batch(p, b, NULL);
    return rc ? rc : comera_tt_embedding_prepare(d, reuse, p);
}

static inline int embedding_fwd_f32(const comera_tt_embedding_desc *d,
                                    const comera_tt_embedding_batch *b, const float *psw,
                                    int reuse, const float *const *cores,
                                    const float *const *gates, float *out, int nthreads) {
    comera_tt_embedding_prep p;
    int rc = embedding_prepare_checked(d, b, reuse, &p);
    return rc ? rc : comera_tt_embedding_fwd_f32(&p, b, psw, cores, gates, out, nthreads);
}

static inline int embedding_fwd_f64(const comera_tt_embedding_desc *d,
                                    const comera_tt_embedding_batch *b, const double *psw,
                                    int reuse, const double *const *cores,
                                    const double *const *gates, double *out, int nthreads) {
    comera_tt_embedding_prep p;
    int rc = embedding_prepare_checked(d, b, reuse, &p);
    return rc ? rc : comera_tt_embedding_fwd_f64(&p, b, psw, cores, gates, out, nthreads);
}

static inline int embedding_bwd_f32(const comera_tt_embedding_desc *d,
                                    const comera_tt_embedding_batch *b, const float *psw,
                                    int reuse, const float *grad_out, const float *const *cores,
                                    const float *const *gates, float *const *dcores,
                                    float *const *dgates, int nthreads) {
    comera_tt_embedding_prep p;
    int rc = embedding_prepare_checked(d, b, reuse, &p);
    return rc ? rc
              : comera_tt_embedding_bwd_f32(&p, b, psw, grad_out, cores, gates, dcores, dgates,
                                            nthreads);
}

static inline int embedding_bwd_f64(const comera_tt_embedding_desc *d,
                                    const comera_tt_embedding_batch *b, const double *psw,
                                    int reuse, const double *grad_out,
                                    const double *const *cores, const double *const *gates,
                                    double *const *dcores, double *const *dgates, int nthreads) {
    comera_tt_embedding_prep p;
    int rc = embedding_prepare_checked(d, b, reuse, &p);
    return rc ? rc
              : comera_tt_embedding_bwd_f64(&p, b, psw, grad_out, cores, gates, dcores, dgates,
                                            nthreads);
}

#ifdef COMERA_CUDA_H /* the CUDA launchers (tests/cuda_emu) */
static inline int linear_cuda_workspace(const comera_tt_linear_desc *d, int64_t batch, int dtype,
                                        int has_bias, int backward, size_t *bytes) {
    comera_tt_linear_prep p;
    int rc = comera_tt_linear_prepare(d, batch, COMERA_PATH_AUTO, &p);
    return rc ? rc : comera_tt_linear_cuda_workspace(&p, dtype, has_bias, backward, bytes);
}

static inline int linear_fwd_cuda(const comera_tt_linear_desc *d, int path, int dtype,
                                  int64_t batch, const void *x, const void *const *cores,
                                  const void *const *gates, const void *bias, void *y, void *t,
                                  void *ws, size_t ws_bytes, cublasHandle_t h, cudaStream_t s) {
    comera_tt_linear_prep p;
    int rc = comera_tt_linear_prepare(d, batch, path, &p);
    return rc ? rc
              : comera_tt_linear_fwd_cuda(&p, dtype, x, cores, gates, bias, y, t, ws, ws_bytes,
                                          h, s);
}

static inline int linear_bwd_cuda(const comera_tt_linear_desc *d, int path, int dtype,
                                  int64_t batch, const void *dy, const void *x, const void *t,
                                  const void *const *cores, const void *const *gates, void *dx,
                                  void *const *dcores, void *const *dgates, void *dbias,
                                  void *ws, size_t ws_bytes, cublasHandle_t h, cudaStream_t s) {
    comera_tt_linear_prep p;
    int rc = comera_tt_linear_prepare(d, batch, path, &p);
    return rc ? rc
              : comera_tt_linear_bwd_cuda(&p, dtype, dy, x, t, cores, gates, dx, dcores, dgates,
                                          dbias, ws, ws_bytes, h, s);
}

static inline int embedding_cuda_workspace(const comera_tt_embedding_desc *d,
                                           const comera_tt_embedding_batch *b, int dtype,
                                           int backward, size_t *bytes) {
    comera_tt_embedding_prep p;
    int rc = comera_tt_embedding_prepare(d, COMERA_REUSE_AUTO, &p);
    return rc ? rc : comera_tt_embedding_cuda_workspace(&p, b, dtype, backward, bytes);
}

static inline int embedding_fwd_cuda(const comera_tt_embedding_desc *d,
                                     const comera_tt_embedding_batch *b, int dtype,
                                     const void *psw, int reuse, const void *const *cores,
                                     const void *const *gates, void *out, void *ws,
                                     size_t ws_bytes, cudaStream_t s) {
    comera_tt_embedding_prep p;
    int rc = comera_tt_embedding_prepare(d, reuse, &p);
    return rc ? rc
              : comera_tt_embedding_fwd_cuda(&p, b, dtype, psw, cores, gates, out, ws, ws_bytes,
                                             s);
}

static inline int embedding_bwd_cuda(const comera_tt_embedding_desc *d,
                                     const comera_tt_embedding_batch *b, int dtype,
                                     const void *psw, int reuse, const void *grad_out,
                                     const void *const *cores, const void *const *gates,
                                     void *const *dcores, void *const *dgates, void *ws,
                                     size_t ws_bytes, cudaStream_t s) {
    comera_tt_embedding_prep p;
    int rc = comera_tt_embedding_prepare(d, reuse, &p);
    return rc ? rc
              : comera_tt_embedding_bwd_cuda(&p, b, dtype, psw, grad_out, cores, gates, dcores,
                                             dgates, ws, ws_bytes, s);
}
#endif

#endif
