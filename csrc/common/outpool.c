/* The output block cache of common/outpool.h. */
#define _DEFAULT_SOURCE /* posix_memalign under -std=c11 */
#include "common/outpool.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/pages.h"

/* Blocks are whole 2 MB pages, so huge-page advice covers all of them and
 * a block fits any later request rounded to the same size. */
#define BLOCK_ALIGN ((size_t)2 << 20)
/* Outputs alive at once: a transformer step keeps one or two per layer. */
#define ENTRIES 256
#define DEFAULT_CAP_MB 1024

typedef struct {
    void *block;   /* NULL: the entry is unused */
    size_t bytes;
    int busy;      /* handed out, not yet given back */
    uint64_t last; /* when it was given back: the oldest idle block goes first */
} pool_entry;

static pool_entry table[ENTRIES];
static uint64_t ticks;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* A fork while another thread holds the lock would leave the child's copy
 * locked forever (DataLoader workers fork): hold it across the fork.  The
 * handlers are registered when the library loads (a constructor, not
 * pthread_once, whose glibc 2.34 symbol the manylinux_2_28 wheel cannot
 * reference). */
static void lock_pool(void) { pthread_mutex_lock(&lock); }
static void unlock_pool(void) { pthread_mutex_unlock(&lock); }
__attribute__((constructor)) static void register_fork_handlers(void) {
    pthread_atfork(lock_pool, unlock_pool, unlock_pool);
}

/* COMERA_OUTPUT_POOL=0 turns the pool off; read per call, as the huge-page
 * switch, so one process can time both settings interleaved. */
static int pool_enabled(void) {
    const char *v = getenv("COMERA_OUTPUT_POOL");
    return !(v && strcmp(v, "0") == 0);
}

/* Most bytes kept in idle blocks: COMERA_OUTPUT_POOL_MB (a whole number),
 * 0 while the pool is off. */
static size_t idle_cap(void) {
    if (!pool_enabled()) return 0;
    const char *v = getenv("COMERA_OUTPUT_POOL_MB");
    if (v && *v) {
        char *end = NULL;
        unsigned long long mb = strtoull(v, &end, 10);
        if (end && *end == '\0' && mb < ((unsigned long long)SIZE_MAX >> 20)) return (size_t)mb << 20;
    }
    return (size_t)DEFAULT_CAP_MB << 20;
}

/* The idle entry given back longest ago, or -1. */
static int oldest_idle(void) {
    int pick = -1;
    for (int i = 0; i < ENTRIES; i++)
        if (table[i].block && !table[i].busy && (pick < 0 || table[i].last < table[pick].last))
            pick = i;
    return pick;
}

static size_t drop_entry(int i) {
    size_t bytes = table[i].bytes;
    free(table[i].block);
    memset(&table[i], 0, sizeof table[i]);
    return bytes;
}

/* The smallest idle block that holds `want` bytes without wasting more than
 * a quarter of them, or -1. */
static int best_fit(size_t want) {
    int pick = -1;
    for (int i = 0; i < ENTRIES; i++) {
        const pool_entry *e = &table[i];
        if (!e->block || e->busy || e->bytes < want || e->bytes - want > want / 4) continue;
        if (pick < 0 || e->bytes < table[pick].bytes) pick = i;
    }
    return pick;
}

/* Bytes of the idle blocks (busy == 0) or of those in use (busy == 1). */
static size_t held_bytes(int busy) {
    size_t sum = 0;
    for (int i = 0; i < ENTRIES; i++)
        if (table[i].block && table[i].busy == busy) sum += table[i].bytes;
    return sum;
}

static int unused_entry(void) {
    for (int i = 0; i < ENTRIES; i++)
        if (!table[i].block) return i;
    return -1;
}

void *comera_outpool_take(size_t bytes) {
    if (bytes < COMERA_OUTPOOL_MIN_BYTES || !pool_enabled()) return NULL;
    if (bytes > SIZE_MAX - BLOCK_ALIGN) return NULL;
    size_t want = (bytes + BLOCK_ALIGN - 1) / BLOCK_ALIGN * BLOCK_ALIGN;
    void *block = NULL;
    lock_pool();
    int i = best_fit(want);
    if (i >= 0) {
        table[i].busy = 1;
        block = table[i].block;
    } else {
        i = unused_entry();
        if (i < 0 && (i = oldest_idle()) >= 0) drop_entry(i);
        /* a fresh mapping: advise it before the kernel's first write */
        if (i >= 0 && posix_memalign(&block, BLOCK_ALIGN, want) == 0) {
            comera_advise_huge_pages(block, want);
            table[i] = (pool_entry){block, want, 1, 0};
        } else {
            block = NULL;
        }
    }
    unlock_pool();
    return block;
}

void comera_outpool_give(void *block) {
    if (!block) return;
    size_t cap = idle_cap();
    lock_pool();
    int found = -1;
    for (int i = 0; i < ENTRIES && found < 0; i++)
        if (table[i].block == block) found = i;
    if (found < 0) { /* not ours (cannot happen): still freed, never leaked */
        unlock_pool();
        free(block);
        return;
    }
    table[found].busy = 0;
    table[found].last = ++ticks;
    size_t idle = held_bytes(0);
    while (idle > cap) idle -= drop_entry(oldest_idle());
    unlock_pool();
}

size_t comera_outpool_release(void) {
    size_t freed = 0;
    lock_pool();
    for (int i = 0; i < ENTRIES; i++)
        if (table[i].block && !table[i].busy) freed += drop_entry(i);
    unlock_pool();
    return freed;
}

void comera_outpool_stats(size_t *idle_bytes, size_t *busy_bytes) {
    lock_pool();
    size_t idle = held_bytes(0), busy = held_bytes(1);
    unlock_pool();
    if (idle_bytes) *idle_bytes = idle;
    if (busy_bytes) *busy_bytes = busy;
}
