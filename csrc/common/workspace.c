/* The reused scratch blocks of common/workspace.h. */
#include "common/workspace.h"

#include <stdatomic.h>
#include <stdlib.h>

/* A kernel holds one block for its call and the GEMM driver it calls may
 * take one more for a packed operand: a few slots cover that nesting. */
#define SLOTS 4

static atomic_flag slot_busy[SLOTS] = {ATOMIC_FLAG_INIT, ATOMIC_FLAG_INIT, ATOMIC_FLAG_INIT,
                                       ATOMIC_FLAG_INIT};
static void *slot_block[SLOTS];
static size_t slot_bytes[SLOTS];

/* 64-byte aligned, whole cache lines (aligned_alloc wants a multiple). */
static void *alloc_lines(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, rounded > 0 ? rounded : 64);
}

void *comera_ws_acquire(size_t bytes, int *cached) {
    for (int i = 0; i < SLOTS; i++) {
        if (atomic_flag_test_and_set_explicit(&slot_busy[i], memory_order_acquire)) continue;
        if (slot_bytes[i] < bytes) {
            free(slot_block[i]);
            slot_block[i] = alloc_lines(bytes);
            slot_bytes[i] = slot_block[i] ? bytes : 0;
        }
        if (slot_block[i]) {
            *cached = i + 1;
            return slot_block[i];
        }
        atomic_flag_clear_explicit(&slot_busy[i], memory_order_release);
        break;
    }
    *cached = 0;
    return alloc_lines(bytes);
}

void comera_ws_release(void *block, int cached) {
    if (cached > 0 && cached <= SLOTS)
        atomic_flag_clear_explicit(&slot_busy[cached - 1], memory_order_release);
    else
        free(block);
}
