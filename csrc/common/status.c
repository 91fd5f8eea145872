/* Text of the status codes (comera/status.h), for error messages. */
#include "comera/status.h"

const char *comera_status_text(int status) {
    switch (status) {
        case COMERA_OK: return "success";
        case COMERA_ERR_ARG: return "invalid arguments";
        case COMERA_ERR_OVERFLOW: return "sizes overflow 64-bit integers";
        case COMERA_ERR_NOMEM: return "out of memory";
        case COMERA_ERR_INDEX: return "index out of range";
        case COMERA_ERR_OFFSETS: return "invalid bag offsets";
        case COMERA_ERR_CUDA: return "a CUDA kernel or copy failed to launch";
        case COMERA_ERR_CUBLAS: return "a cuBLAS call failed";
        case COMERA_ERR_WORKSPACE: return "workspace too small (internal error)";
        case COMERA_ERR_TOO_BIG: return "a dimension exceeds 2^31 - 1, cuBLAS's limit";
        case COMERA_GATE_NAN: return "a gate holds a NaN";
        default: return "unknown error";
    }
}
