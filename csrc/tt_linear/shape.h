/* Derived sizes of a TT linear layer (internal to csrc/tt_linear).  Every
 * size is computed once, with overflow checks, by the builder in plan.c, so
 * the kernels use plain int64 arithmetic.  The struct itself is public
 * (comera_tt_linear_shape in comera/tt_linear.h) because it is part of a
 * prepared call. */
#ifndef COMERA_TT_LINEAR_SHAPE_H
#define COMERA_TT_LINEAR_SHAPE_H

#include "comera/tt_linear.h"

typedef comera_tt_linear_shape tt_shape;

int comera_tt_shape_build(const comera_tt_linear_desc *d, tt_shape *s);

/* Rows per block of the merge path: a block of the wider of x and dy stays
 * in L2 while it is read by the two products that use it. */
int64_t comera_tt_row_block(const tt_shape *s);

/* The same for the bfloat16 and float16 kernels (cpu_half.c): a multiple
 * of 32 rows, the AMX tiles' depth in the weight-gradient products. */
int64_t comera_tt_row_block_half(const tt_shape *s);

/* Both merge chains in float32 from the gated cores (cpu_f32.c), and back
 * through them: the bfloat16 and float16 kernels build V and U in float32. */
int comera_tt_merges_f32(const tt_shape *s, const float *eff, float *P);
int comera_tt_merges_bwd_f32(const tt_shape *s, const float *eff, const float *P, float *dP,
                             float *deff);

#endif
