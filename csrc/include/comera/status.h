/* Status codes of every comera C function, in one place.
 *
 * 0 is success, negative values are errors, positive values are results
 * that are not errors (COMERA_GATE_NAN).  comera_status_text gives a short
 * English description of any code (for messages; never NULL).
 */
#ifndef COMERA_STATUS_H
#define COMERA_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

enum {
    COMERA_OK = 0,
    COMERA_ERR_ARG = -1,      /* an invalid argument or descriptor */
    COMERA_ERR_OVERFLOW = -2, /* a derived size does not fit in int64 */
    COMERA_ERR_NOMEM = -3,    /* a host allocation failed */
    COMERA_ERR_INDEX = -4,    /* an embedding index outside [0, num_embeddings) */
    COMERA_ERR_OFFSETS = -5,  /* bag offsets that do not start at 0, decrease, or do not end at n */

    /* CUDA launchers only (comera/cuda.h) */
    COMERA_ERR_CUDA = -10,      /* a kernel launch or copy failed to enqueue */
    COMERA_ERR_CUBLAS = -11,    /* a cuBLAS call returned an error */
    COMERA_ERR_WORKSPACE = -12, /* the workspace passed in is too small */
    COMERA_ERR_TOO_BIG = -13,   /* a product dimension exceeds cuBLAS's int range */

    /* comera_gate_prox_*: a gate holds a NaN, nothing was changed */
    COMERA_GATE_NAN = 1
};

const char *comera_status_text(int status);

#ifdef __cplusplus
}
#endif
#endif
