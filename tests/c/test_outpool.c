/* The output block cache (csrc/common/outpool.c): a block is reused only
 * once given back, never handed to two holders, fits within a quarter of
 * waste, the idle cap and the switches are honoured, and a full table says
 * "allocate elsewhere" (NULL) instead of failing. */
#define _POSIX_C_SOURCE 200112L /* setenv / unsetenv under -std=c11 */
#include "common/outpool.h"
#include "reference.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MB ((size_t)1 << 20)

static size_t idle_now(void) {
    size_t idle = 0;
    comera_outpool_stats(&idle, NULL);
    return idle;
}

static size_t busy_now(void) {
    size_t busy = 0;
    comera_outpool_stats(NULL, &busy);
    return busy;
}

static void test_reuse_and_fit(void) {
    check(comera_outpool_take(COMERA_OUTPOOL_MIN_BYTES - 1) == NULL, "a small block was pooled");
    unsigned char *a = comera_outpool_take(5 * MB);
    check(a != NULL && (uintptr_t)a % (2 * MB) == 0, "5 MB block %p not 2 MB aligned", (void *)a);
    if (!a) return;
    memset(a, 0xab, 5 * MB); /* the whole request is writable */
    check(busy_now() == 6 * MB, "busy %zu, want 6 MB (whole 2 MB pages)", busy_now());
    unsigned char *b = comera_outpool_take(5 * MB);
    check(b != NULL && b != a, "a busy block was handed out twice");
    comera_outpool_give(a);
    check(idle_now() == 6 * MB, "idle %zu after one give-back", idle_now());
    check(comera_outpool_take(6 * MB) == a, "the idle 6 MB block was not reused");
    comera_outpool_give(a);
    comera_outpool_give(b);
    comera_outpool_release();
    /* 24 MB idle alone: a 20 MB request fits it (4 MB spare), a 4 MB one does not */
    unsigned char *big = comera_outpool_take(24 * MB);
    comera_outpool_give(big);
    check(comera_outpool_take(20 * MB) == big, "20 MB did not reuse the idle 24 MB block");
    comera_outpool_give(big);
    unsigned char *c = comera_outpool_take(4 * MB);
    check(c != big && c != NULL, "4 MB took a block six times its size");
    /* best fit: with 22 MB and 24 MB blocks idle, 20 MB takes the 22 MB one */
    comera_outpool_give(c);
    check(comera_outpool_take(24 * MB) == big, "24 MB did not reuse the idle 24 MB block");
    unsigned char *mid = comera_outpool_take(22 * MB);
    comera_outpool_give(big);
    comera_outpool_give(mid);
    unsigned char *d = comera_outpool_take(20 * MB);
    check(d == mid, "20 MB did not take the smallest fitting block");
    comera_outpool_give(d);
    size_t held = idle_now();
    check(comera_outpool_release() == held && idle_now() == 0 && busy_now() == 0,
          "release left %zu idle, %zu busy", idle_now(), busy_now());
}

static void test_switches(void) {
    setenv("COMERA_OUTPUT_POOL", "0", 1);
    check(comera_outpool_take(8 * MB) == NULL, "pooled with COMERA_OUTPUT_POOL=0");
    unsetenv("COMERA_OUTPUT_POOL");
    void *a = comera_outpool_take(8 * MB);
    check(a != NULL, "no block with the pool on");
    /* switched off while the block is out: given back, it is freed */
    setenv("COMERA_OUTPUT_POOL", "0", 1);
    comera_outpool_give(a);
    check(idle_now() == 0, "idle %zu kept while the pool is off", idle_now());
    unsetenv("COMERA_OUTPUT_POOL");
    /* cap 10 MB: of two 8 MB blocks given back only the newer stays */
    setenv("COMERA_OUTPUT_POOL_MB", "10", 1);
    void *p = comera_outpool_take(8 * MB), *q = comera_outpool_take(8 * MB);
    comera_outpool_give(p);
    comera_outpool_give(q);
    check(idle_now() == 8 * MB, "idle %zu over a 10 MB cap", idle_now());
    check(comera_outpool_take(8 * MB) == q, "the newest block was not the one kept");
    comera_outpool_give(q);
    /* a cap that does not parse falls back to the default */
    setenv("COMERA_OUTPUT_POOL_MB", "lots", 1);
    p = comera_outpool_take(8 * MB);
    q = comera_outpool_take(8 * MB);
    comera_outpool_give(p);
    comera_outpool_give(q);
    check(idle_now() == 16 * MB, "idle %zu with the default cap", idle_now());
    unsetenv("COMERA_OUTPUT_POOL_MB");
    comera_outpool_release();
}

static void test_full_table(void) {
    /* untouched 4 MB blocks: address space, not memory */
    enum { MAX_TRY = 300 };
    void *held[MAX_TRY];
    int n = 0;
    while (n < MAX_TRY && (held[n] = comera_outpool_take(4 * MB)) != NULL) n++;
    check(n > 0 && n < MAX_TRY, "%d blocks out at once: the table has no limit", n);
    for (int i = 0; i < n; i++) comera_outpool_give(held[i]);
    check(busy_now() == 0, "busy %zu after every give-back", busy_now());
    comera_outpool_release();
}

/* Two threads take and give blocks at once; a block each one holds carries
 * its mark until given back (no block is shared). */
static void test_threads(void) {
    int clashes = 0, misses = 0;
#pragma omp parallel num_threads(2) reduction(+ : clashes, misses)
    {
        unsigned char mark = (unsigned char)(1 + omp_get_thread_num());
        for (int it = 0; it < 400; it++) {
            size_t bytes = (4 + (size_t)(it % 3) * 2) * MB;
            unsigned char *b = comera_outpool_take(bytes);
            if (!b) {
                misses++;
                continue;
            }
            for (size_t i = 0; i < bytes; i += 4096) b[i] = mark;
            for (size_t i = 0; i < bytes; i += 4096) clashes += b[i] != mark;
            comera_outpool_give(b);
        }
    }
    check(clashes == 0 && misses == 0, "%d overwritten pages, %d refusals", clashes, misses);
    check(busy_now() == 0, "busy %zu after the threads", busy_now());
    comera_outpool_release();
}

void test_outpool(void) {
    group_begin("output block pool");
    test_reuse_and_fit();
    test_switches();
    test_full_table();
    test_threads();
    group_end();
}
