// sdm/sdm_layer.cuh: the SDM layer on the GPU around the memory op (docs/SDM.md#layer-overview): the fused input
// projection, gates, product-key top-k with the softmax weights, key-weighted decay, the readout (LayerNorm,
// output gate, output projection), the bank copy from M0 and the dM0 batch sum, and the layer forward/backward.
// Layout follows sdm/sdm_ref.h and sdm/sdm_op.h: token-major [B,T,H,...] per-token per-head arrays; a "problem"
// p = token*H + h is one token and head. Precision: parameters, activations and matmul inputs in the layer's
// compute dtype (bf16, or fp32 for the all-fp32 test mode); gates, weights, scores, LayerNorm statistics, the op's
// inputs/outputs and every parameter gradient in fp32. No floating-point atomics anywhere.
#ifndef SDM_SDM_LAYER_CUH
#define SDM_SDM_LAYER_CUH

#include "core/cuda_common.cuh"
#include "core/matmul.cuh"
#include "sdm/sdm_dims.h"
#include "sdm/sdm_op.cuh"

#define SL_FULL_MASK 0xffffffffu

// ---- small device helpers ----------------------------------------------------------------------------------------

__device__ __forceinline__ float sl_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float sl_softplus(float x) { return x > 0.0f ? x + log1pf(expf(-x)) : log1pf(expf(x)); }

__device__ __forceinline__ float sl_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SL_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float sl_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(SL_FULL_MASK, v, o));
    return v;
}

// Order-preserving map float32 -> uint32 (a < b  <=>  ord(a) < ord(b)); -0 maps like +0 since the CPU reference
// compares floats, for which the two are a tie. ord(-inf) = 0x007fffff > 0, so 0 can mean "no candidate".
__device__ __forceinline__ uint32_t sl_f2ord(float v) {
    if (v == 0.0f) v = 0.0f;
    uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float sl_ord2f(uint32_t o) {
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// =================================================================================================================
// Product-key top-k (docs/SDM.md#tie-rule), the selection of sdm_pk_topk_ref:
//   slot score = float32 sum of its factor scores, left to right ((s1 + s2) + s3) ...; ties between equal float32
//   scores go to the larger sum of sub-key indices, then the larger slot index; each factor keeps only its best
//   min(k, n_f) sub-keys plus every sub-key tied with the last kept one, and the k best tuples of kept sub-keys win.
// Method, one warp per problem: sort each factor's scores descending. Over positions in the sorted lists the score
// never increases along any axis, so the grid points scoring >= any value form a down-set, and a down-set of size m
// lies inside R_m = {positions p : prod_f (p_f + 1) <= m}. Scoring the fixed table R_cap (cap = 2k) gives the
// k-th largest score tau exactly (a down-set of size k lies in R_k, inside R_cap); if fewer than cap table points
// score >= tau, all grid points scoring >= tau are in the table and the k best of them by the full order are the
// answer. Otherwise (many exact ties at tau) the warp searches the whole kept grid instead (slow, rare).
// Keys: 64 bits, high word ord(score), low word digit_sum * N + slot: the k largest keys are the k selected slots.
// With F >= 3 the CPU keeps only k partial tuples after each merge; the two agree unless float32 rounding makes
// two different partial sums tie after the next addition.
// =================================================================================================================

#define TOPK_WARPS_MAX 4

typedef struct {
    int F, dims[SDM_MAX_FACTORS], N, key_dim; // factor widths (first factor most significant), N = prod, K = sum
    int k, cap;                               // slots selected per problem; table bound min(2k, 256)
    int n_table;                              // |R_cap| (positions clipped to the factor widths)
    uint32_t *table;                          // device [n_table]: positions, one byte per factor (factor f at 8f)
    int sort_len[SDM_MAX_FACTORS];            // per-factor sort length (next power of two >= n_f)
    int sort_total;                           // sum of sort_len
    int sort_max;                             // max of sort_len (raw-score staging buffer)
    size_t smem_per_warp;                     // shared memory per warp (bytes)
    int warps;                                // problems per block
} TopkPlan;

static inline int next_pow2(int n) { int p = 1; while (p < n) p <<= 1; return p; }

// Visits every position p (p_f < dims[f]) with prod(p_f + 1) <= cap; stores them when out != NULL; returns count.
static inline int topk_table_fill(const int *dims, int F, int f, int prod, uint32_t packed, int cap, uint32_t *out,
                                  int n) {
    if (f == F) {
        if (out) out[n] = packed;
        return n + 1;
    }
    for (int p = 0; p < dims[f] && prod * (p + 1) <= cap; p++)
        n = topk_table_fill(dims, F, f + 1, prod * (p + 1), packed | ((uint32_t)p << (8 * f)), cap, out, n);
    return n;
}

static inline TopkPlan topk_plan_make(const SdmDims *s, int k) {
    TopkPlan pl;
    memset(&pl, 0, sizeof(pl));
    pl.F = s->n_factors;
    if (pl.F < 1 || pl.F > SDM_MAX_FACTORS) sdm_die("top-k: %d factors not supported (1..%d)", pl.F, SDM_MAX_FACTORS);
    pl.N = 1;
    for (int f = 0; f < pl.F; f++) {
        pl.dims[f] = s->factor_dims[f];
        pl.N *= pl.dims[f];
        pl.key_dim += pl.dims[f];
        pl.sort_len[f] = next_pow2(pl.dims[f]);
        pl.sort_total += pl.sort_len[f];
        pl.sort_max = SDM_MAX(pl.sort_max, pl.sort_len[f]);
    }
    pl.k = k;
    pl.cap = SDM_MIN(2 * k, 256);
    if (k < 1 || k > pl.N) sdm_die("top-k: k = %d outside [1, N = %d]", k, pl.N);
    if (k >= 256) sdm_die("top-k: the GPU top-k supports k < 256 (got %d)", k);
    if (((double)pl.key_dim + 1.0) * pl.N >= 4294967296.0)
        sdm_die("top-k: (sum of factor widths + 1) * N must stay below 2^32 (tie-break key)");
    pl.n_table = topk_table_fill(pl.dims, pl.F, 0, 1, 0u, pl.cap, NULL, 0);
    uint32_t *tab = (uint32_t *)sdm_malloc(sizeof(uint32_t) * (size_t)pl.n_table);
    topk_table_fill(pl.dims, pl.F, 0, 1, 0u, pl.cap, tab, 0);
    cudaCheck(cudaMalloc(&pl.table, sizeof(uint32_t) * (size_t)pl.n_table));
    cudaCheck(cudaMemcpy(pl.table, tab, sizeof(uint32_t) * (size_t)pl.n_table, cudaMemcpyHostToDevice));
    free(tab);
    // sorted kept factor keys, raw factor keys, candidates, selected keys (u64), table scores, histogram (u32)
    pl.smem_per_warp = 8 * ((size_t)pl.sort_total + pl.sort_max + pl.cap + k) + 4 * ((size_t)pl.n_table + 256);
    pl.smem_per_warp = (pl.smem_per_warp + 15) & ~(size_t)15;
    if (pl.smem_per_warp > 200 * 1024)
        sdm_die("top-k: factor widths too large for shared memory (%zu bytes per problem)", pl.smem_per_warp);
    pl.warps = (int)SDM_MAX(1, SDM_MIN(TOPK_WARPS_MAX, (96 * 1024) / pl.smem_per_warp));
    return pl;
}

static inline void topk_plan_free(TopkPlan *pl) {
    cudaCheck(cudaFree(pl->table));
    pl->table = NULL;
}

// Descending bitonic sort of a[0..n) (n a power of two) by one warp in shared memory.
__device__ void warp_bitonic_sort_desc(unsigned long long *a, int n, int lane) {
    for (int size = 2; size <= n; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = lane; i < (n >> 1); i += 32) {
                int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                bool desc = (lo & size) == 0;
                unsigned long long x = a[lo], y = a[hi];
                if ((x < y) == desc) { a[lo] = y; a[hi] = x; }
            }
            __syncwarp();
        }
}

// The k-th largest (with multiplicity) of v[i * stride], i < n, by one warp: radix select on 8-bit digits from the
// top, with a 256-bin histogram in shared memory (integer counts: order-independent, deterministic).
__device__ uint32_t warp_kth_largest(const uint32_t *v, int stride, int n, int k, int *hist, int lane) {
    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = lane; i < 256; i += 32) hist[i] = 0;
        __syncwarp();
        for (int i = lane; i < n; i += 32) {
            uint32_t x = v[(size_t)i * stride];
            if ((x & mask) == prefix) atomicAdd(&hist[(x >> shift) & 255u], 1);
        }
        __syncwarp();
        // lane L owns digits 255 - 8L - j (j = 0..7): lanes in descending digit order
        int c[8], own = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) { c[j] = hist[255 - 8 * lane - j]; own += c[j]; }
        int incl = own;
        for (int o = 1; o < 32; o <<= 1) {
            int t = __shfl_up_sync(SL_FULL_MASK, incl, o);
            if (lane >= o) incl += t;
        }
        int excl = incl - own;
        int src = __ffs(__ballot_sync(SL_FULL_MASK, excl < k && k <= incl)) - 1;
        int digit = 0, above = 0, acc = excl;
        bool found = false;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (!found && acc + c[j] >= k) { digit = 255 - 8 * lane - j; above = acc; found = true; }
            acc += c[j];
        }
        digit = __shfl_sync(SL_FULL_MASK, digit, src);
        above = __shfl_sync(SL_FULL_MASK, above, src);
        prefix |= (uint32_t)digit << shift;
        mask |= 255u << shift;
        k -= above;
        __syncwarp();
    }
    return prefix;
}

// Key of the grid point with sorted positions pos[f]: ord(float32 score) << 32 | (digit_sum * N + slot).
__device__ __forceinline__ unsigned long long grid_key(const TopkPlan &pl, const unsigned long long *sorted,
                                                       const int *pos) {
    float v = 0.0f;
    uint32_t dsum = 0, slot = 0;
    int soff = 0;
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++)
        if (f < pl.F) {
            unsigned long long e = sorted[soff + pos[f]];
            float s = sl_ord2f((uint32_t)(e >> 32));
            uint32_t idx = (uint32_t)e;
            v = f == 0 ? s : v + s;
            dsum += idx;
            slot = slot * (uint32_t)pl.dims[f] + idx;
            soff += pl.sort_len[f];
        }
    return ((unsigned long long)sl_f2ord(v) << 32) | (dsum * (uint32_t)pl.N + slot);
}

// Largest 64-bit threshold x with #(keys >= x) >= k over the whole kept grid (G points), by bisection on the bits.
__device__ unsigned long long grid_kth_key(const TopkPlan &pl, const unsigned long long *sorted, const int *m,
                                           unsigned long long G, int lane) {
    unsigned long long x = 0;
    for (int bit = 63; bit >= 0; bit--) {
        unsigned long long c = x | (1ull << bit);
        int cnt = 0;
        for (unsigned long long g = lane; g < G; g += 32) {
            int pos[SDM_MAX_FACTORS];
            unsigned long long r = g;
#pragma unroll
            for (int f = SDM_MAX_FACTORS - 1; f >= 0; f--)
                if (f < pl.F) { pos[f] = (int)(r % (unsigned)m[f]); r /= (unsigned)m[f]; }
            cnt += grid_key(pl, sorted, pos) >= c;
        }
        if (__reduce_add_sync(SL_FULL_MASK, cnt) >= pl.k) x = c;
    }
    return x;
}

// One warp per problem p = token*H + h: scores are z[token*ldz + col0 + h*K + (factor blocks)].
// Outputs per problem, sorted by ascending slot: slot [P,k], weight [P,k] = softmax(scale * score),
// score [P,k] (float32 slot score, may be NULL), gamma [P,k] (may be NULL: writes only): g[p] * weight
// (key_weighted_decay) or g[p].
__global__ void topk_forward_kernel(TopkPlan pl, const void *z, bool fp32, int ldz, int col0, int H, int P,
                                    float scale, const float *g, int kwd, int *slot_out, float *weight_out,
                                    float *score_out, float *gamma_out) {
    extern __shared__ unsigned char topk_smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.x * pl.warps + warp;
    if (p >= P) return;
    unsigned long long *sorted = (unsigned long long *)(topk_smem + warp * pl.smem_per_warp);
    unsigned long long *raw = sorted + pl.sort_total, *cand = raw + pl.sort_max, *sel = cand + pl.cap;
    uint32_t *rval = (uint32_t *)(sel + pl.k);
    int *hist = (int *)(rval + pl.n_table);
    const int k = pl.k;
    size_t zrow = (size_t)(p / H) * ldz + col0 + (size_t)(p % H) * pl.key_dim;

    // 1. per factor: the kept sub-keys (score >= the min(k, n_f)-th largest, so every tie of the last one stays),
    //    then sorted descending (ties: larger sub-key index first). Keys: ord(score) << 32 | sub-key index.
    int m[SDM_MAX_FACTORS];
    unsigned long long G = 1;
    for (int f = 0, off = 0, soff = 0; f < pl.F; off += pl.dims[f], soff += pl.sort_len[f], f++) {
        int n = pl.dims[f];
        for (int i = lane; i < n; i += 32)
            raw[i] = ((unsigned long long)sl_f2ord(load_act(z, zrow + off + i, fp32)) << 32) | (uint32_t)i;
        __syncwarp();
        // the high words of the little-endian keys are the scores
        uint32_t t = warp_kth_largest((const uint32_t *)raw + 1, 2, n, min(k, n), hist, lane);
        int cnt = 0;
        for (int base = 0; base < n; base += 32) {
            int i = base + lane;
            bool keep = i < n && (uint32_t)(raw[i] >> 32) >= t;
            unsigned b = __ballot_sync(SL_FULL_MASK, keep);
            if (keep) sorted[soff + cnt + __popc(b & ((1u << lane) - 1))] = raw[i];
            cnt += __popc(b);
        }
        int len = 1;
        while (len < cnt) len <<= 1;
        for (int i = cnt + lane; i < len; i += 32) sorted[soff + i] = 0ull;
        __syncwarp();
        warp_bitonic_sort_desc(sorted + soff, len, lane);
        m[f] = cnt;
        G *= (unsigned long long)cnt;
    }
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++)
        if (f >= pl.F) m[f] = 1;

    // 2. score the table points inside the kept grid (0 = outside)
    for (int r = lane; r < pl.n_table; r += 32) {
        uint32_t pk = pl.table[r];
        int pos[SDM_MAX_FACTORS];
        bool in = true;
#pragma unroll
        for (int f = 0; f < SDM_MAX_FACTORS; f++) {
            pos[f] = (int)((pk >> (8 * f)) & 255u);
            if (f < pl.F && pos[f] >= m[f]) in = false;
        }
        rval[r] = in ? (uint32_t)(grid_key(pl, sorted, pos) >> 32) : 0u;
    }
    __syncwarp();

    // 3. tau = the k-th largest table score
    uint32_t tau = warp_kth_largest(rval, 1, pl.n_table, k, hist, lane);
    int n_ge = 0;
    for (int r = lane; r < pl.n_table; r += 32) n_ge += rval[r] >= tau;
    n_ge = __reduce_add_sync(SL_FULL_MASK, n_ge);

    if (n_ge < pl.cap || G <= (unsigned long long)pl.cap) {
        // 4a. the candidates (all grid points scoring >= tau) in table order, then the k best by rank
        int n_c = 0;
        for (int base = 0; base < pl.n_table; base += 32) {
            int r = base + lane;
            bool take = r < pl.n_table && rval[r] >= tau;
            unsigned b = __ballot_sync(SL_FULL_MASK, take);
            if (take) {
                uint32_t pk = pl.table[r];
                int pos[SDM_MAX_FACTORS];
#pragma unroll
                for (int f = 0; f < SDM_MAX_FACTORS; f++) pos[f] = (int)((pk >> (8 * f)) & 255u);
                cand[n_c + __popc(b & ((1u << lane) - 1))] = grid_key(pl, sorted, pos);
            }
            n_c += __popc(b);
        }
        __syncwarp();
        for (int c = lane; c < n_c; c += 32) {
            unsigned long long key = cand[c];
            int rank = 0;
            for (int j = 0; j < n_c; j++) rank += cand[j] > key;
            if (rank < k) sel[rank] = key;
        }
    } else {
        // 4b. heavy ties: exact threshold over the whole kept grid, then collect the k keys above it
        unsigned long long x = grid_kth_key(pl, sorted, m, G, lane);
        int n_c = 0;
        for (unsigned long long base = 0; base < G; base += 32) {
            unsigned long long gi = base + lane;
            unsigned long long key = 0;
            if (gi < G) {
                int pos[SDM_MAX_FACTORS];
                unsigned long long r = gi;
#pragma unroll
                for (int f = SDM_MAX_FACTORS - 1; f >= 0; f--)
                    if (f < pl.F) { pos[f] = (int)(r % (unsigned)m[f]); r /= (unsigned)m[f]; }
                key = grid_key(pl, sorted, pos);
            }
            bool take = gi < G && key >= x;
            unsigned b = __ballot_sync(SL_FULL_MASK, take);
            if (take) sel[n_c + __popc(b & ((1u << lane) - 1))] = key;
            n_c += __popc(b);
        }
    }
    __syncwarp();

    // 5. order by ascending slot, softmax over the k scores, write out
    float mx = -INFINITY;
    for (int j = lane; j < k; j += 32) mx = fmaxf(mx, sl_ord2f((uint32_t)(sel[j] >> 32)));
    mx = sl_warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j < k; j += 32) sum += expf(scale * (sl_ord2f((uint32_t)(sel[j] >> 32)) - mx));
    sum = sl_warp_sum(sum);
    int *sel_slot = (int *)rval; // the table scores are no longer needed
    for (int j = lane; j < k; j += 32) sel_slot[j] = (int)((uint32_t)sel[j] % (uint32_t)pl.N);
    __syncwarp();
    for (int j = lane; j < k; j += 32) {
        int slot = sel_slot[j];
        int pos = 0;
        for (int i = 0; i < k; i++) pos += sel_slot[i] < slot;
        float e = sl_ord2f((uint32_t)(sel[j] >> 32));
        float w = expf(scale * (e - mx)) / sum;
        size_t o = (size_t)p * k + pos;
        slot_out[o] = (int)slot;
        weight_out[o] = w;
        if (score_out) score_out[o] = e;
        if (gamma_out) gamma_out[o] = kwd ? g[p] * w : g[p];
    }
}

static inline void topk_forward(const TopkPlan *pl, const void *z, bool fp32, int ldz, int col0, int H, int P,
                                float scale, const float *g, int kwd, int *slot, float *weight, float *score,
                                float *gamma, cudaStream_t s) {
    size_t smem = pl->smem_per_warp * pl->warps;
    if (smem > 48 * 1024)
        cudaCheck(cudaFuncSetAttribute(topk_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    topk_forward_kernel<<<ceil_div(P, pl->warps), 32 * pl->warps, smem, s>>>(*pl, z, fp32, ldz, col0, H, P, scale, g,
                                                                             kwd, slot, weight, score, gamma);
    cudaCheckLast();
}

// =================================================================================================================
// Addressing backward, one warp per problem: the softmax backward de = scale * w * (dw - <w, dw>), then the
// routing of each selected score's gradient to its F sub-key entries (docs/SDM.md#product-key-addressing) in a fixed order (lane f adds
// factor f's entries for j = 0..k-1), written as the full K-wide block of dz (zeros where nothing was selected).
// For writes (gates != 0) it also chains key-weighted decay and the gates (docs/SDM.md#layer-chain-rule):
//   dw_j = dkappa_j + (kwd ? g dgamma_j : 0),  dg = sum_j (kwd ? kappa_j dgamma_j : dgamma_j),
//   da = dg * (-exp(A_log) sigmoid(a + dt_bias)) -> dz[col_a + h],  dc = dbeta beta (1 - beta) -> dz[col_c + h],
//   gate_grad[token, :] = (da [H], dc [H], dg * g [H]) in fp32, so that the sums over tokens giving d ba, d bb,
//   d dt_bias and d A_log never see bf16-rounded terms (they can cancel strongly).
// =================================================================================================================

typedef struct {
    const void *z;                          // the forward projections [tokens, ldz] (for a)
    const float *dgamma, *g, *beta, *dbeta; // [P,k], [P], [P], [P]
    const void *A_log, *dt_bias;            // [H] compute dtype
    int kwd, col_a, col_c;
    float *gate_grad;                       // [tokens, 3H]
} WriteGateArgs;

__global__ void address_backward_kernel(TopkPlan pl, const int *slot, const float *w, const float *dw, float scale,
                                        int P, int H, void *dz, bool fp32, int ldz, int col0, int gates,
                                        WriteGateArgs ga) {
    extern __shared__ float addr_smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.x * (blockDim.x >> 5) + warp;
    if (p >= P) return;
    const int k = pl.k, K = pl.key_dim;
    float *acc = addr_smem + warp * (K + k), *de = acc + K;
    size_t base = (size_t)p * k;
    float gp = gates ? ga.g[p] : 0.0f;
    float wdw = 0.0f, dg = 0.0f;
    for (int j = lane; j < k; j += 32) {
        float dwj = dw[base + j];
        if (gates) {
            float dgam = ga.dgamma[base + j];
            if (ga.kwd) { dwj += gp * dgam; dg += w[base + j] * dgam; }
            else dg += dgam;
        }
        de[j] = dwj;
        wdw += w[base + j] * dwj;
    }
    wdw = sl_warp_sum(wdw);
    for (int j = lane; j < k; j += 32) de[j] = scale * w[base + j] * (de[j] - wdw);
    for (int i = lane; i < K; i += 32) acc[i] = 0.0f;
    __syncwarp();
    if (lane < pl.F) {
        int off = 0, stride = 1;
        for (int f = 0; f < lane; f++) off += pl.dims[f];
        for (int f = pl.F - 1; f > lane; f--) stride *= pl.dims[f];
        for (int j = 0; j < k; j++) acc[off + (slot[base + j] / stride) % pl.dims[lane]] += de[j];
    }
    __syncwarp();
    size_t zrow = (size_t)(p / H) * ldz;
    int h = p % H;
    for (int i = lane; i < K; i += 32) store_act(dz, zrow + col0 + (size_t)h * K + i, acc[i], fp32);
    if (gates) {
        dg = sl_warp_sum(dg);
        if (lane == 0) {
            size_t tok = (size_t)(p / H);
            float a = load_act(ga.z, tok * ldz + ga.col_a + h, fp32);
            float A = expf(load_act(ga.A_log, h, fp32)), dtb = load_act(ga.dt_bias, h, fp32);
            float da = dg * (-A * sl_sigmoid(a + dtb));
            float b = ga.beta[p], dc = ga.dbeta[p] * b * (1.0f - b);
            store_act(dz, zrow + ga.col_a + h, da, fp32);
            store_act(dz, zrow + ga.col_c + h, dc, fp32);
            float *gg = ga.gate_grad + tok * 3 * H;
            gg[h] = da;
            gg[H + h] = dc;
            gg[2 * H + h] = dg * gp;
        }
    }
}

static inline void address_backward(const TopkPlan *pl, const int *slot, const float *w, const float *dw, float scale,
                                    int P, int H, void *dz, bool fp32, int ldz, int col0, int gates,
                                    const WriteGateArgs *ga, cudaStream_t s) {
    const int warps = 4;
    size_t smem = sizeof(float) * (size_t)(pl->key_dim + pl->k) * warps;
    if (smem > 48 * 1024)
        cudaCheck(cudaFuncSetAttribute(address_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem));
    WriteGateArgs none;
    memset(&none, 0, sizeof(none));
    address_backward_kernel<<<ceil_div(P, warps), 32 * warps, smem, s>>>(*pl, slot, w, dw, scale, P, H, dz, fp32, ldz,
                                                                        col0, gates, gates ? *ga : none);
    cudaCheckLast();
}

// =================================================================================================================
// Gates and values from the fused projection (docs/SDM.md#gates), one block per token:
//   v[tok, :] = z[tok, col_v : col_v + D] in fp32 (the op's input), g = -exp(A_log) softplus(a + dt_bias),
//   beta = sigmoid(c), with a = z[tok, col_a + h], c = z[tok, col_c + h].
// =================================================================================================================

__global__ void unpack_kernel(const void *z, bool fp32, int ldz, int col_v, int col_a, int col_c, int D, int H,
                              const void *A_log, const void *dt_bias, float *v, float *g, float *beta) {
    size_t tok = blockIdx.x, row = tok * ldz;
    for (int i = threadIdx.x; i < D; i += blockDim.x) v[tok * D + i] = load_act(z, row + col_v + i, fp32);
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float a = load_act(z, row + col_a + h, fp32), c = load_act(z, row + col_c + h, fp32);
        g[tok * H + h] = -expf(load_act(A_log, h, fp32)) * sl_softplus(a + load_act(dt_bias, h, fp32));
        beta[tok * H + h] = sl_sigmoid(c);
    }
}

// dz[tok, col_v : col_v + D] = dv[tok, :] (the op's value gradient into the fused projection's gradient)
__global__ void pack_dv_kernel(const float *dv, void *dz, bool fp32, int ldz, int col_v, int D) {
    size_t tok = blockIdx.x;
    for (int i = threadIdx.x; i < D; i += blockDim.x) store_act(dz, tok * ldz + col_v + i, dv[tok * D + i], fp32);
}

// =================================================================================================================
// Readout (docs/SDM.md#readout) over rows p = token*H + h of width d: rn = LayerNorm_d(o) (shared weight/bias) or o;
// r = sigmoid(zG) * rn or rn. One warp per row (lane L owns the float4 column groups L, L+32, ...), each warp
// walking a fixed contiguous range of rows, so the LayerNorm weight/bias gradients are per-warp partial sums
// [n_warps, d] that a deterministic column sum adds afterwards.
// =================================================================================================================

#define RO_WARPS_PER_BLOCK 4
#define RO_MAX_WARPS 4096
#define RO_MAX_D 2048

typedef struct {
    int P, d, H, ldz, col_g;
    int ln, gate;
    float eps;
    const void *ln_w, *ln_b; // [d] compute dtype
    const void *z;           // forward projections (zG)
    bool fp32;
    int n_warps, rows_per_warp;
} ReadoutArgs;

static inline int readout_warps(int P) { return SDM_MIN(P, RO_MAX_WARPS); }

__device__ __forceinline__ float4 ld4(const float *p) { return *(const float4 *)p; }
__device__ __forceinline__ float f4get(const float4 &v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

template <int NV>
__global__ void __launch_bounds__(32 * RO_WARPS_PER_BLOCK) readout_forward_kernel(ReadoutArgs ra, const float *o,
                                                                                 void *r, float *ln_mean,
                                                                                 float *ln_rstd) {
    int warp = blockIdx.x * RO_WARPS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (warp >= ra.n_warps) return;
    int d4 = ra.d / 4, p0 = warp * ra.rows_per_warp, p1 = min(ra.P, p0 + ra.rows_per_warp);
    for (int p = p0; p < p1; p++) {
        const float *orow = o + (size_t)p * ra.d;
        float4 x[NV];
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + 32 * i;
            x[i] = c4 < d4 ? ld4(orow + 4 * c4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        float mean = 0.0f, rstd = 1.0f;
        if (ra.ln) {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < NV; i++) sum += (x[i].x + x[i].y) + (x[i].z + x[i].w);
            mean = sl_warp_sum(sum) / ra.d;
            float q = 0.0f;
#pragma unroll
            for (int i = 0; i < NV; i++)
                if (lane + 32 * i < d4)
                    for (int j = 0; j < 4; j++) q += (f4get(x[i], j) - mean) * (f4get(x[i], j) - mean);
            rstd = 1.0f / sqrtf(sl_warp_sum(q) / ra.d + ra.eps);
            if (lane == 0) { ln_mean[p] = mean; ln_rstd[p] = rstd; }
        }
        size_t zrow = (size_t)(p / ra.H) * ra.ldz + ra.col_g + (size_t)(p % ra.H) * ra.d;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + 32 * i;
            if (c4 >= d4) continue;
            for (int j = 0; j < 4; j++) {
                int c = 4 * c4 + j;
                float y = f4get(x[i], j);
                if (ra.ln) y = (y - mean) * rstd * load_act(ra.ln_w, c, ra.fp32) + load_act(ra.ln_b, c, ra.fp32);
                if (ra.gate) y *= sl_sigmoid(load_act(ra.z, zrow + c, ra.fp32));
                store_act(r, (size_t)p * ra.d + c, y, ra.fp32);
            }
        }
    }
}

// From dr [P,d] (gradient of r, fp32): dout [P,d] (gradient of the op readings; may alias dr: each element is
// read and then written by the same lane), dzG into dz (gate; dz may alias the forward z the same way), and the
// per-warp LayerNorm partials: partials[warp][d] = sum drn * xhat, partials[n_warps + warp][d] = sum drn.
template <int NV>
__global__ void __launch_bounds__(32 * RO_WARPS_PER_BLOCK) readout_backward_kernel(ReadoutArgs ra, const float *o,
                                                                                  const float *ln_mean,
                                                                                  const float *ln_rstd, const float *dr,
                                                                                  float *dout, void *dz,
                                                                                  float *partials) {
    int warp = blockIdx.x * RO_WARPS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (warp >= ra.n_warps) return;
    int d4 = ra.d / 4, p0 = warp * ra.rows_per_warp, p1 = min(ra.P, p0 + ra.rows_per_warp);
    float4 acc_w[NV], acc_b[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) acc_w[i] = acc_b[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int p = p0; p < p1; p++) {
        float mean = ra.ln ? ln_mean[p] : 0.0f, rstd = ra.ln ? ln_rstd[p] : 1.0f;
        size_t zrow = (size_t)(p / ra.H) * ra.ldz + ra.col_g + (size_t)(p % ra.H) * ra.d;
        float xh[NV][4], gw[NV][4];
        float sg_sum = 0.0f, sgx_sum = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + 32 * i;
            float4 xv = make_float4(0.f, 0.f, 0.f, 0.f), gv = xv;
            if (c4 < d4) { xv = ld4(o + (size_t)p * ra.d + 4 * c4); gv = ld4(dr + (size_t)p * ra.d + 4 * c4); }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int c = 4 * c4 + j;
                float x = f4get(xv, j), g = f4get(gv, j);
                xh[i][j] = ra.ln ? (x - mean) * rstd : x;
                gw[i][j] = 0.0f;
                if (c4 >= d4) continue;
                float w = ra.ln ? load_act(ra.ln_w, c, ra.fp32) : 1.0f;
                if (ra.gate) {
                    float rn = ra.ln ? xh[i][j] * w + load_act(ra.ln_b, c, ra.fp32) : x;
                    float sg = sl_sigmoid(load_act(ra.z, zrow + c, ra.fp32));
                    store_act(dz, zrow + c, g * rn * sg * (1.0f - sg), ra.fp32);
                    g *= sg;
                }
                if (ra.ln) {
                    float *aw = (float *)&acc_w[i], *ab = (float *)&acc_b[i];
                    aw[j] += g * xh[i][j];
                    ab[j] += g;
                }
                gw[i][j] = g * w;
                sg_sum += gw[i][j];
                sgx_sum += gw[i][j] * xh[i][j];
            }
        }
        float mean_g = 0.0f, mean_gx = 0.0f;
        if (ra.ln) {
            mean_g = sl_warp_sum(sg_sum) / ra.d;
            mean_gx = sl_warp_sum(sgx_sum) / ra.d;
        }
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + 32 * i;
            if (c4 >= d4) continue;
            float4 v;
            float *vv = (float *)&v;
#pragma unroll
            for (int j = 0; j < 4; j++) vv[j] = ra.ln ? rstd * (gw[i][j] - mean_g - xh[i][j] * mean_gx) : gw[i][j];
            *(float4 *)(dout + (size_t)p * ra.d + 4 * c4) = v;
        }
    }
    if (ra.ln) {
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + 32 * i;
            if (c4 >= d4) continue;
            *(float4 *)(partials + (size_t)warp * ra.d + 4 * c4) = acc_w[i];
            *(float4 *)(partials + ((size_t)ra.n_warps + warp) * ra.d + 4 * c4) = acc_b[i];
        }
    }
}

// Launch the instantiation whose NV float4 groups per lane cover d (d <= 2048, d % 4 == 0).
#define RO_DISPATCH(kernel, ra, st, ...)                                                                         \
    do {                                                                                                         \
        int blocks_ = ceil_div((ra).n_warps, RO_WARPS_PER_BLOCK), thr_ = 32 * RO_WARPS_PER_BLOCK;                \
        if ((ra).d <= 128) kernel<1><<<blocks_, thr_, 0, st>>>(ra, __VA_ARGS__);                                 \
        else if ((ra).d <= 256) kernel<2><<<blocks_, thr_, 0, st>>>(ra, __VA_ARGS__);                            \
        else if ((ra).d <= 512) kernel<4><<<blocks_, thr_, 0, st>>>(ra, __VA_ARGS__);                            \
        else if ((ra).d <= 1024) kernel<8><<<blocks_, thr_, 0, st>>>(ra, __VA_ARGS__);                           \
        else kernel<16><<<blocks_, thr_, 0, st>>>(ra, __VA_ARGS__);                                              \
        cudaCheckLast();                                                                                         \
    } while (0)

static inline void readout_forward(const ReadoutArgs *ra, const float *o, void *r, float *ln_mean, float *ln_rstd,
                                   cudaStream_t st) {
    RO_DISPATCH(readout_forward_kernel, *ra, st, o, r, ln_mean, ln_rstd);
}

// ...and, with the LayerNorm, d ln_w and d ln_b (accumulated) as column sums of the per-warp partials.
static inline void readout_backward(const ReadoutArgs *ra, const float *o, const float *ln_mean, const float *ln_rstd,
                                    float *dr, void *dz, float *partials, float *dln_w, float *dln_b,
                                    cudaStream_t st) {
    RO_DISPATCH(readout_backward_kernel, *ra, st, o, ln_mean, ln_rstd, dr, dr, dz, partials);
    if (ra->ln) {
        colsum(dln_w, partials, CUDA_R_32F, ra->d, ra->n_warps, ra->d, 1, st);
        colsum(dln_b, partials + (size_t)ra->n_warps * ra->d, CUDA_R_32F, ra->d, ra->n_warps, ra->d, 1, st);
    }
}

// =================================================================================================================
// The bank: every sequence starts from its own copy of M0 (docs/SDM.md#the-bank), and dM0 is the sum of the copies' gradients
// over b in order 0..B-1 (docs/SDM.md#layer-chain-rule).
// =================================================================================================================

__global__ void bank_copy_kernel(void *bank, bool bank_fp32, const void *m0, bool m0_fp32, size_t per_seq, int B) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < per_seq; i += (size_t)gridDim.x * blockDim.x) {
        float x = load_act(m0, i, m0_fp32);
        for (int b = 0; b < B; b++) store_act(bank, (size_t)b * per_seq + i, x, bank_fp32);
    }
}

// bank[b, :] = m0 for every b, in 16-byte units (n16 per sequence)
__global__ void bank_replicate_kernel(uint4 *bank, const uint4 *m0, size_t n16, int B) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        uint4 x = m0[i];
        for (int b = 0; b < B; b++) bank[(size_t)b * n16 + i] = x;
    }
}

// dm0[i] += sum_b dbank[b, i]; per_seq % 4 == 0 (d is a multiple of 8)
__global__ void bank_grad_sum_kernel(float *dm0, const float *dbank, size_t per_seq, int B) {
    size_t n4 = per_seq / 4;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 s = ((const float4 *)dbank)[i];
        for (int b = 1; b < B; b++) {
            float4 t = ((const float4 *)(dbank + (size_t)b * per_seq))[i];
            s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
        }
        float4 acc = ((float4 *)dm0)[i];
        acc.x += s.x; acc.y += s.y; acc.z += s.z; acc.w += s.w;
        ((float4 *)dm0)[i] = acc;
    }
}

// bank [B, per_seq] (bank dtype) = M0 [per_seq] (m0 dtype) for every b, or zeros when m0 is NULL.
static inline void bank_init(void *bank, int bank_fp32, const void *m0, int m0_fp32, size_t per_seq, int B,
                             cudaStream_t s) {
    if (!m0) {
        cudaCheck(cudaMemsetAsync(bank, 0, (size_t)B * per_seq * (bank_fp32 ? 4 : 2), s));
        return;
    }
    if (bank_fp32 == m0_fp32 && (uintptr_t)m0 % 16 == 0) { // same dtype: read M0 once, write B copies, 16 B at a time
        size_t n16 = per_seq * (bank_fp32 ? 4 : 2) / 16;
        bank_replicate_kernel<<<2112, 256, 0, s>>>((uint4 *)bank, (const uint4 *)m0, n16, B);
        cudaCheckLast();
        return;
    }
    bank_copy_kernel<<<1056, 256, 0, s>>>(bank, bank_fp32 != 0, m0, m0_fp32 != 0, per_seq, B);
    cudaCheckLast();
}

// =================================================================================================================
// The layer.
// =================================================================================================================

// Device parameters in the compute dtype. w_in: the model's consecutive wk, wq, wv, wa, wb (, wg) block [n_in, D],
// n_in = 2*H*K + D + 2*H (+ D with output_gate); consecutive because every block has a multiple of 8 elements when
// D % 8 == 0, so the model's 8-element tensor alignment adds no gaps. The biases need not be consecutive (ba and bb
// have H elements, so alignment gaps follow them): one pointer each, packed into the layer's own buffer.
enum { SDM_B_K, SDM_B_Q, SDM_B_V, SDM_B_A, SDM_B_B, SDM_B_G, SDM_B_COUNT };

typedef struct {
    const void *w_in;
    const void *b_in[SDM_B_COUNT]; // bk [H*K], bq [H*K], bv [D], ba [H], bb [H], bg [D] (bg NULL without output_gate)
    const void *A_log, *dt_bias;   // [H]
    const void *ln_w, *ln_b;       // [d] (normalize_readings, else NULL)
    const void *w_out, *b_out;     // [D, D], [D]
    const void *bank0;             // M0 [H*N, d] (learned_bank, else NULL)
} SdmLayerParams;

// fp32 gradients, accumulated (+=) by sdm_layer_backward; same shapes as SdmLayerParams (bank0: 16-byte aligned).
typedef struct {
    float *w_in, *b_in[SDM_B_COUNT], *A_log, *dt_bias, *ln_w, *ln_b, *w_out, *b_out, *bank0;
} SdmLayerGrads;

// Stage boundaries recorded with CUDA events when timing is on (see sdm_layer_stage_ms).
enum { EV_F0, EV_F_PROJ, EV_F_TOPK, EV_F_BANK, EV_F_OP, EV_F_READOUT, EV_F_OUT,
       EV_B0, EV_B_OUT, EV_B_READOUT, EV_B_OP, EV_B_TOPK, EV_B_SUMS, EV_B_IN, SDM_LAYER_EVENTS };

typedef struct {
    SdmDims s;
    int B, T, fp32;      // fp32 = 1: all-fp32 mode (compute dtype fp32); else bf16
    cudaDataType_t ctype;
    SdmOpShape op;
    TopkPlan tw, tr;     // write / read top-k
    int n_in, ldz;       // fused projection width and its row stride (multiple of 8)
    int col_zk, col_zq, col_v, col_a, col_c, col_g;
    // saved by the forward for the backward
    void *b_packed;      // [n_in] compute dtype: the input biases packed in the column order of z
    void *z;             // [BT, ldz] compute dtype: zK | zQ | v | a | c (| zG); the backward overwrites it with dz
    float *v, *g, *beta; // [BT, D], [BT, H], [BT, H]
    int *wslot, *rslot;  // [BT, H, W], [BT, H, R]
    float *kappa, *gamma, *rho;
    void *bank;          // [B, H, N, d] bank dtype; final bank after the forward, restored by the backward
    float *o;            // [BT, D] op readings
    float *ln_mean, *ln_rstd; // [BT, H]
    void *r;             // [BT, D] compute dtype, the input of Wo
    void *saved;         // sdm_op_saved_bytes
    // backward
    void *scratch;       // sdm_op_scratch_bytes
    float *dr;           // [BT, D] dY Wo, then (in place) the gradient of the op readings
    float *dkappa, *dgamma, *dbeta, *dv, *drho, *dbank; // op gradients
    float *gate_grad;    // [BT, 3H]: da, dc, dg * g in fp32
    float *ln_partials;  // [2, readout_warps, d]
    size_t device_bytes;
    int timing;
    cudaEvent_t ev[SDM_LAYER_EVENTS];
} SdmLayer;

static inline void *layer_alloc(SdmLayer *L, size_t bytes) {
    void *p = NULL;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    L->device_bytes += bytes;
    return p;
}

// NULL when the GPU layer supports the configuration, else the reason.
static inline const char *sdm_layer_check(const SdmDims *s) {
    if (s->write_act != SDM_ACT_SOFTMAX || s->read_act != SDM_ACT_SOFTMAX)
        return "the GPU layer implements only the softmax weight activation (write_act / read_act)";
    if (s->heads < 1 || s->dim % s->heads != 0 || s->head_dim != s->dim / s->heads) return "D must equal H * d";
    if (s->head_dim > RO_MAX_D || s->head_dim % 4 != 0) return "head dim d must be a multiple of 4, at most 2048";
    return NULL;
}

// Shape, column layout and top-k plans of a layer for B sequences of T tokens (no device buffers yet).
static inline SdmLayer layer_setup(const SdmDims *s, int B, int T, int fp32, int training) {
    const char *why = sdm_layer_check(s);
    if (why) sdm_die("SDM layer: %s", why);
    SdmLayer L;
    memset(&L, 0, sizeof(L));
    L.s = *s;
    L.B = B; L.T = T; L.fp32 = fp32;
    L.ctype = fp32 ? CUDA_R_32F : CUDA_R_16BF;
    int D = s->dim, H = s->heads, HK = H * s->key_dim;
    L.op.B = B; L.op.T = T; L.op.H = H; L.op.N = s->slots; L.op.d = s->head_dim; L.op.W = s->writes;
    L.op.R = s->reads; L.op.C = s->chunk; L.op.bank_fp32 = s->bank_fp32; L.op.snapshot = s->snapshot;
    L.op.training = training;
    if ((why = sdm_op_check(&L.op))) sdm_die("SDM layer: memory op: %s", why);
    L.tw = topk_plan_make(s, s->writes);
    L.tr = topk_plan_make(s, s->reads);
    L.col_zk = 0; L.col_zq = HK; L.col_v = 2 * HK; L.col_a = 2 * HK + D; L.col_c = L.col_a + H;
    L.col_g = L.col_c + H;
    L.n_in = L.col_g + (s->output_gate ? D : 0);
    L.ldz = (L.n_in + 7) & ~7;
    return L;
}

// The per-token buffers of the forward for L->B * L->T tokens (all but the bank and the op's saved state).
static inline void layer_alloc_forward(SdmLayer *L) {
    const SdmDims *s = &L->s;
    size_t BT = (size_t)L->B * L->T, P = BT * s->heads, D = s->dim, W = s->writes, R = s->reads;
    size_t cs = L->fp32 ? 4 : 2;
    L->b_packed = layer_alloc(L, (size_t)L->n_in * cs);
    L->z = layer_alloc(L, BT * L->ldz * cs);
    L->v = (float *)layer_alloc(L, BT * D * 4);
    L->g = (float *)layer_alloc(L, P * 4);
    L->beta = (float *)layer_alloc(L, P * 4);
    L->wslot = (int *)layer_alloc(L, P * W * 4);
    L->kappa = (float *)layer_alloc(L, P * W * 4);
    L->gamma = (float *)layer_alloc(L, P * W * 4);
    L->rslot = (int *)layer_alloc(L, P * R * 4);
    L->rho = (float *)layer_alloc(L, P * R * 4);
    L->o = (float *)layer_alloc(L, BT * D * 4);
    if (s->normalize_readings) {
        L->ln_mean = (float *)layer_alloc(L, P * 4);
        L->ln_rstd = (float *)layer_alloc(L, P * 4);
    }
    L->r = layer_alloc(L, BT * D * cs);
}

// Bytes of one sequence's bank [H, N, d] in the bank dtype.
static inline size_t sdm_bank_bytes(const SdmDims *s) {
    return (size_t)s->heads * s->slots * s->head_dim * (s->bank_fp32 ? 4 : 2);
}

static inline SdmLayer sdm_layer_create(const SdmDims *s, int B, int T, int fp32, int timing) {
    SdmLayer L = layer_setup(s, B, T, fp32, 1);
    layer_alloc_forward(&L);
    int W = s->writes, R = s->reads, d = s->head_dim;
    size_t BT = (size_t)B * T, P = BT * s->heads, D = s->dim;
    size_t bank_elems = (size_t)B * s->heads * s->slots * d;
    L.bank = layer_alloc(&L, B * sdm_bank_bytes(s));
    if (s->normalize_readings) L.ln_partials = (float *)layer_alloc(&L, 2 * (size_t)readout_warps((int)P) * d * 4);
    L.saved = layer_alloc(&L, sdm_op_saved_bytes(&L.op));
    L.scratch = layer_alloc(&L, sdm_op_scratch_bytes(&L.op));
    L.dr = (float *)layer_alloc(&L, BT * D * 4);
    L.dkappa = (float *)layer_alloc(&L, P * W * 4);
    L.dgamma = (float *)layer_alloc(&L, P * W * 4);
    L.dbeta = (float *)layer_alloc(&L, P * 4);
    L.dv = (float *)layer_alloc(&L, BT * D * 4);
    L.drho = (float *)layer_alloc(&L, P * R * 4);
    L.dbank = (float *)layer_alloc(&L, bank_elems * 4);
    L.gate_grad = (float *)layer_alloc(&L, BT * 3 * s->heads * 4);
    L.timing = timing;
    if (timing)
        for (int i = 0; i < SDM_LAYER_EVENTS; i++) cudaCheck(cudaEventCreate(&L.ev[i]));
    return L;
}

static inline void sdm_layer_destroy(SdmLayer *L) {
    void *bufs[] = {L->b_packed, L->z, L->v, L->g, L->beta, L->wslot, L->kappa, L->gamma, L->rslot, L->rho, L->bank,
                    L->o, L->ln_mean, L->ln_rstd, L->ln_partials, L->r, L->saved, L->scratch, L->dr, L->dkappa,
                    L->dgamma, L->dbeta, L->dv, L->drho, L->dbank, L->gate_grad};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) cudaCheck(cudaFree(bufs[i]));
    if (L->timing)
        for (int i = 0; i < SDM_LAYER_EVENTS; i++) cudaCheck(cudaEventDestroy(L->ev[i]));
    topk_plan_free(&L->tw);
    topk_plan_free(&L->tr);
    memset(L, 0, sizeof(*L));
}

static inline void layer_mark(SdmLayer *L, int ev, cudaStream_t s) {
    if (L->timing) cudaCheck(cudaEventRecord(L->ev[ev], s));
}

// First column of each input bias block in z (SDM_B_* order) and its width.
static inline void layer_bias_block(const SdmLayer *L, int which, int *col, int *width) {
    const SdmDims *s = &L->s;
    int HK = s->heads * s->key_dim, cols[SDM_B_COUNT] = {L->col_zk, L->col_zq, L->col_v, L->col_a, L->col_c, L->col_g};
    int widths[SDM_B_COUNT] = {HK, HK, s->dim, s->heads, s->heads, s->output_gate ? s->dim : 0};
    *col = cols[which];
    *width = widths[which];
}

static inline SdmOpInputs layer_op_inputs(const SdmLayer *L) {
    SdmOpInputs in;
    in.wslot = L->wslot; in.kappa = L->kappa; in.gamma = L->gamma; in.beta = L->beta; in.v = L->v;
    in.rslot = L->rslot; in.rho = L->rho;
    return in;
}

static inline ReadoutArgs layer_readout_args(const SdmLayer *L, const SdmLayerParams *p) {
    ReadoutArgs ra;
    ra.P = L->B * L->T * L->s.heads;
    ra.d = L->s.head_dim; ra.H = L->s.heads; ra.ldz = L->ldz; ra.col_g = L->col_g;
    ra.ln = L->s.normalize_readings; ra.gate = L->s.output_gate; ra.eps = L->s.norm_eps;
    ra.ln_w = p->ln_w; ra.ln_b = p->ln_b; ra.z = L->z; ra.fp32 = L->fp32 != 0;
    ra.n_warps = readout_warps(ra.P);
    ra.rows_per_warp = ceil_div(ra.P, ra.n_warps);
    return ra;
}

// z = x W_inᵀ + b (the fused projection), then the gates, values and both top-k selections with their weights,
// for the L->B * L->T tokens of x [B,T,D].
static inline void layer_address(SdmLayer *L, const SdmLayerParams *p, const void *x, cudaStream_t st) {
    const SdmDims *s = &L->s;
    int BT = L->B * L->T, H = s->heads, P = BT * H, D = s->dim;
    bool f32 = L->fp32 != 0;
    for (int i = 0; i < SDM_B_COUNT; i++) {
        int col, width;
        layer_bias_block(L, i, &col, &width);
        if (width)
            cudaCheck(cudaMemcpyAsync((void *)elem_ptr(L->b_packed, col, L->ctype), p->b_in[i],
                                      (size_t)width * dtype_size(L->ctype), cudaMemcpyDeviceToDevice, st));
    }
    matmul_forward(L->z, L->ctype, L->ldz, x, p->w_in, L->b_packed, L->ctype, BT, L->n_in, D, st);
    layer_mark(L, EV_F_PROJ, st);
    unpack_kernel<<<BT, 256, 0, st>>>(L->z, f32, L->ldz, L->col_v, L->col_a, L->col_c, D, H, p->A_log, p->dt_bias,
                                      L->v, L->g, L->beta);
    cudaCheckLast();
    topk_forward(&L->tw, L->z, f32, L->ldz, L->col_zk, H, P, s->write_scale, L->g, s->key_weighted_decay, L->wslot,
                 L->kappa, NULL, L->gamma, st);
    topk_forward(&L->tr, L->z, f32, L->ldz, L->col_zq, H, P, s->read_scale, NULL, 0, L->rslot, L->rho, NULL, NULL,
                 st);
    layer_mark(L, EV_F_TOPK, st);
}

// y [B,T,D] = Wo · readout(the op readings L->o) + bo.
static inline void layer_output(SdmLayer *L, const SdmLayerParams *p, void *y, cudaStream_t st) {
    ReadoutArgs ra = layer_readout_args(L, p);
    readout_forward(&ra, L->o, L->r, L->ln_mean, L->ln_rstd, st);
    layer_mark(L, EV_F_READOUT, st);
    int BT = L->B * L->T, D = L->s.dim;
    matmul_forward(y, L->ctype, D, L->r, p->w_out, p->b_out, L->ctype, BT, D, D, st);
    layer_mark(L, EV_F_OUT, st);
}

// Training forward: y [B,T,D] = the layer of x [B,T,D] (both compute dtype); saves what the backward needs.
static inline void sdm_layer_forward(SdmLayer *L, const SdmLayerParams *p, const void *x, void *y, cudaStream_t st) {
    const SdmDims *s = &L->s;
    layer_mark(L, EV_F0, st);
    layer_address(L, p, x, st);
    bank_init(L->bank, s->bank_fp32, s->learned_bank ? p->bank0 : NULL, L->fp32,
              (size_t)s->heads * s->slots * s->head_dim, L->B, st);
    layer_mark(L, EV_F_BANK, st);
    SdmOpInputs in = layer_op_inputs(L);
    sdm_op_forward(&L->op, &in, L->bank, L->o, L->saved, st);
    layer_mark(L, EV_F_OP, st);
    layer_output(L, p, y, st);
}

// Backward after sdm_layer_forward on the same x: dx [B,T,D] (compute dtype) is overwritten, every parameter
// gradient in g is accumulated. Consumes the forward's saved state (the op restores the bank; z becomes dz), so it
// runs once per forward.
static inline void sdm_layer_backward(SdmLayer *L, const SdmLayerParams *p, const void *x, const void *dy,
                                      void *dx, const SdmLayerGrads *g, cudaStream_t st) {
    const SdmDims *s = &L->s;
    int BT = L->B * L->T, H = s->heads, P = BT * H, D = s->dim, d = s->head_dim;
    bool f32 = L->fp32 != 0;
    void *dz = L->z; // in place: each gradient entry overwrites the forward value only its own thread still reads
    layer_mark(L, EV_B0, st);
    // output projection
    matmul_backward_weight(g->w_out, CUDA_R_32F, dy, D, L->r, L->ctype, BT, D, D, 1, st);
    matmul_backward_bias(g->b_out, dy, L->ctype, D, BT, D, 1, st);
    matmul_backward_input(L->dr, CUDA_R_32F, dy, D, p->w_out, L->ctype, BT, D, D, 0, st);
    layer_mark(L, EV_B_OUT, st);
    // readout: gate and LayerNorm; dr becomes the gradient of the op readings in place
    ReadoutArgs ra = layer_readout_args(L, p);
    readout_backward(&ra, L->o, L->ln_mean, L->ln_rstd, L->dr, dz, L->ln_partials, g->ln_w, g->ln_b, st);
    layer_mark(L, EV_B_READOUT, st);
    // the memory op
    SdmOpInputs in = layer_op_inputs(L);
    SdmOpGrads og;
    og.dkappa = L->dkappa; og.dgamma = L->dgamma; og.dbeta = L->dbeta; og.dv = L->dv; og.drho = L->drho;
    og.dbank_init = L->dbank;
    sdm_op_backward(&L->op, &in, L->bank, L->dr, NULL, &og, L->saved, L->scratch, st);
    layer_mark(L, EV_B_OP, st);
    // addressing, gates and values back into dz
    WriteGateArgs ga;
    ga.z = L->z; ga.dgamma = L->dgamma; ga.g = L->g; ga.beta = L->beta; ga.dbeta = L->dbeta;
    ga.A_log = p->A_log; ga.dt_bias = p->dt_bias; ga.kwd = s->key_weighted_decay;
    ga.col_a = L->col_a; ga.col_c = L->col_c; ga.gate_grad = L->gate_grad;
    address_backward(&L->tw, L->wslot, L->kappa, L->dkappa, s->write_scale, P, H, dz, f32, L->ldz, L->col_zk, 1, &ga,
                     st);
    address_backward(&L->tr, L->rslot, L->rho, L->drho, s->read_scale, P, H, dz, f32, L->ldz, L->col_zq, 0, NULL,
                     st);
    pack_dv_kernel<<<BT, 256, 0, st>>>(L->dv, dz, f32, L->ldz, L->col_v, D);
    cudaCheckLast();
    layer_mark(L, EV_B_TOPK, st);
    // learned bank and gate parameters
    if (s->learned_bank) {
        if ((uintptr_t)g->bank0 % 16) sdm_die("SDM layer: the M0 gradient must be 16-byte aligned");
        bank_grad_sum_kernel<<<2112, 256, 0, st>>>(g->bank0, L->dbank, (size_t)H * s->slots * d, L->B);
        cudaCheckLast();
    }
    colsum(g->dt_bias, L->gate_grad, CUDA_R_32F, 3 * H, BT, H, 1, st);
    colsum(g->A_log, L->gate_grad + 2 * H, CUDA_R_32F, 3 * H, BT, H, 1, st);
    layer_mark(L, EV_B_SUMS, st);
    // input projection
    matmul_backward_weight(g->w_in, CUDA_R_32F, dz, L->ldz, x, L->ctype, BT, L->n_in, D, 1, st);
    // input biases: ba and bb from the fp32 gate gradients, the others from dz
    for (int i = 0; i < SDM_B_COUNT; i++) {
        int col, width;
        layer_bias_block(L, i, &col, &width);
        if (i == SDM_B_A || i == SDM_B_B)
            colsum(g->b_in[i], L->gate_grad + (i == SDM_B_A ? 0 : H), CUDA_R_32F, 3 * H, BT, H, 1, st);
        else if (width)
            matmul_backward_bias(g->b_in[i], elem_ptr(dz, col, L->ctype), L->ctype, L->ldz, BT, width, 1, st);
    }
    matmul_backward_input(dx, L->ctype, dz, L->ldz, p->w_in, L->ctype, BT, L->n_in, D, 0, st);
    layer_mark(L, EV_B_IN, st);
}

// Stage times (ms) of the last forward+backward when timing is on: [0] projections (both GEMM groups, forward and
// backward), [1] top-k and addressing (gates, softmax, routing), [2] the memory op, [3] the rest (bank copy and
// dM0, readout, gate sums), [4] forward total, [5] backward total. Synchronises on the last event.
static inline void sdm_layer_stage_ms(SdmLayer *L, float *ms) {
    if (!L->timing) sdm_die("sdm_layer_stage_ms: the layer was created without timing");
    cudaCheck(cudaEventSynchronize(L->ev[EV_B_IN]));
    float t[SDM_LAYER_EVENTS];
    for (int i = 1; i < SDM_LAYER_EVENTS; i++)
        if (i != EV_B0) cudaCheck(cudaEventElapsedTime(&t[i], L->ev[i - 1], L->ev[i]));
    ms[0] = t[EV_F_PROJ] + t[EV_F_OUT] + t[EV_B_OUT] + t[EV_B_IN];
    ms[1] = t[EV_F_TOPK] + t[EV_B_TOPK];
    ms[2] = t[EV_F_OP] + t[EV_B_OP];
    ms[3] = t[EV_F_BANK] + t[EV_F_READOUT] + t[EV_B_READOUT] + t[EV_B_SUMS];
    cudaCheck(cudaEventElapsedTime(&ms[4], L->ev[EV_F0], L->ev[EV_F_OUT]));
    cudaCheck(cudaEventElapsedTime(&ms[5], L->ev[EV_B0], L->ev[EV_B_IN]));
}

// =================================================================================================================
// Inference (docs/SDM.md#decode-and-prefill): each stream's bank persists between calls. A prefill runs one stream's prompt through
// the op's chunked forward without saves (training = 0) and leaves the final bank as the decode state; a decode
// step applies docs/SDM.md#the-recurrence to one token of every stream in place (sdm_op_decode). Both reuse the training
// forward's projections, top-k and readout on the first rows of the state's buffers.
// =================================================================================================================

typedef struct {
    SdmLayer L;         // forward buffers for up to `rows` tokens (no backward buffers); L.B, L.T: the current call
    int streams, rows;  // rows = max(max_tokens, streams)
    void *banks;        // [streams, H, N, d] bank dtype: each stream's memory
    size_t saved_bytes; // size of L.saved, the prefill op's scratch
} SdmInferState;

// State for `streams` streams and prompts of up to max_tokens tokens; call sdm_infer_reset before use.
static inline SdmInferState sdm_infer_create(const SdmDims *s, int streams, int max_tokens, int fp32) {
    SdmInferState I;
    memset(&I, 0, sizeof I);
    I.streams = streams;
    I.rows = SDM_MAX(max_tokens, streams);
    I.L = layer_setup(s, 1, I.rows, fp32, 0);
    layer_alloc_forward(&I.L);
    I.saved_bytes = sdm_op_saved_bytes(&I.L.op);
    I.L.saved = layer_alloc(&I.L, I.saved_bytes);
    I.banks = layer_alloc(&I.L, (size_t)streams * sdm_bank_bytes(s));
    return I;
}

static inline void sdm_infer_destroy(SdmInferState *I) {
    cudaCheck(cudaFree(I->banks));
    sdm_layer_destroy(&I->L);
    memset(I, 0, sizeof *I);
}

static inline void *sdm_infer_bank(const SdmInferState *I, int b) {
    return (char *)I->banks + (size_t)b * sdm_bank_bytes(&I->L.s);
}

// Stream b's bank (b < 0: every stream's) = a copy of the learned M0, or zeros without a learned bank (docs/SDM.md#the-bank).
static inline void sdm_infer_reset(SdmInferState *I, const SdmLayerParams *p, int b, cudaStream_t st) {
    const SdmDims *s = &I->L.s;
    bank_init(b < 0 ? I->banks : sdm_infer_bank(I, b), s->bank_fp32, s->learned_bank ? p->bank0 : NULL, I->L.fp32,
              (size_t)s->heads * s->slots * s->head_dim, b < 0 ? I->streams : 1, st);
}

// The buffers' first B*T rows describe this call.
static inline void sdm_infer_shape(SdmInferState *I, int B, int T) {
    if (B * T > I->rows) sdm_die("SDM inference: %d tokens exceed the state's %d rows", B * T, I->rows);
    I->L.B = I->L.op.B = B;
    I->L.T = I->L.op.T = T;
}

// Prefill of stream b: y [T, D] = the layer of its prompt's x [T, D] (compute dtype), continuing from the stream's
// bank (a fresh copy of M0 after sdm_infer_reset) and leaving it after the last token.
static inline void sdm_infer_prefill(SdmInferState *I, const SdmLayerParams *p, int b, const void *x, void *y, int T,
                                     cudaStream_t st) {
    sdm_infer_shape(I, 1, T);
    if (sdm_op_saved_bytes(&I->L.op) > I->saved_bytes) sdm_die("SDM inference: prefill scratch too small for T = %d", T);
    layer_address(&I->L, p, x, st);
    SdmOpInputs in = layer_op_inputs(&I->L);
    sdm_op_forward(&I->L.op, &in, sdm_infer_bank(I, b), I->L.o, I->L.saved, st);
    layer_output(&I->L, p, y, st);
}

// Decode step of every stream: y [streams, D] = the layer of one new token per stream x [streams, D].
static inline void sdm_infer_decode(SdmInferState *I, const SdmLayerParams *p, const void *x, void *y,
                                    cudaStream_t st) {
    sdm_infer_shape(I, I->streams, 1);
    layer_address(&I->L, p, x, st);
    SdmOpInputs in = layer_op_inputs(&I->L);
    sdm_op_decode(&I->L.op, &in, I->banks, I->L.o, st);
    layer_output(&I->L, p, y, st);
}

#endif
