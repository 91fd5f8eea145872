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

#endif
