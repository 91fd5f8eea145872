/* Element type codes of the C ABI's typed entry points (the CUDA launchers,
 * the CPU kernels for bfloat16 and float16).  Reduced precision (bfloat16,
 * float16) reads and writes its own type and accumulates in float32. */
#ifndef COMERA_DTYPE_H
#define COMERA_DTYPE_H

#ifdef __cplusplus
extern "C" {
#endif

enum {
    COMERA_DT_F32 = 0,
    COMERA_DT_F64 = 1,
    COMERA_DT_BF16 = 2,
    COMERA_DT_F16 = 3
};

#ifdef __cplusplus
}
#endif
#endif
