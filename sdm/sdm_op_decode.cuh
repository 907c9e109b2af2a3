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
// the warps' writes never touch a row twice.
// Latency: each warp loads the indices and weights of its first SDM_DECODE_HELD write and read entries, then all
// their rows at once, before any write, and keeps them (16 bytes a lane each): the write reuses the retrieved row,
// and a read of a row this token writes takes the written value from the row it read and delta, rounded to the
// bank dtype as the store rounds it: the bits of reading it back after the write, without waiting for the write.
// So one step costs two dependent memory latencies (indices, then rows) where a load after each phase cost five.
// Entries beyond the held ones (W or R above WARPS * HELD) load their rows in turn, reads after a barrier.
#define SDM_DECODE_WARPS 16
#define SDM_DECODE_HELD 4

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

__device__ __forceinline__ void sdm_prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Step (4)'s new value of a bank row x (V values) with decay a = exp(gamma), weight kp and delta, as stored.
template <typename Tb>
__device__ __forceinline__ uint4 sdm_decode_written(uint4 x, float a, float kp, const float *delta) {
    constexpr int V = SdmBankVec<Tb>::V;
    float y[V];
    SdmBankVec<Tb>::unpack(x, y);
    for (int i = 0; i < V; i++) y[i] = fmaf(a, y[i], kp * delta[i]);
    return SdmBankVec<Tb>::pack(y);
}

template <typename Tb>
__global__ void __launch_bounds__(32 * SDM_DECODE_WARPS) sdm_decode_kernel(SdmOpShape sh, SdmOpInputs in, Tb *bank,
                                                                          float *out) {
    constexpr int V = SdmBankVec<Tb>::V, E = SDM_DECODE_HELD, NW = SDM_DECODE_WARPS;
    __shared__ float part[NW][32 * V];
    pdl_enter();
    const int s = blockIdx.y, w = threadIdx.x >> 5, lane = threadIdx.x & 31, col = (blockIdx.x * 32 + lane) * V;
    const bool active = col < sh.d; // inactive lanes still meet the barriers and ballots
    Tb *M = bank + (size_t)s * sh.N * sh.d + col;
    const int *wslot = in.wslot + (size_t)s * sh.W, *rslot = in.rslot + (size_t)s * sh.R;
    const float *kappa = in.kappa + (size_t)s * sh.W, *gamma = in.gamma + (size_t)s * sh.W;
    const float *rho = in.rho + (size_t)s * sh.R;
    // the held entries k = w + NW m (m < E): slots, then every row at once (all before any write)
    int ws[E], rs[E];
    uint4 xw[E], xr[E];
#pragma unroll
    for (int m = 0; m < E; m++) {
        int k = w + NW * m;
        ws[m] = k < sh.W ? wslot[k] : 0;
        rs[m] = k < sh.R ? rslot[k] : 0;
    }
    // every held row on its way to L2 now (a prefetch holds no register: short of them, the compiler issues the read
    // rows' loads only after the retrieval, where a random bank row's latency cost ~5,000 cycles on an H200)
#pragma unroll
    for (int m = 0; m < E; m++) {
        int k = w + NW * m;
        if (active && k < sh.W) sdm_prefetch_l2(M + (size_t)ws[m] * sh.d);
        if (active && k < sh.R) sdm_prefetch_l2(M + (size_t)rs[m] * sh.d);
    }
#pragma unroll
    for (int m = 0; m < E; m++) {
        int k = w + NW * m;
        if (active && k < sh.W) xw[m] = *(const uint4 *)(M + (size_t)ws[m] * sh.d);
        if (active && k < sh.R) xr[m] = *(const uint4 *)(M + (size_t)rs[m] * sh.d);
    }
    // while the rows arrive: beta, the values, and the write entry of each held read row that this token writes
    // (slots are distinct: one at most)
    float bt = in.beta[s], vv[V];
    for (int i = 0; i < V; i++) vv[i] = active ? in.v[(size_t)s * sh.d + col + i] : 0.f;
    int hit[E];
#pragma unroll
    for (int m = 0; m < E; m++) hit[m] = -1;
    for (int i0 = 0; i0 < sh.W; i0 += 32) {
        int sl = i0 + lane < sh.W ? wslot[i0 + lane] : -1;
#pragma unroll
        for (int m = 0; m < E; m++) {
            unsigned b = __ballot_sync(0xffffffffu, w + NW * m < sh.R && sl == rs[m]);
            if (b) hit[m] = i0 + __ffs(b) - 1;
        }
    }
    float r[V], x[V];
    for (int i = 0; i < V; i++) r[i] = 0.f;
#pragma unroll
    for (int m = 0; m < E; m++) { // (1)-(2): retrieval from the decayed rows
        int k = w + NW * m;
        if (!active || k >= sh.W) break;
        SdmBankVec<Tb>::unpack(xw[m], x);
        float g = kappa[k] * expf(gamma[k]);
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
#pragma unroll 4
    for (int k = w + NW * E; active && k < sh.W; k += NW) {
        SdmBankVec<Tb>::load(M + (size_t)wslot[k] * sh.d, x);
        float g = kappa[k] * expf(gamma[k]);
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
    sdm_decode_sum_warps<V>(part, r);
    for (int i = 0; i < V; i++) r[i] = bt * (vv[i] - r[i]); // (3) r now holds delta
#pragma unroll
    for (int m = 0; m < E; m++) { // (4) write
        int k = w + NW * m;
        if (!active || k >= sh.W) break;
        *(uint4 *)(M + (size_t)ws[m] * sh.d) = sdm_decode_written<Tb>(xw[m], expf(gamma[k]), kappa[k], r);
    }
#pragma unroll 4
    for (int k = w + NW * E; active && k < sh.W; k += NW) {
        Tb *row = M + (size_t)wslot[k] * sh.d;
        *(uint4 *)row = sdm_decode_written<Tb>(*(const uint4 *)row, expf(gamma[k]), kappa[k], r);
    }
    // (5) read after the write: a held row that this token writes takes its written value
    float o[V];
    for (int i = 0; i < V; i++) o[i] = 0.f;
#pragma unroll
    for (int m = 0; m < E; m++) {
        int k = w + NW * m;
        if (!active || k >= sh.R) break;
        uint4 row = hit[m] < 0 ? xr[m] : sdm_decode_written<Tb>(xr[m], expf(gamma[hit[m]]), kappa[hit[m]], r);
        SdmBankVec<Tb>::unpack(row, x);
        float g = rho[k];
        for (int i = 0; i < V; i++) o[i] = fmaf(g, x[i], o[i]);
    }
    if (sh.R > NW * E) {
        __syncthreads(); // every write lands before the rows read from memory
#pragma unroll 4
        for (int k = w + NW * E; active && k < sh.R; k += NW) {
            SdmBankVec<Tb>::load(M + (size_t)rslot[k] * sh.d, x);
            float g = rho[k];
            for (int i = 0; i < V; i++) o[i] = fmaf(g, x[i], o[i]);
        }
    }
    sdm_decode_sum_warps<V>(part, o);
    if (active && w == 0)
        for (int i = 0; i < V; i += 4) SdmBankVec<float>::store(out + (size_t)s * sh.d + col + i, o + i);
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
