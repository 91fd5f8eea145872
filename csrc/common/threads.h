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

/* The body of a parallel region: fn(arg, tid, team) runs on every thread
 * of the team, tid its number in the team (0 .. team - 1).  A body shares
 * its work by tid and team (comera_team_rows), never by OpenMP worksharing
 * or thread numbers: run straight from a thread of an enclosing region, an
 * `omp for` would bind to that region's team. */
typedef void (*comera_team_fn)(void *arg, int tid, int team);

/* fn on a team of nt threads, or straight on the calling thread (tid 0 of
 * a team of 1) when nt is 1: entering an OpenMP region costs two futex
 * system calls even for a team of one (a one-row TTLinear forward and
 * backward made four). */
static inline void comera_run_team(int nt, comera_team_fn fn, void *arg) {
    if (nt <= 1) {
        fn(arg, 0, 1);
        return;
    }
#pragma omp parallel num_threads(nt)
    fn(arg, omp_get_thread_num(), omp_get_num_threads());
}

/* Thread tid's contiguous chunk [*u0, *u1) of `count` items in a team of
 * `team` (the team granted may be smaller than asked: a nested region runs
 * with one thread); a thread of an empty chunk leaves its sums at zero. */
static inline void comera_team_rows(int64_t count, int tid, int team, int64_t *u0,
                                    int64_t *u1) {
    *u0 = count * tid / team;
    *u1 = count * (tid + 1) / team;
}

#endif
