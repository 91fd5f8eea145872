/* Reused scratch blocks for the CPU kernels' per-call workspaces (packed
 * operands, merged cores, per-thread sums).  Fresh memory from the system
 * costs more than using it: a block above malloc's mmap threshold (128 KB
 * by default) is a new mapping on every call, so each of its pages faults
 * and is zeroed, and freeing it unmaps it again.  So a few grow-only blocks
 * are kept, each handed to one caller at a time; a call that finds them all
 * in use (calls from several threads at once) gets a block of its own from
 * malloc.  *cached tells comera_ws_release which case it was.  Plain C ABI. */
#ifndef COMERA_WORKSPACE_H
#define COMERA_WORKSPACE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* At least `bytes` bytes (64-byte aligned), or NULL when out of memory. */
void *comera_ws_acquire(size_t bytes, int *cached);
void comera_ws_release(void *block, int cached);

#ifdef __cplusplus
}
#endif
#endif
