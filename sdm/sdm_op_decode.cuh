// sdm/sdm_op_decode.cuh: the single-token decode step of the SDM op (docs/SDM.md#the-recurrence,
// docs/SDM.md#decode-and-prefill): sdm_op_decode applies the recurrence (retrieval from the decayed rows, delta, write,
// read after the write) to one token of each of the B*H streams, in place on the bank [B,H,N,d] (bf16 or fp32),
// readings to out [B,1,H,d]. Inputs in the op's layout with T = 1. No workspace.
#ifndef SDM_SDM_OP_DECODE_CUH
#define SDM_SDM_OP_DECODE_CUH

#include "sdm/sdm_op_common.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Decode: one token per stream, grid (ceil(d / (32 V)), S), SDM_DECODE_WARPS warps per block. Lane l of every warp
// owns the same V columns of its stream (columns are independent); warp w takes the entries k = w, w + WARPS, ...
// of steps (1)-(5) of docs/SDM.md#the-recurrence, so the W + R rows of a stream are fetched by all warps at once
// rather than by one thread in turn (at small batch the step is bound by memory latency, not bandwidth). Partial
// sums meet in shared memory and are added in warp order (deterministic). The W slots of a token are distinct, so
// the warps' writes never touch a row twice; a barrier makes them visible to the reads of step (5).
#define SDM_DECODE_WARPS 16

// r = the sum over the block's warps of each warp's r (same columns), in warp order; part: __shared__ scratch.
template <int V> __device__ __forceinline__ void sdm_decode_sum_warps(float (*part)[32 * V], float *r) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int i = 0; i < V; i++) part[w][lane * V + i] = r[i];
    __syncthreads();
    for (int i = 0; i < V; i++) r[i] = 0.f;
    for (int j = 0; j < SDM_DECODE_WARPS; j++)
        for (int i = 0; i < V; i++) r[i] += part[j][lane * V + i];
    __syncthreads(); // part is reused
}

template <typename Tb>
__global__ void __launch_bounds__(32 * SDM_DECODE_WARPS) sdm_decode_kernel(SdmOpShape sh, SdmOpInputs in, Tb *bank,
                                                                          float *out) {
    constexpr int V = SdmBankVec<Tb>::V;
    __shared__ float part[SDM_DECODE_WARPS][32 * V];
    pdl_enter();
    const int s = blockIdx.y, w = threadIdx.x >> 5, col = (blockIdx.x * 32 + (threadIdx.x & 31)) * V;
    const bool active = col < sh.d; // inactive threads still meet the barriers
    Tb *M = bank + (size_t)s * sh.N * sh.d;
    const size_t ow = (size_t)s * sh.W, orr = (size_t)s * sh.R;
    float r[V], x[V];
    for (int i = 0; i < V; i++) r[i] = 0.f;
#pragma unroll 4
    for (int k = w; active && k < sh.W; k += SDM_DECODE_WARPS) { // (1)-(2): retrieval from the decayed rows
        SdmBankVec<Tb>::load(M + (size_t)in.wslot[ow + k] * sh.d + col, x);
        float g = in.kappa[ow + k] * expf(in.gamma[ow + k]);
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
    sdm_decode_sum_warps<V>(part, r);
    if (active) {
        float bt = in.beta[s];
        const float *vv = in.v + (size_t)s * sh.d + col;
        for (int i = 0; i < V; i++) r[i] = bt * (vv[i] - r[i]); // (3) r now holds delta
    }
#pragma unroll 4
    for (int k = w; active && k < sh.W; k += SDM_DECODE_WARPS) { // (4) write
        Tb *row = M + (size_t)in.wslot[ow + k] * sh.d + col;
        SdmBankVec<Tb>::load(row, x);
        float a = expf(in.gamma[ow + k]), kp = in.kappa[ow + k];
        for (int i = 0; i < V; i++) x[i] = fmaf(a, x[i], kp * r[i]);
        SdmBankVec<Tb>::store(row, x);
    }
    __syncthreads(); // every write lands before any read
    for (int i = 0; i < V; i++) r[i] = 0.f;
#pragma unroll 4
    for (int k = w; active && k < sh.R; k += SDM_DECODE_WARPS) { // (5) read after the write
        SdmBankVec<Tb>::load(M + (size_t)in.rslot[orr + k] * sh.d + col, x);
        float g = in.rho[orr + k];
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
    sdm_decode_sum_warps<V>(part, r);
    if (active && w == 0)
        for (int i = 0; i < V; i += 4) SdmBankVec<float>::store(out + (size_t)s * sh.d + col + i, r + i);
}

static void sdm_op_decode(const SdmOpShape *s, const SdmOpInputs *in, void *bank, float *out, cudaStream_t stream) {
    sdm_op_require(s);
    if (s->T != 1) sdm_die("sdm_op_decode: T must be 1 (got %d)", s->T);
    dim3 block(32 * SDM_DECODE_WARPS);
    if (s->bank_fp32)
        launch_pdl(sdm_decode_kernel<float>, dim3(ceil_div(s->d, 32 * 4), s->B * s->H), block, 0, stream, *s, *in,
                   (float *)bank, out);
    else
        launch_pdl(sdm_decode_kernel<__nv_bfloat16>, dim3(ceil_div(s->d, 32 * 8), s->B * s->H), block, 0, stream, *s,
                   *in, (__nv_bfloat16 *)bank, out);
}

#endif
