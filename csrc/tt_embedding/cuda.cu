// TT embedding lookup on the GPU (forward) and the launchers' shared entry
// checks; the algorithm is described in cuda.cuh, the backward is in
// cuda_bwd.cu.
#include <math.h>

#include "tt_embedding/cuda.cuh"

namespace comera_cuda {
namespace emb {

// The batch and dtype; the table was checked by comera_tt_embedding_prepare.
int check_args(const comera_tt_embedding_prep *p, const comera_tt_embedding_batch *b, int dtype,
               Shape *s) {
    if (!p || !b) return COMERA_ERR_ARG;
    make_shape(p->shape, s);
    if (dtype < COMERA_DT_F32 || dtype > COMERA_DT_F16) return COMERA_ERR_ARG;
    if (b->mode < COMERA_EMB_PLAIN || b->mode > COMERA_EMB_MEAN || b->n < 0) return COMERA_ERR_ARG;
    if (b->n > 0 && !b->indices) return COMERA_ERR_ARG;
    if (b->mode != COMERA_EMB_PLAIN && (b->num_bags < 0 || !b->offsets)) return COMERA_ERR_ARG;
    // every buffer is n times a per-row size: keep the products in int64
    if (b->n > 0 && s->max_level > INT64_MAX / 8 / b->n / s->d) return COMERA_ERR_OVERFLOW;
    return COMERA_OK;
}

// Forward contraction flops of one row: what the C planner compares with
// the cost of sorting (COMERA_EMB_SORT_FLOPS_PER_INDEX) for reuse = auto.
bool dedup_pays(const Shape &s, int reuse) {
    if (reuse == COMERA_REUSE_NONE) return false;
    if (reuse != COMERA_REUSE_AUTO) return true;
    double flops = 0;
    for (int k = 1; k < s.d; k++) flops += 2.0 * (double)s.E[k - 1] * s.r[k] * s.e[k] * s.r[k + 1];
    return flops > COMERA_EMB_SORT_FLOPS_PER_INDEX;
}

namespace {

template <typename A> struct FwdBufs {
    Common<A> c;
    A *lvl[2];
};

template <typename A> FwdBufs<A> fwd_layout(const Shape &s, int64_t n, Arena &w) {
    FwdBufs<A> f;
    f.c = common_layout<A>(s, n, w);
    f.lvl[0] = w.take<A>(n * s.max_level);
    f.lvl[1] = w.take<A>(n * s.max_level);
    return f;
}

// Plain mode: output row p is the contracted row of its slot's head; the
// padding row reads as zero, an index out of range as NaN.
template <typename T, typename A>
__global__ void plain_out_kernel(Shape s, const int64_t *indices, const int64_t *slot_of,
                                 const int64_t *head, const A *rows, int64_t n, T *out) {
    const int64_t D = s.embedding_dim, L = s.level[s.d - 1];
    COMERA_FOR_EACH(q, n * D) {
        int64_t p = q / D, c = q % D, t = indices[p];
        A v;
        if (t < 0 || t >= s.num_embeddings)
            v = (A)NAN;
        else if (t == s.padding_idx)
            v = (A)0;
        else
            v = rows[head[slot_of[p]] * L + c];
        out[q] = from_acc<T, A>(v);
    }
}

// Bag modes: one thread per (bag, entry) sums the bag's rows in position
// order (weighted by psw), so the result does not depend on scheduling.
// Offsets are clamped to [0, n]: the glue cannot check them without a host
// sync, and a bad offset must not read out of bounds.
template <typename T, typename A>
__global__ void bag_out_kernel(Shape s, int mode, const int64_t *indices, const int64_t *offsets,
                               int64_t num_bags, int64_t n, const T *psw, const int64_t *slot_of,
                               const int64_t *head, const A *rows, T *out) {
    const int64_t D = s.embedding_dim, L = s.level[s.d - 1];
    COMERA_FOR_EACH(q, num_bags * D) {
        int64_t b = q / D, c = q % D;
        int64_t lo = offsets[b], hi = offsets[b + 1];
        lo = lo < 0 ? 0 : lo > n ? n : lo;
        hi = hi < lo ? lo : hi > n ? n : hi;
        A acc = 0;
        int64_t count = 0;
        bool bad = false;
        for (int64_t p = lo; p < hi; p++) {
            int64_t t = indices[p];
            if (t < 0 || t >= s.num_embeddings) {
                bad = true;
                continue;
            }
            if (t == s.padding_idx) continue;
            A w = psw ? to_acc<A>(psw[p]) : (A)1;
            acc += w * rows[head[slot_of[p]] * L + c];
            count++;
        }
        if (mode == COMERA_EMB_MEAN && count > 0) acc /= (A)count;
        out[q] = from_acc<T, A>(bad ? (A)NAN : acc);
    }
}

template <typename T>
size_t fwd_bytes(const Shape &s, int64_t n) {
    Arena w{nullptr, 0};
    fwd_layout<typename Acc<T>::type>(s, n, w);
    return w.used + 256;
}

template <typename T>
int fwd(const Shape &s, const comera_tt_embedding_batch *b, const T *psw, int reuse,
        const T *const *cores, const T *const *gates, T *out, void *ws, size_t ws_bytes,
        cudaStream_t st) {
    typedef typename Acc<T>::type A;
    const int64_t n = b->n;
    if (ws_bytes < fwd_bytes<T>(s, n) || !ws) return COMERA_ERR_WORKSPACE;
    Arena w = arena_for(ws);
    FwdBufs<A> f = fwd_layout<A>(s, n, w);
    int rc = common_run<T, A>(s, f.c, n, b->indices, cores, gates, dedup_pays(s, reuse) ? 1 : 0,
                              st);
    if (rc) return rc;
    for (int k = 0; k < s.d; k++) {
        auto level = level_kernel<A>;
        COMERA_LAUNCH(level, n * s.level[k], st, s, k, f.c.key, f.c.head, n, f.c.cores,
                      f.lvl[(k + 1) % 2], f.lvl[k % 2]);
    }
    const A *rows = f.lvl[(s.d - 1) % 2];
    if (b->mode == COMERA_EMB_PLAIN) {
        auto k = plain_out_kernel<T, A>;
        COMERA_LAUNCH(k, n * s.embedding_dim, st, s, b->indices, f.c.slot_of, f.c.head, rows, n,
                      out);
    } else {
        auto k = bag_out_kernel<T, A>;
        COMERA_LAUNCH(k, b->num_bags * s.embedding_dim, st, s, b->mode, b->indices, b->offsets,
                      b->num_bags, n, psw, f.c.slot_of, f.c.head, rows, out);
    }
    return launched();
}

}  // namespace

size_t fwd_workspace(const Shape &s, int64_t n, int dtype) {
    switch (dtype) {
        case COMERA_DT_F64: return fwd_bytes<double>(s, n);
        default: return fwd_bytes<float>(s, n);  // float accumulators for all the others
    }
}

}  // namespace emb
}  // namespace comera_cuda

using namespace comera_cuda;

extern "C" int comera_tt_embedding_fwd_cuda(const comera_tt_embedding_prep *p,
                                            const comera_tt_embedding_batch *b, int dtype,
                                            const void *psw, const void *const *cores,
                                            const void *const *gates, void *out, void *workspace,
                                            size_t workspace_bytes, cudaStream_t stream) {
    emb::Shape s;
    int rc = emb::check_args(p, b, dtype, &s);
    if (rc) return rc;
    const int reuse = p->reuse;
    int64_t rows = b->mode == COMERA_EMB_PLAIN ? b->n : b->num_bags;
    if (!cores || !gates || (rows > 0 && !out)) return COMERA_ERR_ARG;
    if (b->mode == COMERA_EMB_PLAIN) psw = nullptr;
    switch (dtype) {
        case COMERA_DT_F32:
            return emb::fwd<float>(s, b, (const float *)psw, reuse, (const float *const *)cores,
                                   (const float *const *)gates, (float *)out, workspace,
                                   workspace_bytes, stream);
        case COMERA_DT_F64:
            return emb::fwd<double>(s, b, (const double *)psw, reuse,
                                    (const double *const *)cores, (const double *const *)gates,
                                    (double *)out, workspace, workspace_bytes, stream);
        case COMERA_DT_BF16:
            return emb::fwd<__nv_bfloat16>(s, b, (const __nv_bfloat16 *)psw, reuse,
                                           (const __nv_bfloat16 *const *)cores,
                                           (const __nv_bfloat16 *const *)gates,
                                           (__nv_bfloat16 *)out, workspace, workspace_bytes,
                                           stream);
        default:
            return emb::fwd<__half>(s, b, (const __half *)psw, reuse,
                                    (const __half *const *)cores, (const __half *const *)gates,
                                    (__half *)out, workspace, workspace_bytes, stream);
    }
}

extern "C" int comera_tt_embedding_cuda_workspace(const comera_tt_embedding_prep *p,
                                                  const comera_tt_embedding_batch *b, int dtype,
                                                  int backward, size_t *bytes) {
    emb::Shape s;
    int rc = emb::check_args(p, b, dtype, &s);
    if (rc) return rc;
    if (!bytes) return COMERA_ERR_ARG;
    int64_t bags = b->mode == COMERA_EMB_PLAIN ? 0 : b->num_bags;
    *bytes = backward ? emb::bwd_workspace(s, b->n, bags, dtype) : emb::fwd_workspace(s, b->n, dtype);
    return COMERA_OK;
}
