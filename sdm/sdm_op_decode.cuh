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
// sums meet in shared memory; each column's are added by one thread in warp order (deterministic), the delta formed
// there. The W slots of a token are distinct, so the warps' writes never touch a row twice.
// Latency: every warp loads the stream's first WARPS * HELD write and read entries (slot, weight, decay), a lane each,
// with beta and the values in the same round trip, takes its held ones by shuffles and loads all their rows at
// once, before any write, and keeps them (16 bytes a lane each): the write reuses the retrieved row, and a read of a
// row this token writes takes the written value from the row it read and delta, rounded to the bank dtype as the
// store rounds it: the bits of reading it back after the write, without waiting for the write. So one step costs
// two dependent memory latencies (entries, then rows; the decode step's top-k has started the rows into L2).
// Entries beyond the held ones (W or R above WARPS * HELD) load their rows in turn, reads after a barrier.
#define SDM_DECODE_WARPS 16
#define SDM_DECODE_HELD 4

// Shared memory of the decode kernel: every warp's partial sums, column-major per warp so that both the lanes'
// stores and the column sums' loads are conflict-free (column l V + i of the block at [i][l]), and delta.
template <int V> struct SdmDecodeSmem {
    float part[SDM_DECODE_WARPS][V][32];
    float delta[V][32];
};

// The sum over the block's warps of each warp's x (V columns a lane), in warp order, by one thread a column: thread
// t < 32 V gets column (t % 32) V + t / 32 of the block; the other threads get 0.
template <int V> __device__ __forceinline__ float sdm_decode_column_sum(SdmDecodeSmem<V> &sm, const float *x) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, t = threadIdx.x;
    for (int i = 0; i < V; i++) sm.part[w][i][lane] = x[i];
    __syncthreads();
    float r = 0.f;
    if (t < 32 * V)
        for (int j = 0; j < SDM_DECODE_WARPS; j++) r += sm.part[j][t >> 5][t & 31];
    return r;
}

// Step (4)'s new value of a bank row x (V values) with decay a = exp(gamma), weight kp and delta, as stored.
template <typename Tb>
__device__ __forceinline__ uint4 sdm_decode_written(uint4 x, float a, float kp, const float *delta) {
    constexpr int V = SdmBankVec<Tb>::V;
    float y[V];
    SdmBankVec<Tb>::unpack(x, y);
    for (int i = 0; i < V; i++) y[i] = fmaf(a, y[i], kp * delta[i]);
    return SdmBankVec<Tb>::pack(y);
}

// x[c] (c < C, unrolled) for c == sel: a held entry's list register, before the shuffle from its lane.
template <int C, typename T> __device__ __forceinline__ T sdm_decode_pick(const T *x, int sel) {
    T v = x[0];
#pragma unroll
    for (int c = 1; c < C; c++)
        if (c == sel) v = x[c];
    return v;
}

template <typename Tb>
__global__ void __launch_bounds__(32 * SDM_DECODE_WARPS) sdm_decode_kernel(SdmOpShape sh, SdmOpInputs in, Tb *bank,
                                                                          float *out) {
    constexpr int V = SdmBankVec<Tb>::V, E = SDM_DECODE_HELD, NW = SDM_DECODE_WARPS, C = NW * E / 32;
    static_assert(NW * E % 32 == 0, "held entries fill whole lists of 32");
    __shared__ SdmDecodeSmem<V> sm;
    pdl_enter();
    const int s = blockIdx.y, w = threadIdx.x >> 5, lane = threadIdx.x & 31, col = (blockIdx.x * 32 + lane) * V;
    const int t = threadIdx.x, tcol = blockIdx.x * 32 * V + (t & 31) * V + (t >> 5); // thread t's column of the sums
    const bool active = col < sh.d; // inactive lanes still meet the barriers and ballots
    Tb *M = bank + (size_t)s * sh.N * sh.d + col;
    const int *wslot = in.wslot + (size_t)s * sh.W, *rslot = in.rslot + (size_t)s * sh.R;
    const float *kappa = in.kappa + (size_t)s * sh.W, *gamma = in.gamma + (size_t)s * sh.W;
    const float *rho = in.rho + (size_t)s * sh.R;
    // one round trip: entries k = 32 c + lane (c < C) of both lists, beta and the value of the column this thread sums
    int wl[C], rl[C];
    float kl[C], al[C], rhl[C];
#pragma unroll
    for (int c = 0; c < C; c++) {
        int k = 32 * c + lane;
        wl[c] = k < sh.W ? wslot[k] : -1;
        kl[c] = k < sh.W ? kappa[k] : 0.f;
        al[c] = k < sh.W ? gamma[k] : 0.f;
        rl[c] = k < sh.R ? rslot[k] : -1;
        rhl[c] = k < sh.R ? rho[k] : 0.f;
    }
    const float bt = in.beta[s], vt = t < 32 * V && tcol < sh.d ? in.v[(size_t)s * sh.d + tcol] : 0.f;
#pragma unroll
    for (int c = 0; c < C; c++) al[c] = expf(al[c]); // the decay a = exp(gamma)
    // the held entries k = w + NW m (m < E) from their lanes, then every held row at once (all before any write; a
    // prefetch holds no register: short of them, the compiler may issue the read rows' loads only after the retrieval)
    int ws[E], rs[E];
    float wa[E], wk[E], rw[E];
    uint4 xw[E], xr[E];
#pragma unroll
    for (int m = 0; m < E; m++) {
        int k = w + NW * m, c = k >> 5;
        ws[m] = __shfl_sync(0xffffffffu, sdm_decode_pick<C>(wl, c), k & 31);
        wk[m] = __shfl_sync(0xffffffffu, sdm_decode_pick<C>(kl, c), k & 31);
        wa[m] = __shfl_sync(0xffffffffu, sdm_decode_pick<C>(al, c), k & 31);
        rs[m] = __shfl_sync(0xffffffffu, sdm_decode_pick<C>(rl, c), k & 31);
        rw[m] = __shfl_sync(0xffffffffu, sdm_decode_pick<C>(rhl, c), k & 31);
    }
#pragma unroll
    for (int m = 0; m < E; m++) {
        int k = w + NW * m;
        if (active && k < sh.W) core_prefetch_l2(M + (size_t)ws[m] * sh.d);
        if (active && k < sh.R) core_prefetch_l2(M + (size_t)rs[m] * sh.d);
    }
#pragma unroll
    for (int m = 0; m < E; m++) {
        int k = w + NW * m;
        if (active && k < sh.W) xw[m] = *(const uint4 *)(M + (size_t)ws[m] * sh.d);
        if (active && k < sh.R) xr[m] = *(const uint4 *)(M + (size_t)rs[m] * sh.d);
    }
    // while the rows arrive: the write entry (decay, weight) of each held read row that this token writes (slots are
    // distinct: one at most)
    bool hit[E];
    float ha[E], hk[E];
#pragma unroll
    for (int m = 0; m < E; m++) { hit[m] = false; ha[m] = hk[m] = 0.f; }
    auto match = [&](int sl, float a, float kp) {
#pragma unroll
        for (int m = 0; m < E; m++) {
            unsigned b = __ballot_sync(0xffffffffu, w + NW * m < sh.R && sl == rs[m]);
            if (b) {
                hit[m] = true;
                ha[m] = __shfl_sync(0xffffffffu, a, __ffs(b) - 1);
                hk[m] = __shfl_sync(0xffffffffu, kp, __ffs(b) - 1);
            }
        }
    };
#pragma unroll
    for (int c = 0; c < C; c++) match(wl[c], al[c], kl[c]);
    for (int i0 = 32 * C; i0 < sh.W; i0 += 32) {
        int k = i0 + lane;
        match(k < sh.W ? wslot[k] : -1, k < sh.W ? expf(gamma[k]) : 0.f, k < sh.W ? kappa[k] : 0.f);
    }
    float r[V], x[V];
    for (int i = 0; i < V; i++) r[i] = 0.f;
#pragma unroll
    for (int m = 0; m < E; m++) { // (1)-(2): retrieval from the decayed rows
        int k = w + NW * m;
        if (!active || k >= sh.W) break;
        SdmBankVec<Tb>::unpack(xw[m], x);
        float g = wk[m] * wa[m];
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
#pragma unroll 4
    for (int k = w + NW * E; active && k < sh.W; k += NW) {
        SdmBankVec<Tb>::load(M + (size_t)wslot[k] * sh.d, x);
        float g = kappa[k] * expf(gamma[k]);
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
    // (3) delta = beta (v - retrieved), formed by the thread that sums its column
    float rt = sdm_decode_column_sum<V>(sm, r);
    if (t < 32 * V) sm.delta[t >> 5][t & 31] = bt * (vt - rt);
    __syncthreads();
    for (int i = 0; i < V; i++) r[i] = sm.delta[i][lane]; // r now holds delta
#pragma unroll
    for (int m = 0; m < E; m++) { // (4) write
        int k = w + NW * m;
        if (!active || k >= sh.W) break;
        *(uint4 *)(M + (size_t)ws[m] * sh.d) = sdm_decode_written<Tb>(xw[m], wa[m], wk[m], r);
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
        uint4 row = hit[m] ? sdm_decode_written<Tb>(xr[m], ha[m], hk[m], r) : xr[m];
        SdmBankVec<Tb>::unpack(row, x);
        for (int i = 0; i < V; i++) o[i] = fmaf(rw[m], x[i], o[i]);
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
    float ot = sdm_decode_column_sum<V>(sm, o); // sm.part is free: its last readers passed the barrier above
    if (t < 32 * V && tcol < sh.d) out[(size_t)s * sh.d + tcol] = ot;
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
