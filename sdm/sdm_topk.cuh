// sdm/sdm_topk.cuh: the SDM layer's addressing on the GPU (docs/SDM.md#gates, docs/SDM.md#product-key-addressing,
// docs/SDM.md#tie-rule, docs/SDM.md#key-weighted-decay, docs/SDM.md#layer-chain-rule). Forward: for every problem p =
// token*H + h, the product-key scores of its K = sum of factor widths columns of the fused projection z [tokens, ldz]
// (bf16 or fp32), the k best slots by the exact radix top-k, sorted by ascending slot: slot [P,k] int32, weight [P,k] =
// softmax(scale * score) fp32, optionally score [P,k] and the write decays gamma [P,k]. Backward: the softmax backward
// and the routing of each score's gradient to its sub-key entries, written as the K-wide block of dz, and for writes
// the gate gradients (key-weighted decay, a, c) into dz and the fp32 per-token gate terms gate_grad [tokens, 3H]. One
// warp per problem (many problems: training, prefill) or one block per problem (few: decode); integer histograms and
// counts only: deterministic, and the two forward kernels agree bit for bit.
#ifndef SDM_SDM_TOPK_CUH
#define SDM_SDM_TOPK_CUH

#include "core/cuda_common.cuh"
#include "sdm/sdm_common.cuh"
#include "sdm/sdm_dims.h"

// =================================================================================================================
// Product-key top-k (docs/SDM.md#tie-rule), the selection of sdm_pk_topk_ref:
//   slot score = float32 sum of its factor scores, left to right ((s1 + s2) + s3) ...; ties between equal float32
//   scores go to the larger sum of sub-key indices, then the larger slot index; each factor keeps only its best
//   min(k, n_f) sub-keys plus every sub-key tied with the last kept one, and the k best tuples of kept sub-keys win.
// Method: sort each factor's kept scores descending. Over positions in the sorted lists the score never increases
// along any axis, so the grid points scoring >= any value form a down-set, and a down-set of size m lies inside
// R_m = {positions p : prod_f (p_f + 1) <= m}. Scoring the fixed table R_cap (cap = 2k) gives the k-th largest
// score tau exactly (a down-set of size k lies in R_k, inside R_cap); if fewer than cap table points score >= tau,
// all grid points scoring >= tau are in the table and the k best of them by the full order are the answer.
// Otherwise (many exact ties at tau) the whole kept grid is searched instead (slow, rare).
// Keys: 64 bits, high word ord(score), low word digit_sum * N + slot: the k largest keys are the k selected slots.
// With F >= 3 the CPU keeps only k partial tuples after each merge; the two agree unless float32 rounding makes
// two different partial sums tie after the next addition.
// Two kernels compute the same integer quantities (kept lists, tau, the selected keys in the same order) and share
// the softmax: one warp per problem (sdm_topk_forward_kernel: the serial steps of one warp bound its latency, ~38 us
// on the flagship shape) and one block of SDM_TOPK_THREADS threads per problem (sdm_topk_block_kernel), which the
// launcher takes for small P (decode).
// =================================================================================================================

#define SDM_TOPK_WARPS_MAX 4
#define SDM_TOPK_THREADS 256        // threads of the block kernel: one per radix histogram bin
#define SDM_TOPK_BLOCK_MAX_N 1024  // widest factor for the block kernel (its per-factor ranking costs n^2 / 256)
// Largest P for the block kernel. Counted on the flagship shape (H200, 132 SMs): a block costs ~2 us of one SM's
// issue (mostly the per-factor ranking), so P problems take ~max(5 us, P * 2 us / 132), while the warp kernel's first
// wave (~2000 problems) takes ~38 us whatever P: the two cross near P ~ 2500; 1024 leaves a factor 2 for error
// (bench_sdm_layer 3 prints both kernels over P). Training (P = 32768) stays on the warp kernel.
#ifndef SDM_TOPK_BLOCK_MAX_P // -D to move the threshold when measuring
#define SDM_TOPK_BLOCK_MAX_P 1024
#endif

typedef enum { SDM_TOPK_AUTO = 0, SDM_TOPK_WARP, SDM_TOPK_BLOCK } SdmTopkPath;

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
    int key_dim4;                             // sum of factor widths rounded up to multiples of 4 (block kernel)
    size_t smem_block;                        // shared memory of the block kernel (bytes)
    int block_ok;                             // the block kernel supports this plan
    int path;                                 // SdmTopkPath: AUTO picks by P; tests and benches force one
} SdmTopkPlan;

// The outputs of the forward, [P,k] each, sorted by ascending slot; score and gamma may be NULL (gamma: writes only,
// g[p] * weight with key-weighted decay, else g[p]).
typedef struct {
    int *slot;
    float *weight, *score, *gamma;
    const float *g;
    int kwd;
    float scale; // weight = softmax(scale * score)
} SdmTopkOut;

static inline int sdm_next_pow2(int n) { int p = 1; while (p < n) p <<= 1; return p; }

// Visits every position p (p_f < dims[f]) with prod(p_f + 1) <= cap; stores them when out != NULL; returns count.
static inline int sdm_topk_table_fill(const int *dims, int F, int f, int prod, uint32_t packed, int cap, uint32_t *out,
                                  int n) {
    if (f == F) {
        if (out) out[n] = packed;
        return n + 1;
    }
    for (int p = 0; p < dims[f] && prod * (p + 1) <= cap; p++)
        n = sdm_topk_table_fill(dims, F, f + 1, prod * (p + 1), packed | ((uint32_t)p << (8 * f)), cap, out, n);
    return n;
}

// Block kernel shared memory: u64 sorted [sort_total], cand [cap], sel [k] (padded to 16 bytes); u32 sub-key ords
// [key_dim4], their ranks [key_dim4], table copy [n_table], table scores [n_table], histograms [2][256], misc [32].
#define SDM_TOPK_MISC 32
static inline size_t sdm_topk_block_smem(const SdmTopkPlan *pl) {
    size_t u64 = (size_t)pl->sort_total + pl->cap + pl->k;
    return 8 * (u64 + (u64 & 1)) + 4 * (2 * (size_t)pl->key_dim4 + 2 * (size_t)pl->n_table + 512 + SDM_TOPK_MISC);
}

static inline SdmTopkPlan sdm_topk_plan_make(const SdmDims *s, int k) {
    SdmTopkPlan pl;
    memset(&pl, 0, sizeof(pl));
    pl.F = s->n_factors;
    if (pl.F < 1 || pl.F > SDM_MAX_FACTORS) sdm_die("top-k: %d factors not supported (1..%d)", pl.F, SDM_MAX_FACTORS);
    pl.N = 1;
    for (int f = 0; f < pl.F; f++) {
        pl.dims[f] = s->factor_dims[f];
        pl.N *= pl.dims[f];
        pl.key_dim += pl.dims[f];
        pl.key_dim4 += (pl.dims[f] + 3) & ~3;
        pl.sort_len[f] = sdm_next_pow2(pl.dims[f]);
        pl.sort_total += pl.sort_len[f];
        pl.sort_max = SDM_MAX(pl.sort_max, pl.sort_len[f]);
    }
    pl.k = k;
    pl.cap = SDM_MIN(2 * k, 256);
    if (k < 1 || k > pl.N) sdm_die("top-k: k = %d outside [1, N = %d]", k, pl.N);
    if (k >= 256) sdm_die("top-k: the GPU top-k supports k < 256 (got %d)", k);
    if (((double)pl.key_dim + 1.0) * pl.N >= 4294967296.0)
        sdm_die("top-k: (sum of factor widths + 1) * N must stay below 2^32 (tie-break key)");
    pl.n_table = sdm_topk_table_fill(pl.dims, pl.F, 0, 1, 0u, pl.cap, NULL, 0);
    uint32_t *tab = (uint32_t *)sdm_malloc(sizeof(uint32_t) * (size_t)pl.n_table);
    sdm_topk_table_fill(pl.dims, pl.F, 0, 1, 0u, pl.cap, tab, 0);
    pl.table = (uint32_t *)device_alloc(MEM_SCRATCH, sizeof(uint32_t) * (size_t)pl.n_table);
    device_upload(pl.table, tab, sizeof(uint32_t) * (size_t)pl.n_table);
    free(tab);
    // sorted kept factor keys, raw factor keys, candidates, selected keys (u64), table scores, histogram (u32)
    pl.smem_per_warp = 8 * ((size_t)pl.sort_total + pl.sort_max + pl.cap + k) + 4 * ((size_t)pl.n_table + 256);
    pl.smem_per_warp = (pl.smem_per_warp + 15) & ~(size_t)15;
    if (pl.smem_per_warp > 200 * 1024)
        sdm_die("top-k: factor widths too large for shared memory (%zu bytes per problem)", pl.smem_per_warp);
    pl.warps = (int)SDM_MAX(1, SDM_MIN(SDM_TOPK_WARPS_MAX, (96 * 1024) / pl.smem_per_warp));
    pl.smem_block = sdm_topk_block_smem(&pl);
    pl.block_ok = pl.sort_max <= SDM_TOPK_BLOCK_MAX_N && pl.smem_block <= 200 * 1024;
    return pl;
}

static inline void sdm_topk_plan_free(SdmTopkPlan *pl) {
    device_free(pl->table);
    pl->table = NULL;
}

// Descending bitonic sort of a[0..n) (n a power of two) by one warp in shared memory.
__device__ void sdm_warp_bitonic_sort_desc(unsigned long long *a, int n, int lane) {
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
__device__ uint32_t sdm_warp_kth_largest(const uint32_t *v, int stride, int n, int k, int *hist, int lane) {
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
            int t = __shfl_up_sync(SDM_FULL_MASK, incl, o);
            if (lane >= o) incl += t;
        }
        int excl = incl - own;
        int src = __ffs(__ballot_sync(SDM_FULL_MASK, excl < k && k <= incl)) - 1;
        int digit = 0, above = 0, acc = excl;
        bool found = false;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (!found && acc + c[j] >= k) { digit = 255 - 8 * lane - j; above = acc; found = true; }
            acc += c[j];
        }
        digit = __shfl_sync(SDM_FULL_MASK, digit, src);
        above = __shfl_sync(SDM_FULL_MASK, above, src);
        prefix |= (uint32_t)digit << shift;
        mask |= 255u << shift;
        k -= above;
        __syncwarp();
    }
    return prefix;
}

// Integer sum of v over the block (any order gives the same integer); red [SDM_TOPK_THREADS / 32]. All threads get it.
__device__ int sdm_block_sum_int(int v, int *red) {
    v = __reduce_add_sync(SDM_FULL_MASK, v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    int t = 0;
#pragma unroll
    for (int w = 0; w < SDM_TOPK_THREADS / 32; w++) t += red[w];
    __syncthreads();
    return t;
}

// hist[d] += 1 for every lane with in (all 32 lanes call it): the lanes sharing the first counted lane's digit add
// with one atomic (in the high digits most values share one bin, and a warp's same-address atomics serialise).
__device__ __forceinline__ void sdm_hist_add(int *hist, bool in, uint32_t d) {
    unsigned act = __ballot_sync(SDM_FULL_MASK, in);
    if (!act) return;
    int lane = threadIdx.x & 31, lead = __ffs(act) - 1;
    uint32_t d0 = __shfl_sync(SDM_FULL_MASK, d, lead);
    unsigned same = __ballot_sync(SDM_FULL_MASK, in && d == d0);
    if (lane == lead) atomicAdd(&hist[d0], __popc(same));
    else if (in && d != d0) atomicAdd(&hist[d], 1);
}

// The k-th largest (with multiplicity) of v[0..n) by the block (SDM_TOPK_THREADS threads; v written before the call):
// the radix select of sdm_warp_kth_largest with thread t scanning bin 255 - t. hist [2][256]: a pass clears the next
// pass's histogram during its scan, three barriers per pass. sc [SDM_TOPK_THREADS / 32 + 2].
__device__ uint32_t sdm_block_kth_largest(const uint32_t *v, int n, int k, int *hist, int *sc) {
    static_assert(SDM_TOPK_THREADS == 256, "one thread per histogram bin");
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31, nw = SDM_TOPK_THREADS / 32;
    uint32_t prefix = 0, mask = 0;
    hist[t] = 0;
    __syncthreads();
    for (int shift = 24, b = 0; shift >= 0; shift -= 8, b ^= 256) {
        for (int i0 = warp * 32; i0 < n; i0 += SDM_TOPK_THREADS) {
            uint32_t x = i0 + lane < n ? v[i0 + lane] : 0u;
            sdm_hist_add(hist + b, i0 + lane < n && (x & mask) == prefix, (x >> shift) & 255u);
        }
        __syncthreads();
        int c = hist[b + 255 - t], incl = c;
        hist[(b ^ 256) + t] = 0;
        for (int o = 1; o < 32; o <<= 1) {
            int u = __shfl_up_sync(SDM_FULL_MASK, incl, o);
            if (lane >= o) incl += u;
        }
        if (lane == 31) sc[warp] = incl;
        __syncthreads();
        int excl = incl - c;
        for (int w = 0; w < warp; w++) excl += sc[w];
        if (excl < k && k <= excl + c) { sc[nw] = 255 - t; sc[nw + 1] = excl; }
        __syncthreads();
        prefix |= (uint32_t)sc[nw] << shift;
        mask |= 255u << shift;
        k -= sc[nw + 1];
    }
    return prefix;
}

// #{j in [a, b) : o[j] > x}; a % 4 == 0 and o 16-byte aligned: 128-bit loads, every thread of a warp at the same
// address (broadcast).
__device__ __forceinline__ int sdm_count_gt(const uint32_t *o, int a, int b, uint32_t x) {
    int c = 0, j = a;
    for (; j + 4 <= b; j += 4) {
        uint4 q = *(const uint4 *)(o + j);
        c += (q.x > x) + (q.y > x) + (q.z > x) + (q.w > x);
    }
    for (; j < b; j++) c += o[j] > x;
    return c;
}

// Key of the grid point with sorted positions pos[f]: ord(float32 score) << 32 | (digit_sum * N + slot).
__device__ __forceinline__ unsigned long long sdm_grid_key(const SdmTopkPlan &pl, const unsigned long long *sorted,
                                                       const int *pos) {
    float v = 0.0f;
    uint32_t dsum = 0, slot = 0;
    int soff = 0;
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++)
        if (f < pl.F) {
            unsigned long long e = sorted[soff + pos[f]];
            float s = sdm_ord2f((uint32_t)(e >> 32));
            uint32_t idx = (uint32_t)e;
            v = f == 0 ? s : v + s;
            dsum += idx;
            slot = slot * (uint32_t)pl.dims[f] + idx;
            soff += pl.sort_len[f];
        }
    return ((unsigned long long)sdm_f2ord(v) << 32) | (dsum * (uint32_t)pl.N + slot);
}

// Positions of table entry pk (one byte per factor).
__device__ __forceinline__ void sdm_table_pos(uint32_t pk, int *pos) {
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++) pos[f] = (int)((pk >> (8 * f)) & 255u);
}

// Score word of table entry pk: ord(score) inside the kept grid (m[f] kept sub-keys per factor), else 0.
__device__ __forceinline__ uint32_t sdm_table_score(const SdmTopkPlan &pl, const unsigned long long *sorted,
                                                    const int *m, uint32_t pk) {
    int pos[SDM_MAX_FACTORS];
    sdm_table_pos(pk, pos);
    bool in = true;
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++)
        if (f < pl.F && pos[f] >= m[f]) in = false;
    return in ? (uint32_t)(sdm_grid_key(pl, sorted, pos) >> 32) : 0u;
}

// Key of point g of the kept grid (m[f] kept sub-keys per factor, the last factor fastest).
__device__ __forceinline__ unsigned long long sdm_kept_grid_key(const SdmTopkPlan &pl, const unsigned long long *sorted,
                                                                const int *m, unsigned long long g) {
    int pos[SDM_MAX_FACTORS];
#pragma unroll
    for (int f = SDM_MAX_FACTORS - 1; f >= 0; f--)
        if (f < pl.F) { pos[f] = (int)(g % (unsigned)m[f]); g /= (unsigned)m[f]; }
    return sdm_grid_key(pl, sorted, pos);
}

// Largest 64-bit threshold x with #(keys >= x) >= k over the whole kept grid (G points), by bisection on the bits,
// by one warp (THREADS = 32) or the block (THREADS = SDM_TOPK_THREADS; red as for sdm_block_sum_int).
template <int THREADS>
__device__ unsigned long long sdm_grid_kth_key(const SdmTopkPlan &pl, const unsigned long long *sorted, const int *m,
                                               unsigned long long G, int *red) {
    unsigned long long x = 0;
    for (int bit = 63; bit >= 0; bit--) {
        unsigned long long c = x | (1ull << bit);
        int cnt = 0;
        for (unsigned long long g = threadIdx.x % THREADS; g < G; g += THREADS)
            cnt += sdm_kept_grid_key(pl, sorted, m, g) >= c;
        cnt = THREADS == 32 ? __reduce_add_sync(SDM_FULL_MASK, cnt) : sdm_block_sum_int(cnt, red);
        if (cnt >= pl.k) x = c;
    }
    return x;
}

// The softmax's max and normaliser over the k selected keys sel[0..k) by one warp: lane L adds j = L, L + 32, ...,
// then the shuffle tree. The bits of the sum depend on the order of sel: both kernels fill it in the same order.
__device__ float2 sdm_topk_softmax_norm(const unsigned long long *sel, int k, float scale, int lane) {
    float mx = -INFINITY;
    for (int j = lane; j < k; j += 32) mx = fmaxf(mx, sdm_ord2f((uint32_t)(sel[j] >> 32)));
    mx = sdm_warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j < k; j += 32) sum += expf(scale * (sdm_ord2f((uint32_t)(sel[j] >> 32)) - mx));
    return make_float2(mx, core_warp_sum(sum));
}

// Writes selected key sel[j] of problem p at its rank by slot among sel_slot[0..k) (ascending slots); norm from
// sdm_topk_softmax_norm, gp = g[p] (writes) or unused.
__device__ __forceinline__ void sdm_topk_emit(const SdmTopkOut &o, int k, const unsigned long long *sel,
                                              const int *sel_slot, int j, int p, float2 norm, float gp) {
    int slot = sel_slot[j], pos = 0;
    for (int i = 0; i < k; i++) pos += sel_slot[i] < slot;
    float e = sdm_ord2f((uint32_t)(sel[j] >> 32));
    float w = expf(o.scale * (e - norm.x)) / norm.y;
    size_t at = (size_t)p * k + pos;
    o.slot[at] = slot;
    o.weight[at] = w;
    if (o.score) o.score[at] = e;
    if (o.gamma) o.gamma[at] = o.kwd ? gp * w : gp;
}

// One warp per problem p = token*H + h: scores are z[token*ldz + col0 + h*K + (factor blocks)].
__global__ void sdm_topk_forward_kernel(SdmTopkPlan pl, const void *z, bool fp32, int ldz, int col0, int H, int P,
                                        SdmTopkOut out) {
    extern __shared__ unsigned char sdm_topk_smem[];
    pdl_enter();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.x * pl.warps + warp;
    if (p >= P) return;
    unsigned long long *sorted = (unsigned long long *)(sdm_topk_smem + warp * pl.smem_per_warp);
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
            raw[i] = ((unsigned long long)sdm_f2ord(dtype_load(z, zrow + off + i, fp32)) << 32) | (uint32_t)i;
        __syncwarp();
        // the high words of the little-endian keys are the scores
        uint32_t t = sdm_warp_kth_largest((const uint32_t *)raw + 1, 2, n, min(k, n), hist, lane);
        int cnt = 0;
        for (int base = 0; base < n; base += 32) {
            int i = base + lane;
            bool keep = i < n && (uint32_t)(raw[i] >> 32) >= t;
            unsigned b = __ballot_sync(SDM_FULL_MASK, keep);
            if (keep) sorted[soff + cnt + __popc(b & ((1u << lane) - 1))] = raw[i];
            cnt += __popc(b);
        }
        int len = 1;
        while (len < cnt) len <<= 1;
        for (int i = cnt + lane; i < len; i += 32) sorted[soff + i] = 0ull;
        __syncwarp();
        sdm_warp_bitonic_sort_desc(sorted + soff, len, lane);
        m[f] = cnt;
        G *= (unsigned long long)cnt;
    }
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++)
        if (f >= pl.F) m[f] = 1;

    // 2. score the table points inside the kept grid (0 = outside)
    for (int r = lane; r < pl.n_table; r += 32) rval[r] = sdm_table_score(pl, sorted, m, pl.table[r]);
    __syncwarp();

    // 3. tau = the k-th largest table score
    uint32_t tau = sdm_warp_kth_largest(rval, 1, pl.n_table, k, hist, lane);
    int n_ge = 0;
    for (int r = lane; r < pl.n_table; r += 32) n_ge += rval[r] >= tau;
    n_ge = __reduce_add_sync(SDM_FULL_MASK, n_ge);

    if (n_ge < pl.cap || G <= (unsigned long long)pl.cap) {
        // 4a. the candidates (all grid points scoring >= tau) in table order, then the k best by rank
        int n_c = 0;
        for (int base = 0; base < pl.n_table; base += 32) {
            int r = base + lane;
            bool take = r < pl.n_table && rval[r] >= tau;
            unsigned b = __ballot_sync(SDM_FULL_MASK, take);
            if (take) {
                int pos[SDM_MAX_FACTORS];
                sdm_table_pos(pl.table[r], pos);
                cand[n_c + __popc(b & ((1u << lane) - 1))] = sdm_grid_key(pl, sorted, pos);
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
        // 4b. heavy ties: exact threshold over the whole kept grid, then the k keys above it in grid order
        unsigned long long x = sdm_grid_kth_key<32>(pl, sorted, m, G, NULL);
        int n_c = 0;
        for (unsigned long long base = 0; base < G; base += 32) {
            unsigned long long gi = base + lane;
            unsigned long long key = gi < G ? sdm_kept_grid_key(pl, sorted, m, gi) : 0ull;
            bool take = gi < G && key >= x;
            unsigned b = __ballot_sync(SDM_FULL_MASK, take);
            if (take) sel[n_c + __popc(b & ((1u << lane) - 1))] = key;
            n_c += __popc(b);
        }
    }
    __syncwarp();

    // 5. softmax over the k scores, order by ascending slot, write out
    float2 norm = sdm_topk_softmax_norm(sel, k, out.scale, lane);
    int *sel_slot = (int *)rval; // the table scores are no longer needed
    for (int j = lane; j < k; j += 32) sel_slot[j] = (int)((uint32_t)sel[j] % (uint32_t)pl.N);
    __syncwarp();
    float gp = out.gamma ? out.g[p] : 0.0f;
    for (int j = lane; j < k; j += 32) sdm_topk_emit(out, k, sel, sel_slot, j, p, norm, gp);
}

// One block of SDM_TOPK_THREADS threads per problem, the same results as sdm_topk_forward_kernel: every phase spread
// over the block, the per-factor radix select and bitonic sort replaced by ranks (one pass over the factor's
// scores per sub-key, no barriers), the candidates' ranks one thread each (n_c <= cap <= 256 = threads).
__global__ void __launch_bounds__(SDM_TOPK_THREADS)
    sdm_topk_block_kernel(SdmTopkPlan pl, const void *z, bool fp32, int ldz, int col0, int H, int P, SdmTopkOut out) {
    extern __shared__ __align__(16) unsigned char sdm_topk_bsmem[];
    pdl_enter();
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31, p = blockIdx.x, k = pl.k, nw = SDM_TOPK_THREADS / 32;
    unsigned long long *sorted = (unsigned long long *)sdm_topk_bsmem, *cand = sorted + pl.sort_total;
    unsigned long long *sel = cand + pl.cap;
    uint32_t *ords = (uint32_t *)(sorted + ((pl.sort_total + pl.cap + k + 1) & ~1)); // 16-byte aligned
    int *rnk = (int *)ords + pl.key_dim4;
    uint32_t *tab = (uint32_t *)rnk + pl.key_dim4, *rval = tab + pl.n_table;
    int *hist = (int *)rval + pl.n_table, *misc = hist + 512;
    // misc: radix scan [nw + 2], block sums [nw], kept counts [F], candidate count, kept thresholds [F], norm
    int *sc = misc, *red = sc + nw + 2, *mf = red + nw, *nc = mf + SDM_MAX_FACTORS;
    uint32_t *tf = (uint32_t *)nc + 1;
    float2 *norm_s = (float2 *)(misc + SDM_TOPK_MISC - 2); // 8-byte aligned: every region before has an even size
    static_assert(2 * (SDM_TOPK_THREADS / 32) + 3 + 2 * SDM_MAX_FACTORS <= SDM_TOPK_MISC - 2, "misc too small");
    size_t zrow = (size_t)(p / H) * ldz + col0 + (size_t)(p % H) * pl.key_dim;
    float gp = out.gamma ? out.g[p] : 0.0f; // loaded early: its latency overlaps the selection

    // 1. the sub-key ords (o_i = ord(score i), each factor's row 16-byte aligned) and the table, then per factor the
    //    descending position of key (o_i, i) among the n keys: rank_i = #{j : o_j > o_i} + #{j > i : o_j == o_i};
    //    t_f = the o of rank min(k, n) - 1, and the kept sub-keys (o >= t_f) are a prefix of that order:
    //    sorted[rank_i] = key_i, as the warp kernel's radix select + bitonic sort. Loops over i0 are warp-uniform.
    for (int r = t; r < pl.n_table; r += SDM_TOPK_THREADS) tab[r] = pl.table[r];
    if (t < SDM_MAX_FACTORS) mf[t] = 0;
    if (t == 0) *nc = 0;
    for (int f = 0, off = 0, o4 = 0; f < pl.F; off += pl.dims[f], o4 += (pl.dims[f] + 3) & ~3, f++)
        for (int i = t; i < pl.dims[f]; i += SDM_TOPK_THREADS)
            ords[o4 + i] = sdm_f2ord(dtype_load(z, zrow + off + i, fp32));
    __syncthreads();
    for (int f = 0, o4 = 0; f < pl.F; o4 += (pl.dims[f] + 3) & ~3, f++) {
        const int n = pl.dims[f];
        const uint32_t *o = ords + o4;
        for (int i0 = warp * 32; i0 < n; i0 += SDM_TOPK_THREADS) {
            int i = i0 + lane, hi = min(i0 + 32, n);
            if (i >= n) continue;
            uint32_t x = o[i];
            // j < i0: o_j > x; j >= hi (all > i): o_j >= x, i.e. o_j > x - 1 unless x = 0; the warp's own 32 exactly
            int r = sdm_count_gt(o, 0, i0, x) + (x ? sdm_count_gt(o, hi, n, x - 1) : n - hi);
            for (int j = i0; j < hi; j++) r += o[j] > x || (o[j] == x && j > i);
            rnk[o4 + i] = r;
            if (r == min(k, n) - 1) tf[f] = x;
        }
    }
    __syncthreads();
    for (int f = 0, o4 = 0, soff = 0; f < pl.F; o4 += (pl.dims[f] + 3) & ~3, soff += pl.sort_len[f], f++)
        for (int i0 = warp * 32; i0 < pl.dims[f]; i0 += SDM_TOPK_THREADS) {
            int i = i0 + lane;
            bool keep = i < pl.dims[f] && ords[o4 + i] >= tf[f];
            if (keep) sorted[soff + rnk[o4 + i]] = ((unsigned long long)ords[o4 + i] << 32) | (uint32_t)i;
            int c = __reduce_add_sync(SDM_FULL_MASK, keep);
            if (lane == 0) atomicAdd(&mf[f], c);
        }
    __syncthreads();
    int m[SDM_MAX_FACTORS];
    unsigned long long G = 1;
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++) {
        m[f] = f < pl.F ? mf[f] : 1;
        G *= (unsigned long long)m[f];
    }

    // 2. score the table points inside the kept grid (0 = outside); 3. tau = the k-th largest table score
    for (int r = t; r < pl.n_table; r += SDM_TOPK_THREADS) rval[r] = sdm_table_score(pl, sorted, m, tab[r]);
    uint32_t tau = sdm_block_kth_largest(rval, pl.n_table, k, hist, sc);
    int n_ge = 0;
    for (int r = t; r < pl.n_table; r += SDM_TOPK_THREADS) n_ge += rval[r] >= tau;
    n_ge = sdm_block_sum_int(n_ge, red);

    if (n_ge < pl.cap || G <= (unsigned long long)pl.cap) {
        // 4a. the candidates in any order (slots from a shared counter, one atomic per warp), ranks fix sel
        for (int r0 = warp * 32; r0 < pl.n_table; r0 += SDM_TOPK_THREADS) {
            int r = r0 + lane;
            bool take = r < pl.n_table && rval[r] >= tau;
            unsigned b = __ballot_sync(SDM_FULL_MASK, take);
            int base = lane == 0 && b ? atomicAdd(nc, __popc(b)) : 0;
            base = __shfl_sync(SDM_FULL_MASK, base, 0);
            if (take) {
                int pos[SDM_MAX_FACTORS];
                sdm_table_pos(tab[r], pos);
                cand[base + __popc(b & ((1u << lane) - 1))] = sdm_grid_key(pl, sorted, pos);
            }
        }
        __syncthreads();
        int n_c = *nc;
        if (t < n_c) {
            unsigned long long key = cand[t];
            int rank = 0;
            for (int j = 0; j < n_c; j++) rank += cand[j] > key;
            if (rank < k) sel[rank] = key;
        }
    } else {
        // 4b. heavy ties: exact threshold over the whole kept grid, then the k keys above it in grid order (as the
        //     warp kernel: the order of sel sets the bits of the softmax sum)
        unsigned long long x = sdm_grid_kth_key<SDM_TOPK_THREADS>(pl, sorted, m, G, red);
        for (unsigned long long base = 0, n_c = 0; base < G; base += SDM_TOPK_THREADS) {
            unsigned long long gi = base + t;
            unsigned long long key = gi < G ? sdm_kept_grid_key(pl, sorted, m, gi) : 0ull;
            bool take = gi < G && key >= x;
            unsigned b = __ballot_sync(SDM_FULL_MASK, take);
            if (lane == 0) red[warp] = __popc(b);
            __syncthreads();
            int at = (int)n_c + __popc(b & ((1u << lane) - 1));
            for (int w = 0; w < nw; w++) {
                if (w < warp) at += red[w];
                n_c += red[w];
            }
            if (take) sel[at] = key;
            __syncthreads();
        }
    }
    __syncthreads();

    // 5. softmax (warp 0, as the warp kernel), order by ascending slot, write out
    int *sel_slot = (int *)rval; // the table scores are no longer needed
    if (t < k) sel_slot[t] = (int)((uint32_t)sel[t] % (uint32_t)pl.N);
    if (warp == 0) {
        float2 nm = sdm_topk_softmax_norm(sel, k, out.scale, lane);
        if (lane == 0) *norm_s = nm;
    }
    __syncthreads();
    if (t < k) sdm_topk_emit(out, k, sel, sel_slot, t, p, *norm_s, gp);
}

static inline void sdm_topk_forward(const SdmTopkPlan *pl, const void *z, Dtype zt, int ldz, int col0, int H, int P,
                                float scale, const float *g, int kwd, int *slot, float *weight, float *score,
                                float *gamma, cudaStream_t s) {
    SdmTopkOut out = {slot, weight, score, gamma, g, kwd, scale};
    if (pl->path == SDM_TOPK_BLOCK && !pl->block_ok)
        sdm_die("top-k: the block kernel supports factor widths <= %d", SDM_TOPK_BLOCK_MAX_N);
    bool block = pl->path == SDM_TOPK_BLOCK || (pl->path == SDM_TOPK_AUTO && pl->block_ok &&
                                                     P <= SDM_TOPK_BLOCK_MAX_P);
    void (*kernel)(SdmTopkPlan, const void *, bool, int, int, int, int, SdmTopkOut) =
        block ? sdm_topk_block_kernel : sdm_topk_forward_kernel;
    size_t smem = block ? pl->smem_block : pl->smem_per_warp * pl->warps;
    if (smem > 48 * 1024)
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    launch_pdl(kernel, block ? P : ceil_div(P, pl->warps), block ? SDM_TOPK_THREADS : 32 * pl->warps, smem, s, *pl, z,
               zt == DT_FP32, ldz, col0, H, P, out);
}

// =================================================================================================================
// Addressing backward, one warp per problem: the softmax backward de = scale * w * (dw - <w, dw>), then the
// routing of each selected score's gradient to its F sub-key entries (docs/SDM.md#product-key-addressing) in a fixed
// order (lane f adds factor f's entries for j = 0..k-1), written as the full K-wide block of dz (zeros where nothing
// was selected). For writes (gates != 0) it also chains key-weighted decay and the gates
// (docs/SDM.md#layer-chain-rule):
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
} SdmWriteGateArgs;

__global__ void sdm_address_backward_kernel(SdmTopkPlan pl, const int *slot, const float *w, const float *dw,
                                            float scale, int P, int H, void *dz, bool fp32, int ldz, int col0,
                                            int gates, SdmWriteGateArgs ga) {
    extern __shared__ float sdm_addr_smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.x * (blockDim.x >> 5) + warp;
    if (p >= P) return;
    const int k = pl.k, K = pl.key_dim;
    float *acc = sdm_addr_smem + warp * (K + k), *de = acc + K;
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
    wdw = core_warp_sum(wdw);
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
    for (int i = lane; i < K; i += 32) dtype_store(dz, zrow + col0 + (size_t)h * K + i, acc[i], fp32);
    if (gates) {
        dg = core_warp_sum(dg);
        if (lane == 0) {
            size_t tok = (size_t)(p / H);
            float a = dtype_load(ga.z, tok * ldz + ga.col_a + h, fp32);
            float A = expf(dtype_load(ga.A_log, h, fp32)), dtb = dtype_load(ga.dt_bias, h, fp32);
            float da = dg * (-A * sdm_sigmoid(a + dtb));
            float b = ga.beta[p], dc = ga.dbeta[p] * b * (1.0f - b);
            dtype_store(dz, zrow + ga.col_a + h, da, fp32);
            dtype_store(dz, zrow + ga.col_c + h, dc, fp32);
            float *gg = ga.gate_grad + tok * 3 * H;
            gg[h] = da;
            gg[H + h] = dc;
            gg[2 * H + h] = dg * gp;
        }
    }
}

static inline void sdm_address_backward(const SdmTopkPlan *pl, const int *slot, const float *w, const float *dw,
                                        float scale, int P, int H, void *dz, Dtype zt, int ldz, int col0, int gates,
                                        const SdmWriteGateArgs *ga, cudaStream_t s) {
    const int warps = 4;
    size_t smem = sizeof(float) * (size_t)(pl->key_dim + pl->k) * warps;
    if (smem > 48 * 1024)
        cudaCheck(cudaFuncSetAttribute(sdm_address_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem));
    SdmWriteGateArgs none;
    memset(&none, 0, sizeof(none));
    sdm_address_backward_kernel<<<ceil_div(P, warps), 32 * warps, smem, s>>>(
        *pl, slot, w, dw, scale, P, H, dz, zt == DT_FP32, ldz, col0, gates, gates ? *ga : none);
    cudaCheckLast();
}

#endif
