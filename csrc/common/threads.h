/* How many OpenMP threads a CPU kernel asks for, and which rows each thread
 * of the team that runs takes: the rules the C kernels share. */
#ifndef COMERA_THREADS_H
#define COMERA_THREADS_H

#include <omp.h>
#include <stdint.h>

/* nthreads (at least one), but no more threads than items to share: for
 * loops whose every item is work enough for a thread (a row block of the
 * TT linear merge path, a row of its sequential path, a gate). */
static inline int comera_threads_for_items(int nthreads, int64_t items) {
    int nt = nthreads > 0 ? nthreads : 1;
    if (items < nt) nt = items > 0 ? (int)items : 1;
    return nt;
}

/* Below this much work per thread a parallel region costs more than it
 * saves: fork and join, and on a busy machine threads that spin while they
 * wait for a core.  Tiny lookups (a few hundred rows of a small table) run
 * on one thread. */
#define COMERA_MIN_FLOPS_PER_THREAD 2e5

/* comera_threads_for_items for items of flops_per_item each, and no more
 * threads than the work pays for (COMERA_MIN_FLOPS_PER_THREAD each): for
 * items that may be tiny (a TT embedding row). */
static inline int comera_threads_for_work(int nthreads, int64_t items, double flops_per_item) {
    int nt = nthreads > 0 ? nthreads : 1;
    double by_work = (double)items * flops_per_item / COMERA_MIN_FLOPS_PER_THREAD;
    if (by_work < nt) nt = by_work < 1.0 ? 1 : (int)by_work;
    return comera_threads_for_items(nt, items);
}

/* Inside a parallel region: this thread's contiguous chunk [*u0, *u1) of
 * `count` rows.  The team may be smaller than asked (a nested region runs
 * with one thread), so the chunks follow the team that actually runs; a
 * thread of an empty chunk leaves its accumulators at zero. */
static inline void comera_thread_rows(int64_t count, int64_t *u0, int64_t *u1) {
    int tid = omp_get_thread_num(), team = omp_get_num_threads();
    *u0 = count * tid / team;
    *u1 = count * (tid + 1) / team;
}

#endif
