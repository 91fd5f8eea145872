/* A cache of large output blocks for the CPU ops (docs/design.md section 5,
 * "Reused output blocks").  With glibc's default settings every block over
 * its mmap threshold (at most 32 MB) is a fresh mapping: a 48 MB y costs
 * each call ~12k page faults (or 24 zeroed huge pages) and an munmap when it
 * dies.  The glue hands large CPU outputs out of this pool instead, as
 * tensors whose deleter gives the block back, so a training loop writes the
 * same, already mapped memory each step.  Plain C ABI, thread-safe. */
#ifndef COMERA_OUTPOOL_H
#define COMERA_OUTPOOL_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Outputs below this come from torch's allocator as before: malloc's heap
 * already reuses small blocks. */
#define COMERA_OUTPOOL_MIN_BYTES ((size_t)4 << 20)

/* A block of at least `bytes` bytes (2 MB aligned, contents undefined), or
 * NULL: pool off (COMERA_OUTPUT_POOL=0, read per call), `bytes` below
 * COMERA_OUTPOOL_MIN_BYTES, every table entry in use, or out of memory.  A
 * NULL answer means "allocate elsewhere", never an error. */
void *comera_outpool_take(size_t bytes);

/* Gives back a block from comera_outpool_take (any thread).  It is kept for
 * the next take while the idle blocks stay under the cap
 * (COMERA_OUTPUT_POOL_MB, default 1024), else freed. */
void comera_outpool_give(void *block);

/* Frees every idle block; returns the bytes freed.  Blocks in use are left
 * to their tensors and come back as idle blocks (under the cap). */
size_t comera_outpool_release(void);

/* Bytes held in idle blocks and in blocks in use (either may be NULL). */
void comera_outpool_stats(size_t *idle_bytes, size_t *busy_bytes);

#ifdef __cplusplus
}
#endif
#endif
