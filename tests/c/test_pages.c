/* comera_advise_huge_pages (csrc/common/pages.c): a hint that must never
 * change the buffer's contents, is skipped below its threshold, on NULL and
 * under COMERA_HUGE_PAGES=0, and is given on Linux when the kernel has
 * transparent huge pages (the sysfs folder exists). */
#define _POSIX_C_SOURCE 200112L /* setenv / unsetenv under -std=c11 */
#include "common/pages.h"
#include "reference.h"

#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

static int kernel_has_thp(void) {
#if defined(__linux__)
    return access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0;
#else
    return 0;
#endif
}

void test_pages(void) {
    group_begin("huge-page advice on large buffers");
    check(comera_advise_huge_pages(NULL, (size_t)64 << 20) == 0, "NULL was advised");

    /* 3 MB: under the threshold, nothing to do even if a 2 MB page fits */
    size_t small = (size_t)3 << 20, big = (size_t)24 << 20;
    unsigned char *s = xmalloc(small);
    check(comera_advise_huge_pages(s, small) == 0, "a 3 MB buffer was advised");
    free(s);

    /* a fresh 24 MB block (an mmap of its own): half written before the
     * advice, half after; every byte must read back as written */
    unsigned char *b = xmalloc(big);
    for (size_t i = 0; i < big / 2; i++) b[i] = (unsigned char)(i * 131u + 7u);
    int given = comera_advise_huge_pages(b, big);
    check(given == kernel_has_thp(), "advice given %d, kernel THP %d", given, kernel_has_thp());
    for (size_t i = big / 2; i < big; i++) b[i] = (unsigned char)(i * 131u + 7u);
    size_t bad = big;
    for (size_t i = 0; i < big && bad == big; i++)
        if (b[i] != (unsigned char)(i * 131u + 7u)) bad = i;
    check(bad == big, "byte %zu changed after the advice", bad);

    /* the switch is read at each call */
    setenv("COMERA_HUGE_PAGES", "0", 1);
    check(comera_advise_huge_pages(b, big) == 0, "advised with COMERA_HUGE_PAGES=0");
    setenv("COMERA_HUGE_PAGES", "1", 1);
    check(comera_advise_huge_pages(b, big) == kernel_has_thp(), "COMERA_HUGE_PAGES=1 not honoured");
    unsetenv("COMERA_HUGE_PAGES");
    free(b);
    group_end();
}
