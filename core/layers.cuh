// core/layers.cuh: the pointwise and row-wise kernels of the dense model (docs/MODEL.md), forward and
// backward, for fp32 or bf16 activations (T, see core/dtype.cuh); arithmetic in fp32; no floating-point atomics.
//   token embedding    out[n, D] = E[tokens[i], :]             backward: dE[V, D] += scatter of dout (sorted plan)
//   RMSNorm (+resid)   h = h_in + branch (optional);  y = h * rstd * w,  rstd[n] saved (fp32)
//                      backward: dx (=, or +=) d/dh;  dw[D] += two-pass column reduction (fixed order)
//                      as a product's input (ResidualNorm: core/matmul.cuh runs it before the product)
//   SwiGLU pointwise   h[n, F] = silu(a) * b        backward: da, db from dh (a, b are the W1, W3 GEMM outputs)
// Shapes are row-major. Weights are the working copy (dtype T); weight gradients are fp32. RMSNorm and SwiGLU are
// bandwidth-bound: they move 16-byte vectors where the widths allow (see "Vector access").
#ifndef SDM_CORE_LAYERS_CUH
#define SDM_CORE_LAYERS_CUH

#include "core/cuda_common.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Token embedding

// out[i, :] = E[tokens[i], :]; one block per row.
template <typename T>
__global__ void embedding_forward_kernel(T *out, const T *E, const int *tokens, int D) {
    pdl_enter();
    const T *src = E + (size_t)tokens[blockIdx.x] * D;
    T *dst = out + (size_t)blockIdx.x * D;
    for (int k = threadIdx.x; k < D; k += blockDim.x) dst[k] = src[k];
}

// out[n, D] = E[tokens[n], :] for device tokens in [0, V).
static inline void embedding_forward(void *out, const void *E, const int *tokens, Dtype dtype, int n, int D,
                                     cudaStream_t s) {
    DTYPE_DISPATCH(dtype, "embedding_forward",
                 launch_pdl(embedding_forward_kernel<T>, n, 256, 0, s, (T *)out, (const T *)E, tokens, D));
    cudaCheckLast();
}

// The backward is a deterministic scatter-add: the host sorts the batch's positions by token once (stable counting
// sort, so positions of one token stay in increasing order) and cuts every token's run into work items:
//   - a run of at most EMB_CHUNK positions is one item that adds its rows' sum straight into dE[token];
//   - a longer run is cut into pieces of EMB_CHUNK positions, each summed into its own fp32 partial row, and a
//     "long run" record makes a second kernel add the pieces' partials into dE[token] in piece order.
// A frequent token (a space in a byte vocabulary) is thus spread over many blocks, and nothing is summed twice.
// Grids depend only on (n, V), and the item counts are read on the device, so the launches can be captured in a
// CUDA graph; only the plan's bytes change per batch (a captured step copies them from a pinned buffer).
#define EMB_CHUNK 64

typedef struct {
    int n, V, D;
    int max_items, max_long, max_partials;
    int *h_count;     // host scratch [V + 1] for the counting sort
    int *d_buf;       // the plan on the device, read by the kernels
    float *d_partial; // [max_partials, D] fp32 partial rows of the long runs
} EmbeddingBackwardPlan;

// Layout of the plan buffer, host and device alike: [0] items, [1] long runs, [2] partial rows used; then
// order[n] (positions sorted by token), items[max_items][4] = {first in order, count, token, partial row or -1},
// runs[max_long][3] = {token, first partial row, pieces}.
#define EMB_PLAN_ORDER 3
__host__ __device__ static inline size_t emb_plan_items_at(int n) { return EMB_PLAN_ORDER + (size_t)n; }
__host__ __device__ static inline size_t emb_plan_runs_at(int n, int max_items) {
    return emb_plan_items_at(n) + 4 * (size_t)max_items;
}
static inline size_t emb_plan_ints(const EmbeddingBackwardPlan *p) {
    return emb_plan_runs_at(p->n, p->max_items) + 3 * (size_t)p->max_long;
}

// Sizes: items <= n (each holds a position); long runs have > EMB_CHUNK positions so there are < n / EMB_CHUNK of
// them, and a run of L > EMB_CHUNK positions has ceil(L / EMB_CHUNK) < 2 L / EMB_CHUNK pieces.
static inline void embedding_backward_plan_create(EmbeddingBackwardPlan *p, int n, int V, int D) {
    p->n = n;
    p->V = V;
    p->D = D;
    p->max_items = n;
    p->max_long = SDM_MAX(1, n / EMB_CHUNK);
    p->max_partials = SDM_MAX(1, 2 * n / EMB_CHUNK);
    p->h_count = (int *)sdm_malloc(((size_t)V + 1) * sizeof(int));
    p->d_buf = (int *)device_alloc(MEM_SCRATCH, emb_plan_ints(p) * sizeof(int));
    p->d_partial = (float *)device_alloc(MEM_SCRATCH, (size_t)p->max_partials * D * sizeof(float));
}

static inline void embedding_backward_plan_destroy(EmbeddingBackwardPlan *p) {
    free(p->h_count);
    device_free(p->d_buf);
    device_free(p->d_partial);
    memset(p, 0, sizeof(*p));
}


// Fill buf [emb_plan_ints(p)] (host) with the plan of tokens[n] (each in [0, V)).
static inline void embedding_backward_plan_fill(EmbeddingBackwardPlan *p, const int *tokens, int *buf) {
    int n = p->n, V = p->V, *count = p->h_count;
    int *order = buf + EMB_PLAN_ORDER, *items = buf + emb_plan_items_at(n);
    int *runs = buf + emb_plan_runs_at(n, p->max_items);
    memset(count, 0, ((size_t)V + 1) * sizeof(int));
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= V)
            sdm_die("embedding: token %d at position %d not in [0, %d)", tokens[i], i, V);
        count[tokens[i] + 1]++;
    }
    for (int v = 0; v < V; v++) count[v + 1] += count[v]; // count[v] = first slot of token v
    for (int i = 0; i < n; i++) order[count[tokens[i]]++] = i; // now count[v] = end of token v's run
    int n_items = 0, n_runs = 0, n_partials = 0;
    for (int v = 0, first = 0; v < V; first = count[v], v++) {
        int len = count[v] - first;
        if (len == 0) continue;
        if (len <= EMB_CHUNK) {
            int *it = items + 4 * n_items++;
            it[0] = first, it[1] = len, it[2] = v, it[3] = -1;
            continue;
        }
        int *run = runs + 3 * n_runs++;
        run[0] = v, run[1] = n_partials, run[2] = 0;
        for (int start = first; start < first + len; start += EMB_CHUNK) {
            int *it = items + 4 * n_items++;
            it[0] = start, it[1] = SDM_MIN(EMB_CHUNK, first + len - start), it[2] = v, it[3] = n_partials++;
            run[2]++;
        }
    }
    buf[0] = n_items, buf[1] = n_runs, buf[2] = n_partials;
}

// The plan in buf (host, filled by embedding_backward_plan_fill) to the device on stream s, for the next
// embedding_backward. A captured step fills a pinned buffer before each replay, whose copy node reads it then.
static inline void embedding_backward_plan_upload(EmbeddingBackwardPlan *p, const int *buf, cudaStream_t s) {
    cudaCheck(cudaMemcpyAsync(p->d_buf, buf, emb_plan_ints(p) * sizeof(int), cudaMemcpyHostToDevice, s));
}

// Pass 1: each item sums its positions' dout rows in sorted (= increasing position) order, then adds the sum to
// dE[token] or stores it as the partial row of its piece. Blocks stride over items.
template <typename T>
__global__ void embedding_backward_items_kernel(float *dE, float *partial, const T *dout, const int *buf, int n,
                                                int D) {
    __shared__ int pos[EMB_CHUNK];
    const int *order = buf + EMB_PLAN_ORDER, *items = buf + emb_plan_items_at(n);
    for (int i = blockIdx.x; i < buf[0]; i += gridDim.x) {
        const int *it = items + 4 * i;
        int first = it[0], count = it[1], token = it[2], slot = it[3];
        __syncthreads(); // the previous item's positions are no longer read
        for (int j = threadIdx.x; j < count; j += blockDim.x) pos[j] = order[first + j];
        __syncthreads();
        float *dst = slot < 0 ? dE + (size_t)token * D : partial + (size_t)slot * D;
        for (int k = threadIdx.x; k < D; k += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < count; j++) acc += dtype_to_float(dout[(size_t)pos[j] * D + k]);
            dst[k] = slot < 0 ? dst[k] + acc : acc;
        }
    }
}

// Pass 2: each long run adds its pieces' partial rows, in piece order, into dE[token].
__global__ void embedding_backward_runs_kernel(float *dE, const float *partial, const int *buf, int n, int max_items,
                                               int D) {
    const int *runs = buf + emb_plan_runs_at(n, max_items);
    for (int r = blockIdx.x; r < buf[1]; r += gridDim.x) {
        int token = runs[3 * r], slot0 = runs[3 * r + 1], pieces = runs[3 * r + 2];
        for (int k = threadIdx.x; k < D; k += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < pieces; j++) acc += partial[(size_t)(slot0 + j) * D + k];
            dE[(size_t)token * D + k] += acc;
        }
    }
}

// dE[V, D] (fp32) += Σ_i onehot(tokens[i]) dout[i, :] for the batch of the last plan uploaded; dout [n, D] is dtype.
static inline void embedding_backward(float *dE, const void *dout, Dtype dtype,
                                      const EmbeddingBackwardPlan *p, cudaStream_t s) {
    int item_blocks = SDM_MIN(p->max_items, 4096), run_blocks = SDM_MIN(p->max_long, 1024);
    DTYPE_DISPATCH(dtype, "embedding_backward",
                 embedding_backward_items_kernel<T><<<item_blocks, 256, 0, s>>>(dE, p->d_partial, (const T *)dout,
                                                                                p->d_buf, p->n, p->D));
    cudaCheckLast();
    embedding_backward_runs_kernel<<<run_blocks, 256, 0, s>>>(dE, p->d_partial, p->d_buf, p->n, p->max_items, p->D);
    cudaCheckLast();
}

// ------------------------------------------------------------------------------------------------------------------
// Vector access
//
// The bandwidth-bound kernels below move 16-byte vectors (DtypeVec<T>: 8 bf16 or 4 fp32) when every row width and
// row stride is a multiple of the vector, and single elements otherwise. The choice depends on the widths alone, so
// a result's bits never depend on where a buffer lies; the vector path then requires 16-byte aligned pointers, which
// every caller passes (cudaMalloc'ed buffers at whole-row offsets).

// Stop unless p (NULL allowed) is 16-byte aligned.
static inline void layers_require_aligned16(const char *what, const void *p) {
    if ((uintptr_t)p % 16)
        sdm_die("%s: %p is not 16-byte aligned, as rows of a multiple of 16 bytes require", what, p);
}

// ------------------------------------------------------------------------------------------------------------------
// RMSNorm, with the residual add of the block fused in front (docs/MODEL.md#blocks)
//   vector path (D a multiple of the vector, at most RMS_THREADS * RMS_MAX_VPT vectors: bf16 D <= 8192, fp32
//     D <= 4096): a block of threads takes a row, whose vectors are dealt to its threads round-robin and stay in
//     registers, so every element is read once and written once (forward: h_in, branch read, h_out, y written;
//     backward: x, dy, dx when accumulating read, dx written);
//   scalar path (any other D): one warp per row with 2-byte accesses, h (forward) and x, dy (backward) read twice.
// Sums over a row run per thread, then by the warp butterfly, then over the warps in order: fixed for a given D.

#define RMS_WARPS 8     // scalar path: rows per block in the forward (one warp per row) and per tile in the backward
#define RMS_THREADS 512 // vector path: most threads per row
#define RMS_MAX_VPT 2   // vector path: most vectors per thread and row (more would spill registers)

// Vector path layout for rows of D elements: thread t of `threads` (a multiple of 32) holds vectors t + threads * i,
// i < vpt (1 or 2), of each row. vpt = 0: the scalar path.
typedef struct {
    int threads, vpt;
} RmsVecLayout;

static inline RmsVecLayout rmsnorm_vec_layout(Dtype dtype, int D) {
    RmsVecLayout lay = {0, 0};
    int per_vec = 16 / (int)dtype_size(dtype), V = D / per_vec, vpt = 1;
    if (D % per_vec) return lay;
    while (vpt < RMS_MAX_VPT && vpt * RMS_THREADS < V) vpt *= 2;
    if (vpt * RMS_THREADS < V) return lay;
    lay.vpt = vpt;
    lay.threads = 32 * ceil_div(ceil_div(V, vpt), 32);
    return lay;
}

// Run `...` (a statement using the constant VPT) with VPT = vpt, 1 or 2.
#define RMS_VPT_DISPATCH(vpt, ...)                                                      \
    do {                                                                                \
        if ((vpt) == 1) {                                                               \
            constexpr int VPT = 1;                                                      \
            __VA_ARGS__;                                                                \
        } else {                                                                        \
            constexpr int VPT = 2;                                                      \
            __VA_ARGS__;                                                                \
        }                                                                               \
    } while (0)

// The steps of the forward, one definition each: the vector kernel's row (rms_vec_row) and its sums and output.

// h += b, rounded to T: the stored residual sum.
template <typename T> __device__ __forceinline__ void rms_residual(DtypeVec<T> &h, const DtypeVec<T> &b) {
#pragma unroll
    for (int e = 0; e < DtypeVec<T>::N; e++) h.set(e, h.get(e) + b.get(e));
}

// rstd = 1 / sqrt(mean(h²) + eps) from the row's sum of squares ss.
__device__ __forceinline__ float rms_rstd(float ss, int D, float eps) { return rsqrtf(ss / (float)D + eps); }

// An output element y = h * rstd * w, before its rounding to T.
__device__ __forceinline__ float rms_scaled(float h, float rs, float w) { return h * rs * w; }

// Scalar path, one warp per row: h = h_in (+ branch), rounded to T and stored when branch is given (the norm and its
// backward both see the stored h); rstd = 1 / sqrt(mean(h²) + eps); y = h * rstd * w. rstd may be NULL (not kept).
template <typename T>
__global__ void rmsnorm_forward_kernel(T *y, float *rstd, T *h_out, const T *h_in, const T *branch, const T *w, int n,
                                       int D, float eps) {
    pdl_enter();
    int row = blockIdx.x * RMS_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= n) return;
    size_t base = (size_t)row * D;
    const T *h = h_in + base;
    if (branch) {
        for (int k = lane; k < D; k += 32)
            h_out[base + k] = dtype_from_float<T>(dtype_to_float(h_in[base + k]) + dtype_to_float(branch[base + k]));
        h = h_out + base; // each lane reads back only the elements it wrote
    }
    float ss = 0.0f;
    for (int k = lane; k < D; k += 32) {
        float v = dtype_to_float(h[k]);
        ss += v * v;
    }
    float r = rms_rstd(core_warp_sum(ss), D, eps);
    for (int k = lane; k < D; k += 32)
        y[base + k] = dtype_from_float<T>(rms_scaled(dtype_to_float(h[k]), r, dtype_to_float(w[k])));
    if (rstd && lane == 0) rstd[row] = r;
}

// The sum of warp_sum[0 .. warps) in order.
__device__ __forceinline__ float rms_warps_sum(const float *warp_sum, int warps) {
    float v = 0.0f;
    for (int k = 0; k < warps; k++) v += warp_sum[k];
    return v;
}

// The block's sum of v: per warp by the butterfly, then the warps' sums in order (known to every thread).
// warp_buf [blockDim.x / 32] may be reused only after a later barrier.
__device__ __forceinline__ float rms_block_sum(float v, float *warp_buf) {
    v = core_warp_sum(v);
    if ((threadIdx.x & 31) == 0) warp_buf[threadIdx.x >> 5] = v;
    __syncthreads();
    return rms_warps_sum(warp_buf, blockDim.x >> 5);
}

// Thread t's vectors j = t + i * threads < V (i < VPT) of a row in the vector layout: h[i] = h_in's, plus branch's
// where given (rms_residual); returns the sum of their squares, element by element in order. All loads come first:
// the norm kernel's h_out may alias h_in, so the compiler could not hoist them over its store.
template <typename T, int VPT>
__device__ __forceinline__ float rms_vec_row(DtypeVec<T> (&h)[VPT], const T *h_in, const T *branch, int t,
                                             int threads, int V) {
    typedef DtypeVec<T> Vec;
    Vec b[VPT];
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        int j = t + i * threads;
        if (j >= V) continue;
        h[i] = dtype_pack_load<Vec>(h_in + (size_t)j * Vec::N);
        if (branch) b[i] = dtype_pack_load<Vec>(branch + (size_t)j * Vec::N);
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        if (t + i * threads >= V) continue;
        if (branch) rms_residual(h[i], b[i]);
#pragma unroll
        for (int e = 0; e < Vec::N; e++) ss += h[i].get(e) * h[i].get(e);
    }
    return ss;
}

// Stores thread t's vectors h of a row (rms_vec_row's) to row.
template <typename T, int VPT>
__device__ __forceinline__ void rms_vec_store(T *row, const DtypeVec<T> (&h)[VPT], int t, int threads, int V) {
#pragma unroll
    for (int i = 0; i < VPT; i++)
        if (t + i * threads < V) dtype_pack_store(row + (size_t)(t + i * threads) * DtypeVec<T>::N, h[i]);
}

// Vector path, the same: block b normalizes row b.
template <typename T, int VPT>
__global__ void __launch_bounds__(RMS_THREADS)
    rmsnorm_forward_vec_kernel(T *y, float *rstd, T *h_out, const T *h_in, const T *branch, const T *w, int D,
                               float eps) {
    typedef DtypeVec<T> Vec;
    __shared__ float warp_ss[RMS_THREADS / 32];
    int V = D / Vec::N;
    size_t base = (size_t)blockIdx.x * D;
    Vec wv[VPT], h[VPT];
#pragma unroll
    for (int i = 0; i < VPT; i++) { // the weights before pdl_wait: nothing in a step writes them
        int j = threadIdx.x + i * blockDim.x;
        if (j < V) wv[i] = dtype_pack_load<Vec>(w + (size_t)j * Vec::N);
    }
    pdl_enter();
    float ss = rms_vec_row<T, VPT>(h, h_in + base, branch ? branch + base : NULL, threadIdx.x, blockDim.x, V);
    if (branch) rms_vec_store<T, VPT>(h_out + base, h, threadIdx.x, blockDim.x, V);
    float rs = rms_rstd(rms_block_sum(ss, warp_ss), D, eps);
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j >= V) continue;
        Vec out;
#pragma unroll
        for (int e = 0; e < Vec::N; e++) out.set(e, rms_scaled(h[i].get(e), rs, wv[i].get(e)));
        dtype_pack_store(y + base + (size_t)j * Vec::N, out);
    }
    if (rstd && threadIdx.x == 0) rstd[blockIdx.x] = rs;
}

// Both forwards: h_out = h_in + branch when branch is given.
static inline void rmsnorm_forward_launch(const char *what, void *y, float *rstd, void *h_out, const void *h_in,
                                          const void *branch, const void *w, Dtype dtype, int n, int D, float eps,
                                          cudaStream_t s) {
    RmsVecLayout lay = rmsnorm_vec_layout(dtype, D);
    if (!lay.vpt) {
        DTYPE_DISPATCH(dtype, what,
                       launch_pdl(rmsnorm_forward_kernel<T>, ceil_div(n, RMS_WARPS), 32 * RMS_WARPS, 0, s, (T *)y,
                                  rstd, (T *)h_out, (const T *)h_in, (const T *)branch, (const T *)w, n, D, eps));
    } else {
        const void *ptrs[] = {y, h_out, h_in, branch, w};
        for (const void *p : ptrs) layers_require_aligned16(what, p);
        DTYPE_DISPATCH(dtype, what,
                       RMS_VPT_DISPATCH(lay.vpt,
                                        launch_pdl(rmsnorm_forward_vec_kernel<T, VPT>, n, lay.threads, 0, s,
                                                   (T *)y, rstd, (T *)h_out, (const T *)h_in, (const T *)branch,
                                                   (const T *)w, D, eps)));
    }
    cudaCheckLast();
}

// y[n, D] = RMSNorm(x) * w; rstd[n] saved for the backward (NULL: not kept).
static inline void rmsnorm_forward(void *y, float *rstd, const void *x, const void *w, Dtype dtype, int n,
                                   int D, float eps, cudaStream_t s) {
    rmsnorm_forward_launch("rmsnorm_forward", y, rstd, NULL, x, NULL, w, dtype, n, D, eps, s);
}

// h_out[n, D] = h_in + branch (the residual add; h_out may alias h_in), then y = RMSNorm(h_out) * w; rstd[n] saved
// (NULL: not kept).
static inline void residual_rmsnorm_forward(void *h_out, void *y, float *rstd, const void *h_in, const void *branch,
                                            const void *w, Dtype dtype, int n, int D, float eps,
                                            cudaStream_t s) {
    rmsnorm_forward_launch("residual_rmsnorm_forward", y, rstd, h_out, h_in, branch, w, dtype, n, D, eps, s);
}

// The residual add and RMSNorm as the input of a product (core/matmul_small_m.cuh MatmulParts.norm: core/matmul.cuh
// runs the norm kernel into the product's input buffer, then the product).
//   X [n, D] = RMSNorm(h + add) * w (add NULL: RMSNorm(h) * w), h_out = h + add
typedef struct {
    const void *h, *add; // [n, D] the residual stream and the branch added to it (NULL: none)
    void *h_out;         // [n, D] h + add when add is given (may alias h)
    const void *w;       // [D] the norm's weight
    float eps;
} ResidualNorm;

// y [n, D] = X of r by the norm kernels (rstd not kept).
static inline void residual_norm_forward(const ResidualNorm *r, void *y, Dtype dtype, int n, int D, cudaStream_t s) {
    if (r->add) residual_rmsnorm_forward(r->h_out, y, NULL, r->h, r->add, r->w, dtype, n, D, r->eps, s);
    else rmsnorm_forward(y, NULL, r->h, r->w, dtype, n, D, r->eps, s);
}

// RMSNorm backward: dx = rstd·w·dy − rstd³·x·dot/D with dot = Σ_k dy·w·x of the row, and dw += Σ_rows dy·x·rstd.
// Block b owns rows [b * rows_per_block, ...) and writes its dw sums to partial[b, :]; a second kernel adds the
// blocks' partials in a fixed order. The split depends only on (n, D): the result is bitwise reproducible.
// Scalar path: the block walks its rows in tiles of RMS_WARPS rows:
//   1. warp j computes dot_j of row j of the tile;
//   2. thread t, for its columns k, writes dx[r, k] for the tile's rows in order and adds dy·x·rstd to its column's
//      running dw sum in shared memory.
template <typename T>
__global__ void rmsnorm_backward_kernel(T *dx, float *partial, const T *dy, const T *x, const T *w, const float *rstd,
                                        int n, int D, int rows_per_block, int accumulate) {
    extern __shared__ float rmsnorm_dw_acc[]; // [D]
    __shared__ float dot[RMS_WARPS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int r0 = blockIdx.x * rows_per_block, r1 = min(n, r0 + rows_per_block);
    for (int k = threadIdx.x; k < D; k += blockDim.x) rmsnorm_dw_acc[k] = 0.0f;
    for (int t0 = r0; t0 < r1; t0 += RMS_WARPS) {
        int rows = min(RMS_WARPS, r1 - t0);
        if (warp < rows) {
            size_t base = (size_t)(t0 + warp) * D;
            float d = 0.0f;
            for (int k = lane; k < D; k += 32)
                d += dtype_to_float(dy[base + k]) * dtype_to_float(w[k]) * dtype_to_float(x[base + k]);
            d = core_warp_sum(d);
            if (lane == 0) dot[warp] = d;
        }
        __syncthreads();
        for (int k = threadIdx.x; k < D; k += blockDim.x) {
            float wk = dtype_to_float(w[k]), acc = rmsnorm_dw_acc[k];
            for (int j = 0; j < rows; j++) {
                size_t i = (size_t)(t0 + j) * D + k;
                float r = rstd[t0 + j], g = dtype_to_float(dy[i]), xv = dtype_to_float(x[i]);
                float d = r * wk * g - r * r * r * xv * dot[j] / (float)D;
                dx[i] = dtype_from_float<T>(accumulate ? dtype_to_float(dx[i]) + d : d);
                acc += g * xv * r;
            }
            rmsnorm_dw_acc[k] = acc;
        }
        __syncthreads(); // dot is rewritten by the next tile
    }
    for (int k = threadIdx.x; k < D; k += blockDim.x) partial[(size_t)blockIdx.x * D + k] = rmsnorm_dw_acc[k];
}

// Vector path: the block walks its rows in order with the row layout of the forward; each thread keeps the dw sums
// of its own columns in registers, so partial[b, :] needs no shared memory. The per-warp dot slots are
// double-buffered: one barrier per row.
template <typename T, int VPT>
__global__ void __launch_bounds__(RMS_THREADS, VPT == 1 ? 2 : 1)
    rmsnorm_backward_vec_kernel(T *dx, float *partial, const T *dy, const T *x, const T *w, const float *rstd, int n,
                                int D, int rows_per_block, int accumulate) {
    typedef DtypeVec<T> Vec;
    typedef DtypePack<float, 4> Float4;
    __shared__ float warp_dot[2][RMS_THREADS / 32];
    int V = D / Vec::N;
    int r0 = blockIdx.x * rows_per_block, r1 = min(n, r0 + rows_per_block);
    Vec wv[VPT];
    float dw[VPT][Vec::N];
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < V) wv[i] = dtype_pack_load<Vec>(w + (size_t)j * Vec::N);
#pragma unroll
        for (int e = 0; e < Vec::N; e++) dw[i][e] = 0.0f;
    }
    for (int row = r0, buf = 0; row < r1; row++, buf ^= 1) {
        size_t base = (size_t)row * D;
        float rs = rstd[row], dot = 0.0f;
        Vec xv[VPT], gv[VPT], dv[VPT];
#pragma unroll
        for (int i = 0; i < VPT; i++) {
            int j = threadIdx.x + i * blockDim.x;
            if (j >= V) continue;
            xv[i] = dtype_pack_load<Vec>(x + base + (size_t)j * Vec::N);
            gv[i] = dtype_pack_load<Vec>(dy + base + (size_t)j * Vec::N);
            if (accumulate) dv[i] = dtype_pack_load<Vec>(dx + base + (size_t)j * Vec::N);
        }
#pragma unroll
        for (int i = 0; i < VPT; i++) {
            if (threadIdx.x + i * blockDim.x >= V) continue;
#pragma unroll
            for (int e = 0; e < Vec::N; e++) dot += gv[i].get(e) * wv[i].get(e) * xv[i].get(e);
        }
        dot = rms_block_sum(dot, warp_dot[buf]); // warp_dot[buf] is rewritten two rows on, after the next barrier
        float c = rs * rs * rs * dot / (float)D;
#pragma unroll
        for (int i = 0; i < VPT; i++) {
            int j = threadIdx.x + i * blockDim.x;
            if (j >= V) continue;
            Vec out;
#pragma unroll
            for (int e = 0; e < Vec::N; e++) {
                float g = gv[i].get(e), xe = xv[i].get(e), d = rs * wv[i].get(e) * g - c * xe;
                out.set(e, accumulate ? dv[i].get(e) + d : d);
                dw[i][e] += g * xe * rs;
            }
            dtype_pack_store(dx + base + (size_t)j * Vec::N, out);
        }
    }
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j >= V) continue;
#pragma unroll
        for (int q = 0; q < Vec::N; q += 4) {
            Float4 p;
#pragma unroll
            for (int e = 0; e < 4; e++) p.e[e] = dw[i][q + e];
            dtype_pack_store(partial + (size_t)blockIdx.x * D + (size_t)j * Vec::N + q, p);
        }
    }
}

#define RMS_FINISH_SLICES 32 // threads per column in the partials' sum

// dw[k] += Σ_b partial[b, k] in a fixed order: thread (c, s) of a 32 x RMS_FINISH_SLICES block sums the blocks
// b = s, s + RMS_FINISH_SLICES, ... of column 32 * blockIdx.x + c in increasing b, then thread (c, 0) adds the
// slices' sums in order. Many threads per column keep loads in flight; one thread per column waited on each load.
__global__ void rmsnorm_partials_finish_kernel(float *dw, const float *partial, int blocks, int D) {
    __shared__ float slice_sum[RMS_FINISH_SLICES][32];
    int c = threadIdx.x, s = threadIdx.y, k = blockIdx.x * 32 + c;
    float acc = 0.0f;
    if (k < D)
        for (int b = s; b < blocks; b += RMS_FINISH_SLICES) acc += partial[(size_t)b * D + k];
    slice_sum[s][c] = acc;
    __syncthreads();
    if (s > 0 || k >= D) return;
    float total = 0.0f;
    for (int j = 0; j < RMS_FINISH_SLICES; j++) total += slice_sum[j][c];
    dw[k] += total;
}

#define RMS_BWD_MAX_BLOCKS 528 // 4 per SM of an H200 (132 SMs); fixed so the sum order never depends on the GPU

// Rows per block of the backward for n rows: a whole number of RMS_WARPS-row tiles, at most RMS_BWD_MAX_BLOCKS
// blocks.
static inline int rmsnorm_backward_rows_per_block(int n) {
    int tiles = ceil_div(n, RMS_WARPS);
    return RMS_WARPS * ceil_div(tiles, RMS_BWD_MAX_BLOCKS);
}

// Scratch floats rmsnorm_backward needs for n rows of width D.
static inline size_t rmsnorm_backward_scratch_floats(int n, int D) {
    return (size_t)ceil_div(n, rmsnorm_backward_rows_per_block(n)) * D;
}

// dx[n, D] (=, or += when accumulate) d loss / d x from dy[n, D]; dw[D] (fp32) += d loss / d w.
// x is the norm's input (h_out of the fused forward), rstd the forward's; scratch holds
// rmsnorm_backward_scratch_floats(n, D) floats. dx may overwrite dy in place when not accumulating (each element is
// read before it is written, by the same thread); it may not alias x.
static inline void rmsnorm_backward(void *dx, float *dw, float *scratch, const void *dy, const void *x, const void *w,
                                    const float *rstd, Dtype dtype, int n, int D, int accumulate,
                                    cudaStream_t s) {
    int rows_per_block = rmsnorm_backward_rows_per_block(n), blocks = ceil_div(n, rows_per_block);
    RmsVecLayout lay = rmsnorm_vec_layout(dtype, D);
    if (!lay.vpt) {
        size_t smem = (size_t)D * sizeof(float);
        if (smem > 48 * 1024) sdm_die("rmsnorm_backward: D = %d exceeds the shared-memory column buffer", D);
        DTYPE_DISPATCH(dtype, "rmsnorm_backward",
                       rmsnorm_backward_kernel<T><<<blocks, 32 * RMS_WARPS, smem, s>>>(
                           (T *)dx, scratch, (const T *)dy, (const T *)x, (const T *)w, rstd, n, D, rows_per_block,
                           accumulate));
    } else {
        const void *ptrs[] = {dx, scratch, dy, x, w};
        for (const void *p : ptrs) layers_require_aligned16("rmsnorm_backward", p);
        DTYPE_DISPATCH(dtype, "rmsnorm_backward",
                       RMS_VPT_DISPATCH(lay.vpt,
                                        rmsnorm_backward_vec_kernel<T, VPT><<<blocks, lay.threads, 0, s>>>(
                                            (T *)dx, scratch, (const T *)dy, (const T *)x, (const T *)w, rstd, n, D,
                                            rows_per_block, accumulate)));
    }
    cudaCheckLast();
    rmsnorm_partials_finish_kernel<<<ceil_div(D, 32), dim3(32, RMS_FINISH_SLICES), 0, s>>>(dw, scratch, blocks, D);
    cudaCheckLast();
}

// ------------------------------------------------------------------------------------------------------------------
// SwiGLU pointwise part (docs/MODEL.md#swiglu-ffn): the W1/W3 GEMM gives a and b (one fused GEMM puts them side by side
// in a row of width 2F, hence the row stride ld), the W2 GEMM consumes h. Row r is blockIdx.x (n may exceed grid.y's
// 65535) and the columns are spread over blockIdx.y, so no thread divides by F; each thread owns W consecutive
// columns: a 16-byte vector (W = DtypeVec<T>::N) when F and the row strides are multiples of it, else one element.

// h[r, c] = silu(a[r, c]) * b[r, c]; a, b have row stride ld, h has row stride F.
template <typename T, int W>
__global__ void swiglu_forward_kernel(T *h, const T *a, const T *b, int ld, int F) {
    typedef DtypePack<T, W> P;
    pdl_enter();
    int c = (blockIdx.y * blockDim.x + threadIdx.x) * W;
    if (c >= F) return;
    size_t i = (size_t)blockIdx.x * ld + c;
    P av = dtype_pack_load<P>(a + i), bv = dtype_pack_load<P>(b + i), hv;
#pragma unroll
    for (int e = 0; e < W; e++) hv.set(e, core_swiglu(av.get(e), bv.get(e)));
    dtype_pack_store(h + (size_t)blockIdx.x * F + c, hv);
}

// da = dh · b · silu'(a), db = dh · silu(a), with silu'(a) = s (1 + a (1 − s)), s = sigmoid(a). Each thread reads
// its a, b before writing, so da, db may overwrite a, b in place (same ld).
template <typename T, int W>
__global__ void swiglu_backward_kernel(T *da, T *db, int ld_out, const T *dh, const T *a, const T *b, int ld, int F) {
    typedef DtypePack<T, W> P;
    int c = (blockIdx.y * blockDim.x + threadIdx.x) * W;
    if (c >= F) return;
    size_t r = blockIdx.x, i = r * ld + c, o = r * ld_out + c;
    P av = dtype_pack_load<P>(a + i), bv = dtype_pack_load<P>(b + i), g = dtype_pack_load<P>(dh + r * F + c);
    P dav, dbv;
#pragma unroll
    for (int e = 0; e < W; e++) {
        float x = av.get(e), sg = core_sigmoidf(x);
        dav.set(e, g.get(e) * bv.get(e) * sg * (1.0f + x * (1.0f - sg)));
        dbv.set(e, g.get(e) * x * sg);
    }
    dtype_pack_store(da + o, dav);
    dtype_pack_store(db + o, dbv);
}

// Launch shape for n rows of `groups` column groups: grid (n, ...) of blocks of up to 256 threads.
static inline void swiglu_shape(int n, int groups, dim3 *grid, int *threads) {
    *threads = SDM_MIN(256, 32 * ceil_div(groups, 32));
    *grid = dim3((unsigned)n, (unsigned)ceil_div(groups, *threads));
}

// h[n, F] = silu(a) * b, a and b [n, F] with row stride ld (ld = 2F and b = a + F for the fused W1|W3 output).
static inline void swiglu_forward(void *h, const void *a, const void *b, int ld, Dtype dtype, int n, int F,
                                  cudaStream_t s) {
    int per_vec = 16 / (int)dtype_size(dtype), vec = F % per_vec == 0 && ld % per_vec == 0, threads;
    dim3 grid;
    swiglu_shape(n, vec ? F / per_vec : F, &grid, &threads);
    if (vec) {
        const void *ptrs[] = {h, a, b};
        for (const void *p : ptrs) layers_require_aligned16("swiglu_forward", p);
    }
    DTYPE_DISPATCH(dtype, "swiglu_forward",
                   if (vec) launch_pdl(swiglu_forward_kernel<T, DtypeVec<T>::N>, grid, threads, 0, s, (T *)h,
                                       (const T *)a, (const T *)b, ld, F);
                   else launch_pdl(swiglu_forward_kernel<T, 1>, grid, threads, 0, s, (T *)h, (const T *)a,
                                   (const T *)b, ld, F));
    cudaCheckLast();
}

// da, db [n, F] (row stride ld_out, overwritten) from dh [n, F] and the forward's a, b (row stride ld).
static inline void swiglu_backward(void *da, void *db, int ld_out, const void *dh, const void *a, const void *b,
                                   int ld, Dtype dtype, int n, int F, cudaStream_t s) {
    int per_vec = 16 / (int)dtype_size(dtype), threads;
    int vec = F % per_vec == 0 && ld % per_vec == 0 && ld_out % per_vec == 0;
    dim3 grid;
    swiglu_shape(n, vec ? F / per_vec : F, &grid, &threads);
    if (vec) {
        const void *ptrs[] = {da, db, dh, a, b};
        for (const void *p : ptrs) layers_require_aligned16("swiglu_backward", p);
    }
    DTYPE_DISPATCH(dtype, "swiglu_backward",
                   if (vec) swiglu_backward_kernel<T, DtypeVec<T>::N><<<grid, threads, 0, s>>>(
                       (T *)da, (T *)db, ld_out, (const T *)dh, (const T *)a, (const T *)b, ld, F);
                   else swiglu_backward_kernel<T, 1><<<grid, threads, 0, s>>>(
                       (T *)da, (T *)db, ld_out, (const T *)dh, (const T *)a, (const T *)b, ld, F));
    cudaCheckLast();
}

#endif
