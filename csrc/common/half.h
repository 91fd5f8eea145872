/* bfloat16 and float16 to and from float32, one value at a time (internal
 * to csrc): the reference conversions.  The vector forms in gemm_isa.c and
 * gemm_amx.c give the same bits.  Narrowing rounds to nearest, ties to
 * even, as torch does; a NaN stays a (quiet) NaN, too large a float16
 * becomes an infinity.  Both 16-bit types are stored as uint16_t and named
 * by COMERA_DT_BF16 / COMERA_DT_F16 (comera/dtype.h). */
#ifndef COMERA_HALF_H
#define COMERA_HALF_H

#include <stdint.h>
#include <string.h>

#include "comera/dtype.h"

static inline uint32_t comera_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float comera_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float comera_bf16_to_f32(uint16_t h) {
    return comera_f32_from_bits((uint32_t)h << 16);
}

static inline uint16_t comera_f32_to_bf16(float f) {
    uint32_t u = comera_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float comera_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in float */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return comera_f32_from_bits(sign | 0x7f800000u | (man << 13));
    return comera_f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

static inline uint16_t comera_f32_to_f16(float f) {
    uint32_t u = comera_f32_bits(f), sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);   /* NaN */
    if (u >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* 65520 and up: inf */
    if (u < 0x38800000u) {
        /* below 2^-14: a subnormal result, rounded by one float addition
         * (the sum's exponent puts the half's last bit at the float's) */
        float magic = comera_f32_from_bits(126u << 23);
        uint32_t s = comera_f32_bits(comera_f32_from_bits(u) + magic) - (126u << 23);
        return (uint16_t)(sign | s);
    }
    u += 0xc8000fffu + ((u >> 13) & 1u); /* rebias the exponent (-112 << 23), round */
    return (uint16_t)(sign | (u >> 13));
}

/* dt is COMERA_DT_BF16 or COMERA_DT_F16 */
static inline float comera_half_to_f32(int dt, uint16_t h) {
    return dt == COMERA_DT_BF16 ? comera_bf16_to_f32(h) : comera_f16_to_f32(h);
}

static inline uint16_t comera_f32_to_half(int dt, float f) {
    return dt == COMERA_DT_BF16 ? comera_f32_to_bf16(f) : comera_f32_to_f16(f);
}

#endif
