/* Derived sizes and workspace offsets of a TT linear layer (internal).
 * Every size is computed once here with overflow checks, so the kernels can
 * use plain int64 arithmetic. */
#ifndef COMERA_TT_LINEAR_SHAPE_H
#define COMERA_TT_LINEAR_SHAPE_H

#include "comera/tt_linear.h"

typedef struct tt_shape {
    int D, p;
    int64_t dims[COMERA_MAX_CORES];
    int64_t r[COMERA_MAX_CORES + 1];
    int64_t core_off[COMERA_MAX_CORES + 1]; /* offsets of cores in one buffer */
    int64_t in, out, in_pad, out_pad, rmid;
    /* merge chains: P_k is the product of cores first..k of its chain */
    int64_t P_off[COMERA_MAX_CORES + 1];
    /* sequential path, one row: Z_k = (r[k], R_k) for k = 0..p, then
     * Y_l = (M_l, r[p + l]) for l = 1..q */
    int64_t R[COMERA_MAX_CORES + 1]; /* R_k = prod dims[k..p-1] */
    int64_t M[COMERA_MAX_CORES + 1]; /* M_l = prod dims[p..p+l-1] */
    int64_t Z_off[COMERA_MAX_CORES + 1];
    int64_t Y_off[COMERA_MAX_CORES + 1];
    int64_t seq_state_max; /* largest single state, for gradient scratch */
    int64_t seq_total;
    double merge_flops;    /* building V and U once */
    double seq_row_flops;  /* forward flops of one row on the sequential path */
} tt_shape;

int comera_tt_shape_build(const comera_tt_linear_desc *d, tt_shape *s);

/* Rows per block of the merge path: a block of the wider of x and dy stays
 * in L2 while it is read by the two products that use it. */
int64_t comera_tt_row_block(const tt_shape *s);

#endif
