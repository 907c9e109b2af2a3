// core/sampling.cuh: the sampler of core/sampling.h on the device, one block per row of logits, so a decode step
// can sample without copying logits to the host (docs/MODEL.md#generation). It computes what sample_token computes,
// in double and in the same order wherever the order changes the rounding: the softmax sum, the top-p scan over
// the tokens sorted by (probability descending, token ascending), the renormalisation and the draw take
// core/sampling.h's sums (sample_sum, sample_round_scan) on one warp; exp, the ranks of the sort and the cuts are
// parallel (their results do not depend on the order). The draw takes rng_uniform of the row's own Rng
// (core/rng.h) on the device, so the same state gives the same uniform as on the host. The only difference left is
// exp: CUDA's double exp and the C library's may differ by one ulp (2^-52 relative), which can change the token only
// when the uniform falls within ~1e-16 of a cumulative boundary: tests/gpu_test_infer.cu checks the tokens are
// equal.
#ifndef SDM_CORE_SAMPLING_CUH
#define SDM_CORE_SAMPLING_CUH

#include "core/cuda_common.cuh"
#include "core/sampling.h"

#define SAMPLE_THREADS 256

// The first maximal logit of the row (sample_argmax's choice), known to every thread; best_* are __shared__ [32].
__device__ static int sample_block_argmax(const float *logits, int V, float *best_val, int *best_idx) {
    float best = -INFINITY;
    int arg = V; // no candidate yet: loses every tie
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        if (logits[v] > best || (logits[v] == best && v < arg)) { best = logits[v]; arg = v; }
    for (int off = 16; off; off /= 2) {
        float ob = __shfl_xor_sync(0xffffffffu, best, off);
        int oa = __shfl_xor_sync(0xffffffffu, arg, off);
        if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_val[warp] = best; best_idx[warp] = arg; }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)blockDim.x / 32; w++)
            if (best_val[w] > best_val[0] || (best_val[w] == best_val[0] && best_idx[w] < best_idx[0])) {
                best_val[0] = best_val[w];
                best_idx[0] = best_idx[w];
            }
    __syncthreads();
    arg = best_idx[0];
    __syncthreads();
    return arg < V ? arg : 0; // no logit above -inf: token 0, as sample_argmax
}

// The sums run on warp 0 in core/sampling.h's order (one thread's sequential loops took 8.9 us a row of 258 tokens
// at batch 1 on the H200, 18.6 at batch 32). sample_sum's: lane l sums elements l, l + 32, ... in order, then the
// butterfly adds s[l] + s[l ^ o] for o = 16 .. 1, which is the host's s[l] += s[l + o] on every lane (addition
// commutes exactly). sample_round_scan's: x[l] += x[l - o] by shuffles up for o = 1 .. 16.
__device__ __forceinline__ double sample_warp_sum(const double *p, int V) {
    double s = 0.0;
    for (int v = threadIdx.x & 31; v < V; v += 32) s += p[v];
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}
__device__ __forceinline__ double sample_warp_scan(double x) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o *= 2) {
        double y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

// p[v] /= sample_sum(p) (sample_distribution's normalisation).
__device__ static void sample_normalise(double *p, int V, double *sum) {
    if (threadIdx.x < 32) {
        double s = sample_warp_sum(p, V);
        if (threadIdx.x == 0) *sum = s;
    }
    __syncthreads();
    for (int v = threadIdx.x; v < V; v += blockDim.x) p[v] /= *sum;
    __syncthreads();
}

// order[i] = the token at position i of the descending sort of p (ties: lower token first), by counting for each
// token the tokens ahead of it: O(V^2 / threads), cheap for the bytes vocabulary.
__device__ static void sample_sort_order(const double *p, int V, int *order) {
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        double pv = p[v];
        int rank = 0;
        for (int u = 0; u < V; u++) rank += p[u] > pv || (p[u] == pv && u < v);
        order[rank] = v;
    }
    __syncthreads();
}

// Row r of logits [rows, ld] (fp32): the next token into next[r]. probs, order [rows, V] are scratch;
// rng [rows] advances by one draw per row when temperature > 0 (sample_token's use of it).
__global__ void __launch_bounds__(SAMPLE_THREADS)
sample_tokens_kernel(const float *logits, int ld, int V, SamplingParams sp, Rng *rng, double *probs, int *order,
                     int *next) {
    __shared__ float best_val[32];
    __shared__ int best_idx[32];
    __shared__ double sum;
    pdl_enter();
    int r = blockIdx.x;
    const float *l = logits + (size_t)r * ld;
    int best = sample_block_argmax(l, V, best_val, best_idx);
    if (sp.temperature <= 0.0) {
        if (threadIdx.x == 0) next[r] = best;
        return;
    }
    double *p = probs + (size_t)r * V, mx = l[best];
    int *ord = order + (size_t)r * V;
    for (int v = threadIdx.x; v < V; v += blockDim.x) p[v] = exp(((double)l[v] - mx) / sp.temperature);
    __syncthreads();
    sample_normalise(p, V, &sum);
    if (sp.top_p > 0.0 || sp.top_k > 0) {
        sample_sort_order(p, V, ord);
        if (sp.top_p > 0.0) {
            if (threadIdx.x < 32) {
                const int lane = threadIdx.x;
                double carry = 0.0; // mass of the rounds before
                for (int i0 = 0; i0 < V; i0 += 32) {
                    const int i = i0 + lane;
                    double x = sample_warp_scan(i < V ? p[ord[i]] : 0.0);
                    double ahead = __shfl_up_sync(0xffffffffu, x, 1), before = lane ? carry + ahead : carry;
                    carry += __shfl_sync(0xffffffffu, x, 31);
                    if (i < V && before > sp.top_p) p[ord[i]] = 0.0; // outside the nucleus
                }
            }
        } else if (sp.top_k < V) {
            double kth = p[ord[sp.top_k - 1]]; // never zeroed below, so every thread reads it intact
            for (int v = threadIdx.x; v < V; v += blockDim.x)
                if (p[v] < kth) p[v] = 0.0;
        }
        __syncthreads();
        sample_normalise(p, V, &sum);
    }
    if (threadIdx.x >= 32) return;
    // the draw: the first kept token whose cumulative mass (by rounds, sample_round_scan) exceeds u
    const int lane = threadIdx.x;
    double u = __shfl_sync(0xffffffffu, lane == 0 ? rng_uniform(&rng[r]) : 0.0, 0), carry = 0.0;
    int last = 0, tok = -1;
    for (int v0 = 0; v0 < V && tok < 0; v0 += 32) {
        const int v = v0 + lane;
        const double pv = v < V ? p[v] : 0.0, x = sample_warp_scan(pv);
        const unsigned kept = __ballot_sync(0xffffffffu, pv > 0.0);
        const unsigned hit = __ballot_sync(0xffffffffu, pv > 0.0 && u < carry + x);
        if (hit) tok = v0 + __ffs(hit) - 1;
        else if (kept) last = v0 + 31 - __clz(kept);
        carry += __shfl_sync(0xffffffffu, x, 31);
    }
    if (lane == 0) next[r] = tok < 0 ? last : tok; // u within rounding of 1: the last kept token
}

// next[r] = the token sample_token would draw from row r of logits [rows, ld] with rng[r], for every row.
static inline void sample_tokens(const float *logits, int ld, int V, int rows, const SamplingParams *sp, Rng *rng,
                                 double *probs, int *order, int *next, cudaStream_t st) {
    if (rows == 0) return;
    launch_pdl(sample_tokens_kernel, rows, SAMPLE_THREADS, 0, st, logits, ld, V, *sp, rng, probs, order, next);
}

#endif
