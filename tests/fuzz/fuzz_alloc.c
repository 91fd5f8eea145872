/* Counting wrappers for the allocation functions (see fuzz_alloc.h). */
#include <stdlib.h>

#include "fuzz_alloc.h"

long comera_fuzz_stats[5];
static long allocs; /* atomic: kernels allocate inside OpenMP regions */

long comera_fuzz_allocs(void) { return __atomic_load_n(&allocs, __ATOMIC_SEQ_CST); }

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t m);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t a, size_t n);
int __real_posix_memalign(void **p, size_t a, size_t n);

static void count(void) { __atomic_add_fetch(&allocs, 1, __ATOMIC_SEQ_CST); }

void *__wrap_malloc(size_t n) { count(); return __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t m) { count(); return __real_calloc(n, m); }
void *__wrap_realloc(void *p, size_t n) { count(); return __real_realloc(p, n); }
void *__wrap_aligned_alloc(size_t a, size_t n) { count(); return __real_aligned_alloc(a, n); }
int __wrap_posix_memalign(void **p, size_t a, size_t n) { count(); return __real_posix_memalign(p, a, n); }
