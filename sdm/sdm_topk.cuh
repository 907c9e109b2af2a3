// sdm/sdm_topk.cuh: the SDM layer's addressing on the GPU (docs/SDM.md#gates, docs/SDM.md#product-key-addressing,
// docs/SDM.md#tie-rule, docs/SDM.md#key-weighted-decay, docs/SDM.md#layer-chain-rule). Forward (sdm_topk_forward):
// the gates and values of every token, and for each of one or two jobs (the write and the read addressing, one launch)
// and every problem p = token*H + h, the product-key scores of its K = sum of factor widths columns of the fused
// projection z [tokens, ldz] (bf16 or fp32), the k best slots by the exact radix top-k, sorted by ascending slot:
// slot [P,k] int32, weight [P,k] = softmax(scale * score) fp32, optionally score [P,k] and the write decays gamma
// [P,k]. Backward: the softmax backward and the routing of each score's gradient to its sub-key entries, written as
// the K-wide block of dz, and for writes the gate gradients (key-weighted decay, a, c) into dz and the fp32 per-token
// gate terms gate_grad [tokens, 3H]. One warp per problem (many problems: training, prefill) or one block per problem
// (few: decode, where the block kernel also forms the gates, so that the whole addressing is one launch); integer
// histograms and counts only: deterministic, and the two forward kernels agree bit for bit.
#ifndef SDM_SDM_TOPK_CUH
#define SDM_SDM_TOPK_CUH

#include "core/cuda_common.cuh"
#include "core/matmul.cuh"
#include "sdm/sdm_common.cuh"
#include "sdm/sdm_dims.h"

// =================================================================================================================
// Gates and values (docs/SDM.md#gates) of every token: v[tok, :] = z[tok, col_v : col_v + D] in fp32 (the op's
// input), g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(c), with a = z[tok, col_a + h], c = z[tok, col_c + h].
// Written by sdm_unpack_kernel (one block per token) before the warp kernel, or by the block kernel's write problems.
// =================================================================================================================

typedef struct {
    const void *A_log, *dt_bias; // [H] compute dtype
    int col_v, col_a, col_c, D;  // columns of z; model width
    float *v, *g, *beta;         // [tokens, D], [tokens, H], [tokens, H]
} SdmGates;

__global__ void sdm_unpack_kernel(const void *z, bool fp32, int ldz, int H, SdmGates gt) {
    pdl_enter();
    size_t tok = blockIdx.x, row = tok * ldz;
    for (int i = threadIdx.x; i < gt.D; i += blockDim.x) gt.v[tok * gt.D + i] = dtype_load(z, row + gt.col_v + i, fp32);
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float a = dtype_load(z, row + gt.col_a + h, fp32), c = dtype_load(z, row + gt.col_c + h, fp32);
        gt.g[tok * H + h] = sdm_gate_decay(a, dtype_load(gt.A_log, h, fp32), dtype_load(gt.dt_bias, h, fp32));
        gt.beta[tok * H + h] = sdm_sigmoid(c);
    }
}

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
// launcher takes for small P (decode). Either kernel runs one or two jobs (plans, score columns and outputs) over
// the same problems in one launch: blocks [j * per_job, (j + 1) * per_job) do job j.
// =================================================================================================================

#define SDM_TOPK_WARPS_MAX 4
#define SDM_TOPK_THREADS 512        // threads of the block kernel
#define SDM_TOPK_BLOCK_MAX_N 1024  // widest factor for the block kernel (its sorts hold up to 32 keys a lane)
// Largest P for the block kernel. Two of its blocks share an SM (512 threads of 64 registers, ~17 KB at the flagship
// shape), so P problems take about ceil(P / 264) times its latency, while the warp kernel's first wave (~2000
// problems) takes ~38 us whatever P. Measured on the H200 with the older radix-select block kernel, one block an SM
// (bench_sdm_layer 3 prints both over P; 0b9d593): 30.8 vs 35.1 us at 256 problems, 60.3 vs 35.5 at 512.
// Training (P = 32768) stays on the warp kernel; decode batches of up to 128 streams of 2 heads take the block one.
#ifndef SDM_TOPK_BLOCK_MAX_P // -D to move the threshold when measuring
#define SDM_TOPK_BLOCK_MAX_P 256
#endif
#define SDM_TOPK_JOBS 2 // write and read addressing
#define SDM_TOPK_MISC 24 // ints of the block kernel's misc region

typedef enum { SDM_TOPK_AUTO = 0, SDM_TOPK_WARP, SDM_TOPK_BLOCK } SdmTopkPath;

typedef struct {
    int F, dims[SDM_MAX_FACTORS], N, key_dim; // factor widths (first factor most significant), N = prod, K = sum
    int k, cap;                               // slots selected per problem; table bound min(2k, 256)
    int n_table;                              // |R_cap| (positions clipped to the factor widths)
    int n_front;                              // frontier points (sdm_topk_frontier), stored after the table
    uint32_t *table;                          // device [n_table + n_front]: positions, one byte per factor (f at 8f)
    int sort_len[SDM_MAX_FACTORS];            // per-factor sort length (next power of two >= n_f)
    int sort_total;                           // sum of sort_len
    int sort_max;                             // max of sort_len (raw-score staging buffer)
    size_t smem_per_warp;                     // shared memory per warp (bytes)
    int warps;                                // problems per block
    // block kernel shared memory (byte offsets): u64 sorted [sort_total] at 0, candidates [n_table + 1, even],
    // ranked candidates / selected keys [n_table]; u32 table and frontier [n_table + n_front]; int selected slots
    // [k], misc [SDM_TOPK_MISC]
    int off_cand, off_sel, off_tab, off_slot, off_misc;
    size_t smem_block;                        // total (bytes)
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

// One selection over the P problems: its plan, the first score column of head 0 in z, its outputs.
typedef struct {
    const SdmTopkPlan *pl;
    int col0;
    SdmTopkOut out;
} SdmTopkJob;

// What a launch of either forward kernel reads (a __grid_constant__ parameter: no copy per thread).
typedef struct {
    SdmTopkPlan pl[SDM_TOPK_JOBS];
    int col0[SDM_TOPK_JOBS];
    SdmTopkOut out[SDM_TOPK_JOBS];
    const void *z;
    bool fp32;
    int ldz, H, P, per_job; // per_job: blocks per job
    int warps;              // warp kernel: problems per block, and the bytes of shared memory of each
    size_t warp_smem;
    SdmGates gates;         // gates.g != NULL: the block kernel's write problems (job 0) form the gates
    // A product the addressing does not read, in its launch (SdmTopkSide): the block kernel's blocks from side_block0
    // on are the blocks of a one-row bf16 GEMV (core/matmul_small_m.cuh) of side on side_x [side_K].
    MatmulParts side;
    const void *side_x;
    int side_K, side_groups, side_block0;
} SdmTopkArgs;

// That product (sdm_topk_forward): y [1, N] = x [1, K] · W[N, K]ᵀ + bias, bf16 rows of 16-byte multiples at 16-byte
// addresses (a GEMV's).
typedef struct {
    const void *w, *x, *bias;
    void *y;
    int N, K;
} SdmTopkSide;

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

// The minimal points of the table whose down-set holds k points: prod_f (p_f + 1) >= k, and < k once any p_f > 0
// is lowered by one. Stored to out; returns their count. Each has p_f < min(k, n_f) <= m_f, so it lies in the kept
// grid, where at least k points score >= its score: each one's score is a lower bound of tau (the block kernel's
// candidates score at least the largest of them).
static inline int sdm_topk_frontier(int F, int k, const uint32_t *tab, int n_table, uint32_t *out) {
    int n = 0;
    for (int r = 0; r < n_table; r++) {
        int pos[SDM_MAX_FACTORS];
        long long prod = 1;
        for (int f = 0; f < F; f++) { pos[f] = (int)((tab[r] >> (8 * f)) & 255u); prod *= pos[f] + 1; }
        bool minimal = prod >= k;
        for (int f = 0; f < F; f++)
            if (pos[f] > 0 && prod / (pos[f] + 1) * pos[f] >= k) minimal = false;
        if (minimal) out[n++] = tab[r];
    }
    return n;
}

// The block kernel's shared-memory layout of plan pl (see SdmTopkPlan); regions 16-byte aligned.
static inline void sdm_topk_block_layout(SdmTopkPlan *pl) {
    size_t o = (8 * (size_t)pl->sort_total + 15) & ~(size_t)15;
    pl->off_cand = (int)o;  o += 8 * (((size_t)pl->n_table + 2) & ~(size_t)1);
    pl->off_sel = (int)o;   o += 8 * (((size_t)pl->n_table + 1) & ~(size_t)1);
    pl->off_tab = (int)o;   o += 4 * (((size_t)pl->n_table + pl->n_front + 3) & ~(size_t)3);
    pl->off_slot = (int)o;  o += 4 * (((size_t)pl->k + 3) & ~(size_t)3);
    pl->off_misc = (int)o;  o += 4 * (size_t)SDM_TOPK_MISC;
    pl->smem_block = o;
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
    uint32_t *tab = (uint32_t *)sdm_malloc(sizeof(uint32_t) * 2 * (size_t)pl.n_table);
    sdm_topk_table_fill(pl.dims, pl.F, 0, 1, 0u, pl.cap, tab, 0);
    pl.n_front = sdm_topk_frontier(pl.F, k, tab, pl.n_table, tab + pl.n_table);
    size_t tab_bytes = sizeof(uint32_t) * (size_t)(pl.n_table + pl.n_front);
    pl.table = (uint32_t *)device_alloc(MEM_SCRATCH, tab_bytes);
    device_upload(pl.table, tab, tab_bytes);
    free(tab);
    // sorted kept factor keys, raw factor keys, candidates, selected keys (u64), table scores, histogram (u32)
    pl.smem_per_warp = 8 * ((size_t)pl.sort_total + pl.sort_max + pl.cap + k) + 4 * ((size_t)pl.n_table + 256);
    pl.smem_per_warp = (pl.smem_per_warp + 15) & ~(size_t)15;
    if (pl.smem_per_warp > 200 * 1024)
        sdm_die("top-k: factor widths too large for shared memory (%zu bytes per problem)", pl.smem_per_warp);
    pl.warps = (int)SDM_MAX(1, SDM_MIN(SDM_TOPK_WARPS_MAX, (96 * 1024) / pl.smem_per_warp));
    sdm_topk_block_layout(&pl);
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

// A radix pass's 256-bin histogram keeps digit d at sdm_hist_bin(d), transposed (d % 8 major), so that the lanes of
// sdm_radix_pick, each reading 8 consecutive digits, read 32 consecutive words at a time: no bank conflicts.
__device__ __forceinline__ int sdm_hist_bin(uint32_t d) { return (int)((d & 7u) * 32u + (d >> 3)); }

// One pass of a radix select by one warp (every lane gets the same): from the 256-bin histogram of the pass's digit,
// the digit of the k-th largest value (.x), how many values lie in the bins above it (.y) and in its bin (.z).
// Lane L owns digits 255 - 8L - j (j = 0..7): lanes in descending digit order.
__device__ int3 sdm_radix_pick(const int *hist, int k, int lane) {
    int c[8], own = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) { c[j] = hist[sdm_hist_bin(255 - 8 * lane - j)]; own += c[j]; }
    int incl = own;
    for (int o = 1; o < 32; o <<= 1) {
        int t = __shfl_up_sync(SDM_FULL_MASK, incl, o);
        if (lane >= o) incl += t;
    }
    int excl = incl - own;
    int src = __ffs(__ballot_sync(SDM_FULL_MASK, excl < k && k <= incl)) - 1;
    int digit = 0, above = 0, in_bin = 0, acc = excl;
    bool found = false;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (!found && acc + c[j] >= k) { digit = 255 - 8 * lane - j; above = acc; in_bin = c[j]; found = true; }
        acc += c[j];
    }
    return make_int3(__shfl_sync(SDM_FULL_MASK, digit, src), __shfl_sync(SDM_FULL_MASK, above, src),
                     __shfl_sync(SDM_FULL_MASK, in_bin, src));
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
            if ((x & mask) == prefix) atomicAdd(&hist[sdm_hist_bin((x >> shift) & 255u)], 1);
        }
        __syncwarp();
        int3 d = sdm_radix_pick(hist, k, lane);
        prefix |= (uint32_t)d.x << shift;
        mask |= 255u << shift;
        k -= d.y;
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

// Key of table entry pk inside the kept grid (m[f] kept sub-keys per factor), else 0.
__device__ __forceinline__ unsigned long long sdm_table_key(const SdmTopkPlan &pl, const unsigned long long *sorted,
                                                            const int *m, uint32_t pk) {
    int pos[SDM_MAX_FACTORS];
    sdm_table_pos(pk, pos);
    bool in = true;
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++)
        if (f < pl.F && pos[f] >= m[f]) in = false;
    return in ? sdm_grid_key(pl, sorted, pos) : 0ull;
}

// Score word of table entry pk: ord(score) inside the kept grid, else 0.
__device__ __forceinline__ uint32_t sdm_table_score(const SdmTopkPlan &pl, const unsigned long long *sorted,
                                                    const int *m, uint32_t pk) {
    return (uint32_t)(sdm_table_key(pl, sorted, m, pk) >> 32);
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

// The softmax's max and normaliser over the k selected keys sel[0..k) by one warp: the max as the largest score word
// (exact, any order), the sum with lane L adding j = L, L + 32, ..., then the shuffle tree. The bits of the sum
// depend on the order of sel: both kernels fill it in the same order.
__device__ float2 sdm_topk_softmax_norm(const unsigned long long *sel, int k, float scale, int lane) {
    uint32_t mo = 0;
    for (int j = lane; j < k; j += 32) mo = max(mo, (uint32_t)(sel[j] >> 32));
    const float mx = sdm_ord2f(__reduce_max_sync(SDM_FULL_MASK, mo));
    float sum = 0.0f;
    for (int j = lane; j < k; j += 32) sum += expf(scale * (sdm_ord2f((uint32_t)(sel[j] >> 32)) - mx));
    return make_float2(mx, core_warp_sum(sum));
}

// Writes selected key sel[j] (slot `slot`) of problem p at position pos, its rank among the k selected slots (ascending
// slots); norm from sdm_topk_softmax_norm, gp = g[p] (writes) or unused.
__device__ __forceinline__ void sdm_topk_emit(const SdmTopkOut &o, int k, const unsigned long long *sel, int j,
                                              int slot, int pos, int p, float2 norm, float gp) {
    float e = sdm_ord2f((uint32_t)(sel[j] >> 32));
    float w = expf(o.scale * (e - norm.x)) / norm.y;
    size_t at = (size_t)p * k + pos;
    o.slot[at] = slot;
    o.weight[at] = w;
    if (o.score) o.score[at] = e;
    if (o.gamma) o.gamma[at] = o.kwd ? gp * w : gp;
}

// One warp per problem p = token*H + h of job blockIdx.x / per_job: scores are
// z[token*ldz + col0 + h*K + (factor blocks)]. Reads g (writes) from a.out: the gates are formed before it.
__global__ void sdm_topk_forward_kernel(const __grid_constant__ SdmTopkArgs a) {
    extern __shared__ unsigned char sdm_topk_smem[];
    pdl_enter();
    const int job = blockIdx.x / a.per_job, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const SdmTopkPlan &pl = a.pl[job];
    const SdmTopkOut &out = a.out[job];
    int p = (blockIdx.x % a.per_job) * a.warps + warp;
    if (p >= a.P) return;
    unsigned long long *sorted = (unsigned long long *)(sdm_topk_smem + warp * a.warp_smem);
    unsigned long long *raw = sorted + pl.sort_total, *cand = raw + pl.sort_max, *sel = cand + pl.cap;
    uint32_t *rval = (uint32_t *)(sel + pl.k);
    int *hist = (int *)(rval + pl.n_table);
    const int k = pl.k;
    size_t zrow = (size_t)(p / a.H) * a.ldz + a.col0[job] + (size_t)(p % a.H) * pl.key_dim;

    // 1. per factor: the kept sub-keys (score >= the min(k, n_f)-th largest, so every tie of the last one stays),
    //    then sorted descending (ties: larger sub-key index first). Keys: ord(score) << 32 | sub-key index.
    int m[SDM_MAX_FACTORS];
    unsigned long long G = 1;
    for (int f = 0, off = 0, soff = 0; f < pl.F; off += pl.dims[f], soff += pl.sort_len[f], f++) {
        int n = pl.dims[f];
        for (int i = lane; i < n; i += 32)
            raw[i] = ((unsigned long long)sdm_f2ord(dtype_load(a.z, zrow + off + i, a.fp32)) << 32) | (uint32_t)i;
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
    for (int j = lane; j < k; j += 32) {
        int pos = 0;
        for (int i = 0; i < k; i++) pos += sel_slot[i] < sel_slot[j];
        sdm_topk_emit(out, k, sel, j, sel_slot[j], pos, p, norm, gp);
    }
}

// Sort keys of one factor's sub-keys in the block kernel, ordered as (ord(score), index): u64 ord << 32 | i, or for
// bf16 scores u32 (high half of ord) | i, since a bf16 score's ord has the low half 0 (positive) or 0xffff (negative):
// half the shuffles and one min/max instruction an exchange. wide() gives the warp kernel's u64 key.
template <typename Key> struct SdmSortKey;
template <> struct SdmSortKey<uint32_t> {
    static __device__ __forceinline__ uint32_t make(uint32_t o, int i) { return (o & 0xffff0000u) | (uint32_t)i; }
    static __device__ __forceinline__ uint32_t ord(uint32_t x) {
        uint32_t hi = x & 0xffff0000u;
        return hi | ((hi & 0x80000000u) ? 0u : 0xffffu);
    }
    static __device__ __forceinline__ unsigned long long wide(uint32_t x) {
        return ((unsigned long long)ord(x) << 32) | (x & 0xffffu);
    }
};
template <> struct SdmSortKey<unsigned long long> {
    static __device__ __forceinline__ unsigned long long make(uint32_t o, int i) {
        return ((unsigned long long)o << 32) | (uint32_t)i;
    }
    static __device__ __forceinline__ uint32_t ord(unsigned long long x) { return (uint32_t)(x >> 32); }
    static __device__ __forceinline__ unsigned long long wide(unsigned long long x) { return x; }
};

// Descending bitonic sort of a warp's 32 E keys, position lane * E + j in x[j] (E a power of two): pairs closer than
// E within a lane's registers, farther ones with lane ^ (stride / E) by shuffles. No shared memory, no barrier.
template <typename Key, int E>
__device__ __forceinline__ void sdm_warp_sort_desc_regs(Key (&x)[E], int lane) {
    constexpr int LOG = 5 + (E >= 2) + (E >= 4) + (E >= 8) + (E >= 16) + (E >= 32);
    static_assert(32 * E == 1 << LOG, "E a power of two, at most 32");
#pragma unroll
    for (int ls = 1; ls <= LOG; ls++)
#pragma unroll
        for (int lt = ls - 1; lt >= 0; lt--) {
            const int size = 1 << ls, stride = 1 << lt;
            if (stride >= E) {
                // the pair's first position keeps the larger key in a descending run, the smaller in an ascending one
                const bool keep_max = (((lane * E) & stride) == 0) == (((lane * E) & size) == 0);
#pragma unroll
                for (int j = 0; j < E; j++) {
                    Key y = __shfl_xor_sync(SDM_FULL_MASK, x[j], stride / E);
                    x[j] = keep_max ? max(x[j], y) : min(x[j], y);
                }
            } else {
#pragma unroll
                for (int j = 0; j < E; j++)
                    if ((j & stride) == 0) {
                        const bool desc = ((lane * E + j) & size) == 0;
                        Key hi = max(x[j], x[j + stride]), lo = min(x[j], x[j + stride]);
                        x[j] = desc ? hi : lo;
                        x[j + stride] = desc ? lo : hi;
                    }
            }
        }
}

// One warp of the block kernel: a factor's n sub-key scores (sub-key i at z[zk + i]) sorted descending in registers,
// the kept ones (ord >= that of the min(k, n)-th: every tie of the last stays) stored to sorted[0..m) as the warp
// kernel's keys, in its order; returns m.
template <typename Key, int E>
__device__ int sdm_factor_sort(const void *z, size_t zk, bool fp32, int n, int kth, unsigned long long *sorted,
                               int lane) {
    typedef SdmSortKey<Key> SK;
    Key x[E];
#pragma unroll
    for (int j = 0; j < E; j++) { // sub-key j * 32 + lane (coalesced); 0 sorts below every key
        int i = j * 32 + lane;
        x[j] = i < n ? SK::make(sdm_f2ord(dtype_load(z, zk + i, fp32)), i) : (Key)0;
    }
    sdm_warp_sort_desc_regs(x, lane);
    Key xk = 0; // register (kth - 1) % E, masked in (a select by index would put x in local memory)
#pragma unroll
    for (int j = 0; j < E; j++) xk |= x[j] & ((Key)0 - (Key)(j == (kth - 1) % E));
    const uint32_t thr = SK::ord(__shfl_sync(SDM_FULL_MASK, xk, (kth - 1) / E));
    int cnt = 0;
#pragma unroll
    for (int j = 0; j < E; j++) cnt += lane * E + j < n && SK::ord(x[j]) >= thr;
    const int m = __reduce_add_sync(SDM_FULL_MASK, cnt);
#pragma unroll
    for (int j = 0; j < E; j++)
        if (lane * E + j < m) sorted[lane * E + j] = SK::wide(x[j]);
    return m;
}

// One block of SDM_TOPK_THREADS threads per problem p = blockIdx.x % P of job blockIdx.x / P, the results of
// sdm_topk_forward_kernel bit for bit, with three barriers: warp f sorts factor f in registers (E keys a lane; all
// factor widths <= 32 E); every warp takes the best frontier score L <= tau; the table points of the kept grid
// scoring >= L are the candidates, each one's rank among them counted: the first k in rank order are the selection
// unless the table holds cap or more points scoring >= tau (then the warp kernel's whole-grid search, also here).
// Each warp then forms the softmax norm and writes its share of the outputs. With a.gates, job 0's blocks also form
// their problem's gates and values (sdm_unpack_kernel's work, by the warps that sort nothing) and take g from them:
// the whole addressing in one launch.
template <int E>
__global__ void __launch_bounds__(SDM_TOPK_THREADS, E <= 8 ? 2 : 1)
sdm_topk_block_kernel(const __grid_constant__ SdmTopkArgs a) {
    extern __shared__ __align__(16) unsigned char sdm_topk_bsmem[];
    static_assert(SDM_MAX_FACTORS < SDM_TOPK_THREADS / 32, "a warp per factor and one more");
    if ((int)blockIdx.x >= a.side_block0) { // a block of the side product, in its first MATMUL_GEMV_THREADS threads
        if (threadIdx.x < MATMUL_GEMV_THREADS)
            matmul_gemv_block<__nv_bfloat16, __nv_bfloat16, 1, MATMUL_OUT_PLAIN>(
                a.side, (const __nv_bfloat16 *)a.side_x, a.side_K, a.side_groups, blockIdx.x - a.side_block0,
                gridDim.x - a.side_block0, (uint4 *)sdm_topk_bsmem);
        return;
    }
    const int job = blockIdx.x / a.P, p = blockIdx.x % a.P, tok = p / a.H, h = p % a.H;
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31, nw = SDM_TOPK_THREADS / 32;
    const SdmTopkPlan &pl = a.pl[job];
    const SdmTopkOut &out = a.out[job];
    const int k = pl.k, F = pl.F;
    unsigned char *sm = sdm_topk_bsmem;
    unsigned long long *sorted = (unsigned long long *)sm, *cand = (unsigned long long *)(sm + pl.off_cand);
    unsigned long long *sel = (unsigned long long *)(sm + pl.off_sel);
    uint32_t *tab = (uint32_t *)(sm + pl.off_tab);
    int *sel_slot = (int *)(sm + pl.off_slot), *misc = (int *)(sm + pl.off_misc);
    // misc: kept counts [SDM_MAX_FACTORS], candidate counter, g of the problem, block sums [nw]
    int *m_s = misc, *ccnt = misc + SDM_MAX_FACTORS, *red = misc + SDM_MAX_FACTORS + 2;
    float *gp_s = (float *)(misc + SDM_MAX_FACTORS + 1);
    static_assert(SDM_MAX_FACTORS + 2 + SDM_TOPK_THREADS / 32 <= SDM_TOPK_MISC, "misc layout");

    // 0. before the wait, constant data only: the table and frontier; zero candidates (the zero after the last one
    //    pads the pairs of step 3), the counter
    for (int r = t; r < pl.n_table + pl.n_front; r += SDM_TOPK_THREADS) tab[r] = pl.table[r];
    for (int r = t; r <= pl.n_table; r += SDM_TOPK_THREADS) cand[r] = 0ull;
    if (t == 0) *ccnt = 0;
    pdl_enter();

    // 1. warp f < F: factor f's kept sub-keys, sorted, and their count m_f; the other warps of job 0's blocks: the
    //    gates and values; g of the problem
    const size_t zrow = (size_t)tok * a.ldz;
    const bool gates = job == 0 && a.gates.g;
    if (warp < F) {
        size_t zk = zrow + a.col0[job] + (size_t)h * pl.key_dim;
        int soff = 0;
        for (int f = 0; f < warp; f++) { zk += pl.dims[f]; soff += pl.sort_len[f]; }
        const int n = pl.dims[warp], kth = min(k, n);
        int mf = a.fp32 ? sdm_factor_sort<unsigned long long, E>(a.z, zk, true, n, kth, sorted + soff, lane)
                        : sdm_factor_sort<uint32_t, E>(a.z, zk, false, n, kth, sorted + soff, lane);
        if (lane == 0) m_s[warp] = mf;
    } else if (gates) {
        const SdmGates &gt = a.gates;
        const int d = gt.D / a.H, tg = t - 32 * F;
        for (int i = tg; i < d; i += SDM_TOPK_THREADS - 32 * F)
            gt.v[(size_t)tok * gt.D + h * d + i] = dtype_load(a.z, zrow + gt.col_v + h * d + i, a.fp32);
        if (tg == 0) {
            float g = sdm_gate_decay(dtype_load(a.z, zrow + gt.col_a + h, a.fp32), dtype_load(gt.A_log, h, a.fp32),
                                     dtype_load(gt.dt_bias, h, a.fp32));
            gt.g[p] = g;
            gt.beta[p] = sdm_sigmoid(dtype_load(a.z, zrow + gt.col_c + h, a.fp32));
            *gp_s = g;
        }
    } else if (t == 32 * F) *gp_s = out.gamma ? out.g[p] : 0.0f;
    __syncthreads();
    int m[SDM_MAX_FACTORS];
    unsigned long long G = 1;
#pragma unroll
    for (int f = 0; f < SDM_MAX_FACTORS; f++) {
        m[f] = f < F ? m_s[f] : 1;
        G *= (unsigned long long)m[f];
    }

    // 2. L = the best frontier score (by each warp alone); the candidates: the table points of the kept grid scoring
    //    >= L, in any order (slots from a shared counter: one atomic per warp and 64 table points, so that the
    //    flagship's 645 take one round). They include every table point scoring >= tau and the down-set of the k
    //    best grid points: at least k. A frontier point scoring NaN bounds nothing: the down-set argument needs the
    //    float32 sums to be monotone, which NaN breaks (+inf + -inf, or a kept negative-NaN sub-key, gives a NaN whose
    //    ord can lie above tau); with it, fewer than k candidates could pass and sel[k - 1] would be read unwritten.
    //    Only scores from ord(-inf) to ord(+inf) are used (none left: L = 0, every table point of the kept grid).
    uint32_t L = 0;
    for (int r = lane; r < pl.n_front; r += 32) {
        const uint32_t s = sdm_table_score(pl, sorted, m, tab[pl.n_table + r]);
        if (s >= 0x007fffffu && s <= 0xff800000u) L = max(L, s); // ord(-inf), ord(+inf)
    }
    L = __reduce_max_sync(SDM_FULL_MASK, L);
    for (int r0 = warp * 64; r0 < pl.n_table; r0 += 2 * SDM_TOPK_THREADS) {
        unsigned long long key[2];
        unsigned b[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int r = r0 + 32 * u + lane;
            key[u] = r < pl.n_table ? sdm_table_key(pl, sorted, m, tab[r]) : 0ull;
            b[u] = __ballot_sync(SDM_FULL_MASK, key[u] != 0ull && (uint32_t)(key[u] >> 32) >= L);
        }
        int base = lane == 0 && (b[0] | b[1]) ? atomicAdd(ccnt, __popc(b[0]) + __popc(b[1])) : 0;
        base = __shfl_sync(SDM_FULL_MASK, base, 0);
#pragma unroll
        for (int u = 0; u < 2; u++)
            if ((b[u] >> lane) & 1u) cand[base + (u ? __popc(b[0]) : 0) + __popc(b[u] & ((1u << lane) - 1))] = key[u];
    }
    __syncthreads();

    // 3. each candidate's rank among them by counting, Q threads a candidate (Q = 512 / nc rounded down to a power
    //    of two, at most 32; pairs of keys a load): sel[rank] = key, the candidates in descending key order
    const int nc = *ccnt, lq = min(5, 31 - __clz(max(1, SDM_TOPK_THREADS / max(nc, 1)))), Q = 1 << lq;
    for (int c0 = 0; c0 < nc; c0 += SDM_TOPK_THREADS >> lq) {
        int c = c0 + (t >> lq), q = t & (Q - 1), r = 0;
        unsigned long long key = c < nc ? cand[c] : 0ull;
#pragma unroll 4
        for (int i = 2 * q; c < nc && i < nc; i += 2 * Q) {
            ulonglong2 y = *(const ulonglong2 *)(cand + i);
            r += (y.x > key) + (y.y > key);
        }
        for (int o = 1; o < Q; o <<= 1) r += __shfl_xor_sync(SDM_FULL_MASK, r, o);
        if (c < nc && q == 0) {
            sel[r] = key;
            if (r < k) sel_slot[r] = (int)((uint32_t)key % (uint32_t)pl.N);
        }
    }
    __syncthreads();

    // 4. tau = the k-th key's score; the candidates scoring >= tau (a prefix of sel) are the table points scoring
    //    >= tau, n_ge of them (counted up to cap, by each warp)
    const uint32_t tau = (uint32_t)(sel[k - 1] >> 32);
    int n_ge = k;
    for (unsigned b = SDM_FULL_MASK; b == SDM_FULL_MASK && n_ge < pl.cap; n_ge += __popc(b)) {
        int r = n_ge + lane;
        b = __ballot_sync(SDM_FULL_MASK, r < nc && (uint32_t)(sel[r] >> 32) >= tau);
    }
    if (n_ge >= pl.cap && G > (unsigned long long)pl.cap) {
        // 5b. heavy ties: exact threshold over the whole kept grid, then the k keys above it in grid order (as the
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
            if (take) {
                sel[at] = key;
                sel_slot[at] = (int)((uint32_t)key % (uint32_t)pl.N);
            }
            __syncthreads();
        }
    }

    // 5. each warp with selected keys to write: the softmax norm (as the warp kernel), each of its keys' place among
    //    the slots (8 lanes a key), the outputs
    if (warp * 4 >= k) return;
    const float2 norm = sdm_topk_softmax_norm(sel, k, out.scale, lane);
    const float gp = *gp_s;
    for (int j0 = warp * 4; j0 < k; j0 += SDM_TOPK_THREADS / 8) {
        int j = j0 + (lane >> 3), q = lane & 7, slot = j < k ? sel_slot[j] : 0, pos = 0;
#pragma unroll 4
        for (int i = q; j < k && i < k; i += 8) pos += sel_slot[i] < slot;
        pos += __shfl_xor_sync(SDM_FULL_MASK, pos, 1);
        pos += __shfl_xor_sync(SDM_FULL_MASK, pos, 2);
        pos += __shfl_xor_sync(SDM_FULL_MASK, pos, 4);
        if (j < k && q == 0) sdm_topk_emit(out, k, sel, j, slot, pos, p, norm, gp);
    }
}

// Gates and values (gates not NULL; job 0's gamma then takes its g) and n_jobs (1 or 2) selections over the same P
// problems: the block kernel for P <= SDM_TOPK_BLOCK_MAX_P (its job-0 blocks form the gates too: one launch), else
// sdm_unpack_kernel and the warp kernel. jobs[0].pl->path forces a kernel (tests, benches). side (NULL: none): a
// product in the same launch, in blocks of its own after the block kernel's (else launched after it).
static inline void sdm_topk_forward(const SdmTopkJob *jobs, int n_jobs, const void *z, Dtype zt, int ldz, int H,
                                    int P, const SdmGates *gates, cudaStream_t s, const SdmTopkSide *side = NULL) {
    if (n_jobs < 1 || n_jobs > SDM_TOPK_JOBS) sdm_die("top-k: %d jobs in one launch (1..%d)", n_jobs, SDM_TOPK_JOBS);
    SdmTopkArgs a = {};
    int block_ok = 1, path = jobs[0].pl->path, sort_max = 0;
    size_t block_smem = 0;
    a.warps = SDM_TOPK_WARPS_MAX;
    for (int j = 0; j < n_jobs; j++) {
        const SdmTopkPlan *pl = jobs[j].pl;
        a.pl[j] = *pl;
        a.col0[j] = jobs[j].col0;
        a.out[j] = jobs[j].out;
        block_ok &= pl->block_ok;
        block_smem = SDM_MAX(block_smem, pl->smem_block);
        sort_max = SDM_MAX(sort_max, pl->sort_max);
        a.warp_smem = SDM_MAX(a.warp_smem, pl->smem_per_warp);
        a.warps = SDM_MIN(a.warps, pl->warps);
    }
    if (path == SDM_TOPK_BLOCK && !block_ok)
        sdm_die("top-k: the block kernel supports factor widths <= %d", SDM_TOPK_BLOCK_MAX_N);
    bool block = path == SDM_TOPK_BLOCK || (path == SDM_TOPK_AUTO && block_ok && P <= SDM_TOPK_BLOCK_MAX_P);
    a.z = z;
    a.fp32 = zt == DT_FP32;
    a.ldz = ldz; a.H = H; a.P = P;
    a.per_job = block ? P : ceil_div(P, a.warps);
    if (gates && block) a.gates = *gates;
    else if (gates) launch_pdl(sdm_unpack_kernel, P / H, 256, 0, s, z, a.fp32, ldz, H, *gates);
    // the block kernel's sorts: 8 keys a lane up to 256 sub-keys a factor (the flagship), else 32
    void (*kernel)(SdmTopkArgs) = !block ? sdm_topk_forward_kernel
                                  : sort_max <= 256 ? sdm_topk_block_kernel<8> : sdm_topk_block_kernel<32>;
    size_t smem = block ? block_smem : a.warp_smem * a.warps;
    int grid = n_jobs * a.per_job;
    a.side_block0 = grid;
    if (side && block) {
        a.side = (MatmulParts){1, {side->w}, {side->y}, {side->bias}, {side->N}, {side->N}};
        a.side_x = side->x;
        a.side_K = side->K;
        a.side_groups = (int)matmul_parts_blocks(&a.side, MATMUL_GEMV_ROWS);
        grid += SDM_MIN(a.side_groups, core_sm_count()); // a block an SM streams the weights at the bus's rate
        smem = SDM_MAX(smem, (size_t)MATMUL_GEMV_STAGES * MATMUL_GEMV_STAGE_BYTES);
    }
    // always: past 48 KB the limit counts the kernel's static shared memory too (the side product's partial sums)
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    launch_pdl(kernel, grid, block ? SDM_TOPK_THREADS : 32 * a.warps, smem, s, a);
    if (side && !block) // the warp kernel's blocks are all busy: the product on its own, after it
        matmul_forward(side->y, DT_BF16, side->N, side->x, side->w, side->bias, DT_BF16, 1, side->N, side->K, s);
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

__global__ void sdm_address_backward_kernel(const __grid_constant__ SdmTopkPlan pl, const int *slot, const float *w,
                                            const float *dw, float scale, int P, int H, void *dz, bool fp32, int ldz,
                                            int col0, int gates, SdmWriteGateArgs ga) {
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
