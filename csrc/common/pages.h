/* Transparent huge pages for large fresh buffers (docs/design.md section 5,
 * "page faults on fresh outputs").  Plain C ABI, no torch headers. */
#ifndef COMERA_PAGES_H
#define COMERA_PAGES_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Buffers smaller than this are left alone: they span at most one whole
 * 2 MB page, and small blocks come from malloc's heap, already faulted in. */
#define COMERA_HUGE_ADVICE_MIN_BYTES ((size_t)4 << 20)

/* Asks the kernel to back the 2 MB-aligned interior of [p, p + bytes) with
 * transparent huge pages (madvise MADV_HUGEPAGE), before anything touches it.
 * A fresh multi-megabyte block from malloc is a new mapping whose every 4 KB
 * page would fault (and be zeroed) on first write; 2 MB pages fault 512 times
 * less often.  Only a hint: pages already present stay as they are, nothing
 * is read or written, the memory's owner is unchanged, and errors (no THP in
 * the kernel, THP mode "never") are ignored.  A no-op below
 * COMERA_HUGE_ADVICE_MIN_BYTES, when COMERA_HUGE_PAGES=0 is set in the
 * environment, and off Linux.  Returns 1 when advice was given, else 0. */
int comera_advise_huge_pages(void *p, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif
