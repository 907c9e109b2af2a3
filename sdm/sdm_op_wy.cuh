// sdm/sdm_op_wy.cuh: phase 1 of the chunked SDM op (docs/SDM.md#chunked-wy-form, docs/SDM.md#numerics): the per-chunk
// WY quantities, one block per (chunk, stream), no bank access. Inputs: the op's token-major inputs (wslot, kappa,
// gamma [B,T,H,W], beta [B,T,H], rslot, rho [B,T,H,R]); outputs into `saved` (stream-major, padded tokens inert): slot
// lists and links between the chunk's entries (previous/next write and read of a slot, the last write a read sees, the
// nearest write of a read's slot, the last read of a slot) [S][Tp][W|R], per-slot decay scans lam, gather/scatter
// weights, e^Lambda [S][Tp][W], beta [S][Tp], and per chunk the Gram matrices A (strictly lower), S (lower with
// diagonal) and Linv = (I + diag(beta) A)^-1, each [S][nc][C][C]. Used by the forward (training and prefill); the
// backward reads what it saved.
//
// How (docs/SDM.md#phases-on-the-gpu): the chunk's entries are sorted by (slot, token, write before read), so that the
// entries of one slot form a group in time order; one thread walks each group and sets its links and decay sums; one
// warp sums each row of A and S from the groups; Linv by forward substitution. The working set lives in shared memory
// when it fits (sdm_wy_layout in sdm/sdm_op.h), else in global memory, by the same code.
#ifndef SDM_SDM_OP_WY_CUH
#define SDM_SDM_OP_WY_CUH

#include "sdm/sdm_op_common.cuh"

#define SDM_WY_WARPS (SDM_WY_THREADS / 32)

typedef unsigned long long SdmWyKey;

// Sort key of an entry: its slot in the high word; below, its token (bits 11-18, C <= 256), 1 for a read (bit 10:
// a token's write sorts before its read, which sees it) and its index in the token's list (bits 0-9, W, R <= 1024).
// A token's slots are distinct, so keys are distinct and any correct sort gives the same order.
#define SDM_WY_READ (1u << 10)
__device__ __forceinline__ SdmWyKey sdm_wy_key(int slot, int t, unsigned read, int k) {
    return (SdmWyKey)(unsigned)slot << 32 | (unsigned)t << 11 | read | (unsigned)k;
}
__device__ __forceinline__ unsigned sdm_wy_slot(SdmWyKey key) { return (unsigned)(key >> 32); }
__device__ __forceinline__ int sdm_wy_tok(SdmWyKey key) { return (int)((unsigned)key >> 11); }
__device__ __forceinline__ bool sdm_wy_is_read(SdmWyKey key) { return (unsigned)key & SDM_WY_READ; }
__device__ __forceinline__ int sdm_wy_idx(SdmWyKey key) { return (int)((unsigned)key & 1023u); }

__device__ __forceinline__ void sdm_wy_cas(SdmWyKey *keys, int i, int j, int n) {
    if (j >= n) return; // position j counts as +infinity
    SdmWyKey x = keys[i], y = keys[j];
    if (x > y) { keys[i] = y; keys[j] = x; }
}

// Sorts keys[0, n) ascending, all threads of the block, which arrive after a barrier; ends after one. The keys come
// in ascending runs of `run` (a power of two) at multiples of it. Bitonic merges: each level merges sorted runs into
// runs twice as long, by comparing each position of a run's first half with its mirror image in the second half,
// then half-cleaners at halving strides; positions from n up count as +infinity (their compare-exchanges skipped).
// Each warp owns a contiguous range of the compare-exchanges of every stage, and so of the positions: a stage within
// blocks no longer than the range stays inside it and needs no block-wide barrier, only the warp's (at the
// flagship's 8,192 keys, 10 block barriers and 60 warp barriers).
__device__ __forceinline__ void sdm_wy_sort(SdmWyKey *keys, int n, int run) {
    int np = run;
    while (np < n) np <<= 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pairs = np / 2;
    const int per = max(32, pairs / (int)(blockDim.x / 32)); // compare-exchanges a warp (a power of two)
    bool synced = true;                                      // every thread's keys visible to the block
    // one stage: compare-exchanges within blocks of 2^lb positions, the mirror image (flip) or the position 2^(lb-1)
    // further on
    auto stage = [&](int lb, bool flip) {
        const bool local = (1 << lb) <= 2 * per;
        if (!local && !synced) __syncthreads();
        const int lh = lb - 1;
        for (int q = warp * per + lane; q < min((warp + 1) * per, pairs); q += 32) {
            const int off = q & ((1 << lh) - 1), base = (q >> lh) << lb;
            sdm_wy_cas(keys, base + off, flip ? base + (1 << lb) - 1 - off : base + off + (1 << lh), n);
        }
        if (local) __syncwarp();
        else __syncthreads();
        synced = !local;
    };
    for (int lk = __ffs(2 * run) - 1; (1 << lk) <= np; lk++) { // merged runs of 2^lk
        stage(lk, true);
        for (int lb = lk - 1; lb >= 1; lb--) stage(lb, false);
    }
    if (!synced) __syncthreads();
}

// A write as sdm_wy_walk stores it over the group's keys: the token and the entry in the low word, an impossible slot
// in the high one, so that the walker of the group before, reading this position for its end, stops there.
__device__ __forceinline__ SdmWyKey sdm_wy_compacted(int t, int e) {
    return 0xffffffff00000000ull | (unsigned)t << 16 | (unsigned)e;
}

__device__ __forceinline__ void sdm_wy_walk(const SdmOpArgs &a, size_t ew, size_t er, SdmWyKey *keys, int n, int p0,
                                            float *lam, unsigned *span_w, unsigned *span_r) {
    const int W = a.W, R = a.R;
    const unsigned slot = sdm_wy_slot(keys[p0]);
    // the group's end p1, its first write (entry fw at position pfw) and its last read
    int p1 = p0, fw = -1, pfw = n, last_read = -1;
    for (; p1 < n; p1++) {
        const SdmWyKey key = keys[p1];
        if (sdm_wy_slot(key) != slot) break;
        if (sdm_wy_is_read(key)) last_read = sdm_wy_tok(key) * R + sdm_wy_idx(key);
        else if (fw < 0) { fw = sdm_wy_tok(key) * W + sdm_wy_idx(key); pfw = p1; }
    }
    // backward: nu and the slot's last read for the writes; the reads before the first write take it as nearest
    float nu = 0.f, g_next = 0.f;
    bool later = false;
    for (int p = p1 - 1; p >= p0; p--) {
        const SdmWyKey key = keys[p];
        if (sdm_wy_is_read(key)) {
            if (p < pfw) a.r_nearw[er + sdm_wy_tok(key) * R + sdm_wy_idx(key)] = fw;
            continue;
        }
        const int e = sdm_wy_tok(key) * W + sdm_wy_idx(key);
        nu = later ? g_next + nu : 0.f;
        g_next = lam[e]; // still gamma
        later = true;
        a.w_pi[ew + e] = nu;
        a.w_lastread[ew + e] = last_read;
    }
    // forward: the links, lambda, a read's lambda' (its last write's lambda) and nearest write (that write); the
    // o-th write is stored at p0 + o, a position already read
    int lw = -1, lr = -1, nw = 0; // the last write and read so far, the writes so far
    float l = 0.f;
    for (int p = p0; p < p1; p++) {
        const SdmWyKey key = keys[p];
        const int t = sdm_wy_tok(key);
        if (sdm_wy_is_read(key)) {
            const int r = t * R + sdm_wy_idx(key);
            a.r_prevw[er + r] = lw;
            a.r_prevr[er + r] = lr;
            if (lr >= 0) a.r_nextr[er + lr] = r;
            if (lw >= 0) a.r_nearw[er + r] = lw;
            a.r_lam[er + r] = lw >= 0 ? l : 0.f;
            span_r[r] = (unsigned)p0 | (unsigned)nw << 16;
            lr = r;
        } else {
            const int e = t * W + sdm_wy_idx(key);
            a.w_prev[ew + e] = lw;
            if (lw >= 0) a.w_next[ew + lw] = e;
            l = lw >= 0 ? l + lam[e] : lam[e];
            lam[e] = l;
            a.w_lam[ew + e] = l;
            span_w[e] = (unsigned)p0 | (unsigned)nw << 16;
            keys[p0 + nw++] = sdm_wy_compacted(t, e);
            lw = e;
        }
    }
    if (lw >= 0) a.w_next[ew + lw] = -1;
    if (lr >= 0) a.r_nextr[er + lr] = -1;
    for (int o = 0; o < nw; o++) a.w_elam_tot[ew + (keys[p0 + o] & 0xffffu)] = l; // Lambda, the slot's decay
}

// row[u] += w_i kap_e e^(l_i - lam_e) for each of a token's n_i entries i (its writes, or its reads; spans, weights w,
// log-decays l) and each write e of i's slot before it (sdm_wy_walk's spans into the writes at `writes`), e at token
// u; the calling warp together. Entries i go in list order, so each row[u] adds its terms in ascending slot order and
// with the expression of a two-pointer merge of the two tokens' lists (the Gram sums of docs/SDM.md#gram-matrices);
// the lanes share the writes before i, at distinct tokens u (a slot is in a token's list once).
__device__ __forceinline__ void sdm_wy_gram_row(const SdmWyKey *writes, const unsigned *span, const float *w,
                                                const float *l, int n_i, const float *kap, const float *lam,
                                                float *row) {
    const int lane = threadIdx.x & 31;
    for (int i0 = 0; i0 < n_i; i0 += 32) {
        const int i = i0 + lane;
        unsigned sp = 0;
        float wi = 0.f, li = 0.f;
        if (i < n_i) {
            sp = span[i];
            wi = w[i];
            li = l[i];
        }
        for (unsigned m = __ballot_sync(0xffffffffu, sp >> 16); m; m &= m - 1) {
            const int b = __ffs(m) - 1;
            const unsigned sb = __shfl_sync(0xffffffffu, sp, b);
            const float wb = __shfl_sync(0xffffffffu, wi, b), lb = __shfl_sync(0xffffffffu, li, b);
            const SdmWyKey *wr = writes + (sb & 0xffffu);
            for (int k = lane; k < (int)(sb >> 16); k += 32) {
                const unsigned x = (unsigned)wr[k];
                const int u = (int)(x >> 16), e = (int)(x & 0xffffu);
                row[u] += wb * kap[e] * expf(lb - lam[e]);
            }
            __syncwarp();
        }
    }
}

// Grid (nc, S), SDM_WY_THREADS threads; SMEM: the working set (sdm_wy_layout) in dynamic shared memory, else in
// a.wy_work.
template <bool SMEM>
__global__ void __launch_bounds__(SDM_WY_THREADS) sdm_wy_kernel(SdmOpArgs a, const int *wslot, const float *kappa,
                                                                const float *gamma, const float *beta,
                                                                const int *rslot, const float *rho) {
    extern __shared__ __align__(16) unsigned char sdm_wy_smem[];
    pdl_enter();
    const int c = blockIdx.x, s = blockIdx.y, C = a.C, W = a.W, R = a.R, CW = C * W;
    const int nvalid = min(C, a.T - c * C); // tokens of this chunk inside the sequence; the rest are inert padding
    const int n = nvalid * (W + R);         // the entries sorted: those of the tokens inside the sequence
    const SdmWyLayout L = sdm_wy_layout(C, W, R);
    unsigned char *work = SMEM ? sdm_wy_smem : (unsigned char *)a.wy_work + ((size_t)s * a.nc + c) * L.bytes;
    SdmWyKey *keys = (SdmWyKey *)(work + L.keys);
    unsigned *span = (unsigned *)(work + L.span);
    unsigned short *groups = (unsigned short *)(work + L.groups);
    float *lam = (float *)(work + L.lam), *kap = (float *)(work + L.kap), *rows = (float *)(work + L.rows);
    float *Am = (float *)(work + L.groups); // A [C][C], once the groups are walked
    int *count = (int *)(work + L.count);
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * C) * W, er = ((size_t)s * a.Tp + (size_t)c * C) * R;
    const size_t cc = ((size_t)s * a.nc + c) * C * C;

    // load: the keys of token t's writes at t (W + R) + k, of its reads after them (each list ascending: runs of the
    // largest power of two dividing W and R are sorted); padding gets its final values (inert, no links)
    if (threadIdx.x == 0) *count = 0;
    for (int e = threadIdx.x; e < CW; e += blockDim.x) {
        const int t = e / W, k = e - t * W;
        const size_t o = ew + e;
        if (t < nvalid) {
            const size_t g = sdm_tok_off(a, s, c * C + t, W) + k;
            const int slot = wslot[g];
            const float kp = kappa[g];
            keys[t * (W + R) + k] = sdm_wy_key(slot, t, 0, k);
            kap[e] = kp;
            lam[e] = gamma[g];
            a.w_slot[o] = slot;
            a.w_kappa[o] = kp;
        } else {
            a.w_slot[o] = a.w_prev[o] = a.w_next[o] = a.w_lastread[o] = -1;
            a.w_kappa[o] = a.w_lam[o] = a.w_gath[o] = a.w_scat[o] = 0.f;
            a.w_pi[o] = a.w_elam_tot[o] = 1.f;
        }
    }
    for (int r = threadIdx.x; r < C * R; r += blockDim.x) {
        const int t = r / R, k = r - t * R;
        const size_t o = er + r;
        if (t < nvalid) {
            const size_t g = sdm_tok_off(a, s, c * C + t, R) + k;
            const int slot = rslot[g];
            keys[t * (W + R) + W + k] = sdm_wy_key(slot, t, SDM_WY_READ, k);
            a.r_slot[o] = slot;
            a.r_rho[o] = rho[g];
        } else {
            a.r_slot[o] = a.r_prevw[o] = a.r_prevr[o] = a.r_nextr[o] = a.r_nearw[o] = -1;
            a.r_rho[o] = a.r_lam[o] = a.r_gath[o] = 0.f;
        }
    }
    for (int t = threadIdx.x; t < C; t += blockDim.x)
        a.beta[(size_t)s * a.Tp + c * C + t] = t < nvalid ? beta[sdm_tok_off(a, s, c * C + t, 1)] : 0.f;
    __syncthreads();
    sdm_wy_sort(keys, n, (W | R) & -(W | R));

    // the slot groups (runs of one slot), listed in any order, each walked by one thread: links and decay sums
    for (int p = threadIdx.x; p < n; p += blockDim.x)
        if (p == 0 || sdm_wy_slot(keys[p]) != sdm_wy_slot(keys[p - 1])) groups[atomicAdd(count, 1)] = (unsigned short)p;
    __syncthreads();
    for (int g = threadIdx.x; g < *count; g += blockDim.x)
        sdm_wy_walk(a, ew, er, keys, n, groups[g], lam, span, span + CW);
    __syncthreads();

    // gather/scatter weights: kappa e^lam, pi = e^nu, pi kappa; e^Lambda of the slot; rho e^lam'
    for (int e = threadIdx.x; e < nvalid * W; e += blockDim.x) {
        const size_t o = ew + e;
        const float pi = expf(a.w_pi[o]);
        a.w_gath[o] = kap[e] * expf(lam[e]);
        a.w_pi[o] = pi;
        a.w_scat[o] = pi * kap[e];
        a.w_elam_tot[o] = expf(a.w_elam_tot[o]);
    }
    for (int r = threadIdx.x; r < nvalid * R; r += blockDim.x)
        a.r_gath[er + r] = a.r_rho[er + r] * expf(a.r_lam[er + r]);
    // Gram matrices A (strictly lower) and S (lower with diagonal), one warp per row t in a buffer of its own, then
    // into A, Sm and (for the solve) Am; rows of padding are zero
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *Arow = rows + warp * 2 * C, *Srow = Arow + C;
    for (int t = warp; t < C; t += SDM_WY_WARPS) {
        for (int u = lane; u < C; u += 32) Arow[u] = Srow[u] = 0.f;
        __syncwarp();
        if (t < nvalid) {
            sdm_wy_gram_row(keys, span + t * W, kap + t * W, lam + t * W, W, kap, lam, Arow);
            sdm_wy_gram_row(keys, span + CW + t * R, a.r_rho + er + t * R, a.r_lam + er + t * R, R, kap, lam, Srow);
        }
        __syncwarp();
        for (int u = lane; u < C; u += 32) {
            Am[t * C + u] = Arow[u];
            a.A[cc + t * C + u] = Arow[u];
            a.Sm[cc + t * C + u] = Srow[u];
        }
        __syncwarp();
    }
    __syncthreads();
    // Linv = (I + diag(beta) A)^-1 by forward substitution, thread j owns column j; the lower triangle is kept packed
    // (X(t, j) at t (t + 1) / 2 + j) over the keys, which are no longer needed
    const float *bt = a.beta + (size_t)s * a.Tp + c * C;
    float *X = (float *)keys;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        X[j * (j + 1) / 2 + j] = 1.f;
        for (int t = j + 1; t < C; t++) {
            float acc = 0.f;
            for (int u = j; u < t; u++) acc = fmaf(Am[t * C + u], X[u * (u + 1) / 2 + j], acc);
            X[t * (t + 1) / 2 + j] = -bt[t] * acc;
        }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < C * C; p += blockDim.x) {
        int t = p / C, j = p % C;
        a.Linv[cc + p] = j <= t ? X[t * (t + 1) / 2 + j] : 0.f;
    }
}

static inline void sdm_op_phase1(const SdmOpArgs &a, const SdmOpInputs *in, cudaStream_t stream) {
    const dim3 grid(a.nc, a.S);
    if (a.wy_work) {
        launch_pdl(sdm_wy_kernel<false>, grid, SDM_WY_THREADS, 0, stream, a, in->wslot, in->kappa, in->gamma, in->beta,
                   in->rslot, in->rho);
        return;
    }
    size_t smem = sdm_wy_layout(a.C, a.W, a.R).bytes;
    cudaCheck(cudaFuncSetAttribute(sdm_wy_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    launch_pdl(sdm_wy_kernel<true>, grid, SDM_WY_THREADS, smem, stream, a, in->wslot, in->kappa, in->gamma, in->beta,
               in->rslot, in->rho);
}

#endif
