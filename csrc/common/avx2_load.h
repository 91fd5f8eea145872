/* 8 elements of a row as float32, read where they lie: float32 as it is,
 * bfloat16 or float16 widened in registers (internal to csrc; the AVX2
 * kernels of common/gemm_avx2.c and common/gemm_dot.c). */
#ifndef COMERA_AVX2_LOAD_H
#define COMERA_AVX2_LOAD_H

#include <stdint.h>

#include "comera/dtype.h"
#include "common/gemm_isa.h"

#ifdef COMERA_X86_VARIANTS
#include <immintrin.h>

/* elements off..off+7 of p, of type dt (COMERA_DT_F32, _BF16 or _F16) */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 comera_avx2_load8(int dt, const void *p, int64_t off) {
    if (dt == COMERA_DT_F32) return _mm256_loadu_ps((const float *)p + off);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + off));
    if (dt == COMERA_DT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#endif
