// Pieces shared by the TT embedding forward (cuda.cu) and backward
// (cuda_bwd.cu) on the GPU.
//
// Algorithm (every kernel: one thread per output element, no shared memory,
// no atomics, so results do not depend on scheduling, see common/cuda_common.cuh):
//
//   slots     the n index positions become n "slots".  For dedup the slots
//             are the indices stably sorted (sort_pairs: one launch ranks
//             chunks of SORT_CHUNK, then merge passes where each element
//             finds its place by binary search in the neighbouring run:
//             1 + ceil(log2(n / SORT_CHUNK)) launches), and the first slot
//             of each run of equal indices is its "head".  Only heads are contracted; the other
//             slots point at their head.  Without dedup every slot is its own
//             head.  All buffers are sized by n, never by the number of
//             distinct rows, so nothing depends on the data: no host sync, no
//             data-dependent shape, and the launches can be captured in a
//             CUDA graph.
//   levels    a row is contracted left to right as in the C kernels:
//             R_k (E_k x r_{k+1}) = R_{k-1} (E_{k-1} x r_k) times the slice
//             C'_k[:, i_k] with C'_k = core k scaled by gate k on its last
//             rank, one launch per level over (slot, entry of R_k).
//   keys      indices outside [0, num_embeddings) and padding rows get the
//             key num_embeddings, sort last and are never contracted; an
//             index out of range reads as a NaN row (the torch glue cannot
//             raise without a host sync; the Python wrapper checks the
//             indices first unless the layer is capturable).
#ifndef COMERA_CUDA_TT_EMBEDDING_CUH
#define COMERA_CUDA_TT_EMBEDDING_CUH

#include "comera/tt_embedding.h"
#include "common/cuda_common.cuh"

#include <utility>

namespace comera_cuda {
namespace emb {

// The descriptor flattened into a struct that kernels take by value.
struct Shape {
    int d;
    int64_t v[COMERA_MAX_CORES], e[COMERA_MAX_CORES], r[COMERA_MAX_CORES + 1];
    int64_t vstride[COMERA_MAX_CORES];  // i_k = (t / vstride[k]) % v[k]
    int64_t E[COMERA_MAX_CORES];        // E[k] = e_0 ... e_k
    int64_t level[COMERA_MAX_CORES];    // E[k] * r[k + 1]: entries of R_k per slot
    int64_t core_off[COMERA_MAX_CORES + 1];  // offsets of the scaled cores, in elements
    int64_t max_level, num_embeddings, embedding_dim, padding_idx;
};

// From the shape that comera_tt_embedding_prepare built and checked.
inline void make_shape(const comera_tt_embedding_shape &p, Shape *s) {
    int d = p.d;
    s->d = d;
    s->num_embeddings = p.num;
    s->embedding_dim = p.dim;
    s->padding_idx = p.padding_idx;
    s->max_level = 1;
    for (int k = 0; k < d; k++) {
        s->v[k] = p.v[k];
        s->e[k] = p.e[k];
        s->r[k] = p.r[k];
        s->vstride[k] = p.vstride[k];
        s->E[k] = p.E[k];
        s->level[k] = p.E[k] * p.r[k + 1];
        if (s->level[k] > s->max_level) s->max_level = s->level[k];
    }
    for (int k = 0; k <= d; k++) s->core_off[k] = p.core_off[k];
    s->r[d] = 1;
}

// Sort key of index t: the row itself, or num_embeddings for padding and
// out-of-range indices (they sort last and are never contracted).
__host__ __device__ __forceinline__ int64_t key_of(const Shape &s, int64_t t) {
    return (t < 0 || t >= s.num_embeddings || t == s.padding_idx) ? s.num_embeddings : t;
}

// Entry points shared by the two files (defined in cuda.cu).
int check_args(const comera_tt_embedding_prep *p, const comera_tt_embedding_batch *b, int dtype,
               Shape *s);
bool dedup_pays(const Shape &s, int reuse);
size_t fwd_workspace(const Shape &s, int64_t n, int dtype);
size_t bwd_workspace(const Shape &s, int64_t n, int64_t num_bags, int dtype);  // cuda_bwd.cu

// Kernels and helpers below are private to each including file.
namespace {

__host__ __device__ __forceinline__ int64_t lower_bound(const int64_t *a, int64_t lo, int64_t hi,
                                                        int64_t key) {
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (a[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

__host__ __device__ __forceinline__ int64_t upper_bound(const int64_t *a, int64_t lo, int64_t hi,
                                                        int64_t key) {
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (a[mid] <= key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// One merge pass of a stable merge sort: runs of `width` elements are merged
// pairwise.  An element of a left run goes after the right run's smaller
// keys (lower bound); an element of a right run after the left run's keys
// that are not larger (upper bound), so equal keys keep their order.
__global__ void merge_pass_kernel(const int64_t *key, const int64_t *val, int64_t *key2,
                                  int64_t *val2, int64_t n, int64_t width) {
    COMERA_FOR_EACH(i, n) {
        int64_t run = i / width, base = (run / 2) * 2 * width;
        int64_t mid = base + width < n ? base + width : n;
        int64_t end = base + 2 * width < n ? base + 2 * width : n;
        int64_t dst;
        if (run % 2 == 0)
            dst = i + (lower_bound(key, mid, end, key[i]) - mid);
        else
            dst = base + (i - mid) + (upper_bound(key, base, mid, key[i]) - base);
        key2[dst] = key[i];
        val2[dst] = val[i];
    }
}

// Elements ranked within a chunk by one thread each (chunk_rank_kernel):
// SORT_CHUNK comparisons a thread take the place of log2(SORT_CHUNK) merge
// passes, so a sort of up to SORT_CHUNK indices is one launch.
constexpr int64_t SORT_CHUNK = 1024;

// Stable sort within chunks of `chunk` elements: an element's place is the
// count of the chunk's smaller keys and of its equal keys before it.
__global__ void chunk_rank_kernel(const int64_t *key, const int64_t *val, int64_t *key2,
                                  int64_t *val2, int64_t n, int64_t chunk) {
    COMERA_FOR_EACH(i, n) {
        int64_t base = i / chunk * chunk, end = base + chunk < n ? base + chunk : n;
        int64_t k = key[i], dst = base;
        for (int64_t j = base; j < end; j++) dst += key[j] < k || (key[j] == k && j < i);
        key2[dst] = k;
        val2[dst] = val[i];
    }
}

// Sorts (key, val) pairs stably by key.  The passes go back and forth
// between the pairs and the scratch (*2) arrays of the same length; the
// pointers are swapped so that key/val name the sorted result (no copy).
inline int sort_pairs(int64_t *&key, int64_t *&val, int64_t *&key2, int64_t *&val2, int64_t n,
                      cudaStream_t st) {
    if (n <= 1) return COMERA_OK;
    COMERA_LAUNCH(chunk_rank_kernel, n, st, key, val, key2, val2, n, SORT_CHUNK);
    std::swap(key, key2);
    std::swap(val, val2);
    for (int64_t w = SORT_CHUNK; w < n; w *= 2) {
        COMERA_LAUNCH(merge_pass_kernel, n, st, key, val, key2, val2, n, w);
        std::swap(key, key2);
        std::swap(val, val2);
    }
    return launched();
}

// Slot s <- position s, key of indices[s].
__global__ void init_slots_kernel(Shape s, const int64_t *indices, int64_t n, int64_t *key,
                                  int64_t *pos) {
    COMERA_FOR_EACH(i, n) {
        key[i] = key_of(s, indices[i]);
        pos[i] = i;
    }
}

// head[slot]: the first slot with the same key (dedup), or the slot itself;
// slot_of[pos[slot]] = slot.
__global__ void heads_kernel(const int64_t *key, const int64_t *pos, int64_t n, int dedup,
                             int64_t *head, int64_t *slot_of) {
    COMERA_FOR_EACH(i, n) {
        head[i] = dedup ? lower_bound(key, 0, n, key[i]) : i;
        slot_of[pos[i]] = i;
    }
}

// C'_k = core k * gate k (last rank), in the accumulator type.
template <typename T, typename A>
__global__ void scale_core_kernel(const T *core, const T *gate, int64_t rows, int64_t r2, A *out) {
    COMERA_FOR_EACH(i, rows * r2) {
        A g = gate ? to_acc<A>(gate[i % r2]) : (A)1;
        out[i] = to_acc<A>(core[i]) * g;
    }
}

// Level k of the contraction for every head slot: R_k[slot] (E_k x r_{k+1},
// row-major over (p, j), then b) from R_{k-1}[slot] (E_{k-1} x r_k).
template <typename A>
__global__ void level_kernel(Shape s, int k, const int64_t *key, const int64_t *head, int64_t n,
                             const A *cores, const A *prev, A *cur) {
    const int64_t L = s.level[k], ek = s.e[k], rk = s.r[k], rk1 = s.r[k + 1];
    const int64_t Lp = k ? s.level[k - 1] : 0;
    const A *C = cores + s.core_off[k];
    COMERA_FOR_EACH(q, n * L) {
        int64_t slot = q / L, x = q % L;
        if (head[slot] != slot || key[slot] >= s.num_embeddings) continue;
        int64_t ik = (key[slot] / s.vstride[k]) % s.v[k];
        int64_t b = x % rk1, j = (x / rk1) % ek, p = x / (rk1 * ek);
        // C'_k[a, ik, j, b] at ((a * v + ik) * e + j) * r1 + b
        const A *c = C + (ik * ek + j) * rk1 + b;
        const int64_t cstride = s.v[k] * ek * rk1;
        A acc = 0;
        if (k == 0) {
            acc = c[0];
        } else {
            const A *rp = prev + slot * Lp + p * rk;
            for (int64_t a = 0; a < rk; a++) acc += rp[a] * c[a * cstride];
        }
        cur[slot * L + x] = acc;
    }
}

inline Arena arena_for(void *ws) {
    uintptr_t p = ((uintptr_t)ws + 255) & ~(uintptr_t)255;
    return Arena{(char *)p, 0};
}

// The work common to forward and backward: scaled cores, sorted slots,
// heads.  Pointers into the arena.
template <typename A> struct Common {
    A *cores;
    int64_t *key, *pos, *key2, *pos2, *head, *slot_of;
};

template <typename A> Common<A> common_layout(const Shape &s, int64_t n, Arena &w) {
    Common<A> c;
    c.cores = w.take<A>(s.core_off[s.d]);
    w.take_each<int64_t>(n, {&c.key, &c.pos, &c.key2, &c.pos2, &c.head, &c.slot_of});
    return c;
}

template <typename T, typename A>
int common_run(const Shape &s, Common<A> &c, int64_t n, const int64_t *indices,
               const T *const *cores, const T *const *gates, int dedup, cudaStream_t st) {
    for (int k = 0; k < s.d; k++) {
        int64_t r2 = s.r[k + 1], rows = s.r[k] * s.v[k] * s.e[k];
        auto scale = scale_core_kernel<T, A>;
        COMERA_LAUNCH(scale, rows * r2, st, cores[k],
                      k < s.d - 1 ? gates[k] : (const T *)nullptr, rows, r2,
                      c.cores + s.core_off[k]);
    }
    if (n == 0) return launched();
    COMERA_LAUNCH(init_slots_kernel, n, st, s, indices, n, c.key, c.pos);
    int rc = launched();
    if (rc) return rc;
    if (dedup) {
        rc = sort_pairs(c.key, c.pos, c.key2, c.pos2, n, st);
        if (rc) return rc;
    }
    COMERA_LAUNCH(heads_kernel, n, st, c.key, c.pos, n, dedup, c.head, c.slot_of);
    return launched();
}

}  // namespace
}  // namespace emb
}  // namespace comera_cuda

#endif
