/* comera_advise_huge_pages (common/pages.h). */
#define _DEFAULT_SOURCE /* madvise and MADV_HUGEPAGE under -std=c11 */
#include "common/pages.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

/* The x86-64 (and 4 KB-page arm64) PMD page size.  Where huge pages are
 * larger the advice still covers whole base pages, so it stays valid; it just
 * helps less. */
#define HUGE_BYTES ((uintptr_t)2 << 20)

/* COMERA_HUGE_PAGES=0 turns the advice off (a system where THP compaction
 * stalls, or measuring the advice's effect).  Read at each large buffer, not
 * cached, so that one process can time both settings interleaved (the
 * benchmarks do); a getenv is nothing next to writing megabytes. */
static int advice_enabled(void) {
    const char *v = getenv("COMERA_HUGE_PAGES");
    return !(v && strcmp(v, "0") == 0);
}

int comera_advise_huge_pages(void *p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (!p || bytes < COMERA_HUGE_ADVICE_MIN_BYTES || !advice_enabled()) return 0;
    uintptr_t lo = ((uintptr_t)p + HUGE_BYTES - 1) & ~(HUGE_BYTES - 1);
    uintptr_t hi = ((uintptr_t)p + bytes) & ~(HUGE_BYTES - 1);
    if (hi <= lo) return 0;
    return madvise((void *)lo, (size_t)(hi - lo), MADV_HUGEPAGE) == 0;
#else
    (void)p;
    (void)bytes;
    return 0;
#endif
}
