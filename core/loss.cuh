// core/loss.cuh: the fused LM-head loss (docs/MODEL.md#top-level): softmax cross-entropy over logits [n, V] in fp32,
// with the gradient written over the logits in place, so the step never holds more than the one logits buffer.
//   losses[i]   = logsumexp(logits[i, :V]) − logits[i, target[i]]
//   logits[i,v] ← dscale · (softmax(logits[i])[v] − [v == target[i]])      (dscale = 1/n for the mean loss)
//   mean        = Σ_i losses[i] / n, summed in a fixed order
// Rows may be processed in slices (pointers offset by the slice start, dscale = 1/n_total) to bound memory further.
#ifndef SDM_CORE_LOSS_CUH
#define SDM_CORE_LOSS_CUH

#include "core/cuda_common.cuh"

// Online softmax state: running max m and Σ exp(z − m). Merging is commutative, so the xor butterfly leaves the same
// bits in every lane.
struct LossSoftmaxAcc {
    float m, s;
};

__device__ __forceinline__ LossSoftmaxAcc loss_softmax_merge(LossSoftmaxAcc a, LossSoftmaxAcc b) {
    float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return a; // both empty
    LossSoftmaxAcc r = {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
    return r;
}

__device__ __forceinline__ LossSoftmaxAcc loss_block_softmax_merge(LossSoftmaxAcc v, float2 *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) {
        LossSoftmaxAcc o = {__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)};
        v = loss_softmax_merge(v, o);
    }
    if (lane == 0) scratch[warp] = make_float2(v.m, v.s);
    __syncthreads();
    LossSoftmaxAcc t = {-INFINITY, 0.0f};
    if (lane < n_warps) t = LossSoftmaxAcc{scratch[lane].x, scratch[lane].y};
    for (int off = 16; off > 0; off >>= 1) {
        LossSoftmaxAcc o = {__shfl_xor_sync(0xffffffffu, t.m, off), __shfl_xor_sync(0xffffffffu, t.s, off)};
        t = loss_softmax_merge(t, o);
    }
    return t;
}

// One block per row. Pass 1: each thread's online softmax over its strided columns, merged over the block.
// Pass 2 (when dscale != 0): overwrite the row with the gradient. A target outside [0, V) gives a NaN loss.
template <typename T>
__global__ void cross_entropy_kernel(T *logits, int ld, const int *targets, float *losses, int V, float dscale) {
    __shared__ float2 scratch[32];
    T *z = logits + (size_t)blockIdx.x * ld;
    LossSoftmaxAcc acc = {-INFINITY, 0.0f};
    for (int v = threadIdx.x; v < V; v += blockDim.x) { // one exp per element: rescale only when the max grows
        float x = dtype_to_float(z[v]);
        if (x > acc.m) {
            acc.s = acc.s * expf(acc.m - x) + 1.0f;
            acc.m = x;
        } else {
            acc.s += expf(x - acc.m);
        }
    }
    acc = loss_block_softmax_merge(acc, scratch);
    float lse = acc.m + logf(acc.s);
    int target = targets[blockIdx.x];
    bool valid = target >= 0 && target < V;
    // every thread reads z[target] before any thread overwrites the row
    float zt = valid ? dtype_to_float(z[target]) : NAN;
    __syncthreads();
    if (threadIdx.x == 0) losses[blockIdx.x] = lse - zt;
    if (dscale == 0.0f) return;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float p = expf(dtype_to_float(z[v]) - lse);
        z[v] = dtype_from_float<T>(dscale * (p - (v == target ? 1.0f : 0.0f)));
    }
}

// Threads per row: enough to keep a long row's loads in flight, few for the byte vocabulary.
static inline int cross_entropy_threads(int V) { return V <= 1024 ? 128 : (V <= 16384 ? 256 : 1024); }

// losses[n] (fp32) and, unless dscale == 0, the gradient dscale·(softmax − onehot) written over logits [n, V]
// (row stride ld >= V, columns past V untouched). targets: device ints in [0, V).
static inline void cross_entropy_forward_backward(void *logits, int ld, const int *targets, float *losses,
                                                  Dtype dtype, int n, int V, float dscale, cudaStream_t s) {
    if (ld < V) sdm_die("cross_entropy: row stride %d < V = %d", ld, V);
    DTYPE_DISPATCH(dtype, "cross_entropy_forward_backward",
                 cross_entropy_kernel<T><<<n, cross_entropy_threads(V), 0, s>>>((T *)logits, ld, targets, losses, V,
                                                                                dscale));
    cudaCheckLast();
}

#define LOSS_MEAN_THREADS 1024

// One block: thread t sums losses t, t + 1024, ... in order, then the fixed block tree; mean = sum / n.
__global__ void loss_mean_kernel(float *mean, const float *losses, int n) {
    __shared__ float scratch[32];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += losses[i];
    acc = core_block_sum(acc, scratch);
    if (threadIdx.x == 0) *mean = acc / (float)n;
}

// *mean (device float) = Σ losses[n] / n, deterministic.
static inline void loss_mean(float *mean, const float *losses, int n, cudaStream_t s) {
    loss_mean_kernel<<<1, LOSS_MEAN_THREADS, 0, s>>>(mean, losses, n);
    cudaCheckLast();
}

#endif
