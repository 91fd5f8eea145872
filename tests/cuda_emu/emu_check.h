/* What both emulation tests share: element conversions through double, the
 * per-type tolerances against the float64 C kernels, a reproducible uniform
 * draw in [-1, 1), and the pass/fail count.  Included by one test file per
 * program (internal linkage). */
#ifndef COMERA_EMU_CHECK_H
#define COMERA_EMU_CHECK_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdio>
#include <string>

#include "comera/dtype.h"

/* one step of a linear congruential generator: uniform in [-1, 1) */
static double urand_from(unsigned *state) {
    *state = *state * 1664525u + 1013904223u;
    return ((*state >> 8) & 0xFFFFFF) / 8388608.0 - 1.0;
}

template <typename T> T from_d(double v);
template <> float from_d<float>(double v) { return (float)v; }
template <> double from_d<double>(double v) { return v; }
template <> __nv_bfloat16 from_d<__nv_bfloat16>(double v) { return __float2bfloat16((float)v); }
template <> __half from_d<__half>(double v) { return __float2half((float)v); }
static double to_d(float v) { return v; }
static double to_d(double v) { return v; }
static double to_d(__nv_bfloat16 v) { return __bfloat162float(v); }
static double to_d(__half v) { return __half2float(v); }

/* the dtype code and the relative tolerance of each element type */
template <typename T> struct DT;
template <> struct DT<float> { enum { id = COMERA_DT_F32 }; static constexpr double tol = 2e-5; };
template <> struct DT<double> { enum { id = COMERA_DT_F64 }; static constexpr double tol = 1e-11; };
template <> struct DT<__nv_bfloat16> { enum { id = COMERA_DT_BF16 }; static constexpr double tol = 4e-2; };
template <> struct DT<__half> { enum { id = COMERA_DT_F16 }; static constexpr double tol = 6e-3; };

static int passed = 0, failed = 0;

static void check(bool ok, const std::string &what) {
    if (ok) {
        passed++;
    } else {
        failed++;
        printf("FAIL %s\n", what.c_str());
    }
}

#endif
