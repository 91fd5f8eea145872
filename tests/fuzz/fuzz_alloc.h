/* Allocation counting for the fuzz target (tests/fuzz): the binary is linked
 * with -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=aligned_alloc,
 * --wrap=posix_memalign so every allocation of the kernels goes through
 * fuzz_alloc.c, which counts it.  A rejected call must not allocate. */
#ifndef COMERA_FUZZ_ALLOC_H
#define COMERA_FUZZ_ALLOC_H

long comera_fuzz_allocs(void);

/* Outcome counters, printed by the driver: [0] linear rejected, [1] linear
 * run, [2] embedding rejected, [3] embedding run, [4] gate_prox calls. */
extern long comera_fuzz_stats[5];

#endif
