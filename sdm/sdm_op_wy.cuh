// sdm/sdm_op_wy.cuh: phase 1 of the chunked SDM op (docs/SDM.md#chunked-wy-form, docs/SDM.md#numerics): the per-chunk
// WY quantities, one CTA per (chunk, stream), no bank access. Inputs: the op's token-major inputs (wslot, kappa, gamma
// [B,T,H,W], beta [B,T,H], rslot, rho [B,T,H,R]); outputs into `saved` (stream-major, padded tokens inert): slot lists
// and links between the chunk's entries (previous/next write and read of a slot, the last write a read sees, the
// nearest write of a read's slot, the last read of a slot) [S][Tp][W|R], per-slot decay scans lam, gather/scatter
// weights, e^Lambda [S][Tp][W], beta [S][Tp], and per
// chunk the Gram matrices A (strictly lower), S (lower with diagonal) and Linv = (I + diag(beta) A)^-1, each
// [S][nc][C][C]. Used by the forward (training and prefill); the backward reads what it saved.
#ifndef SDM_SDM_OP_WY_CUH
#define SDM_SDM_OP_WY_CUH

#include "sdm/sdm_op_common.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Phase 1: the WY quantities of one chunk. Grid (nc, S), 256 threads, dynamic smem: the chunk's slot lists.

// Calls f(i, j) for every pair of equal entries of the sorted lists x[0..nx) and y[0..ny) (distinct within a list).
template <typename F> __device__ __forceinline__ void sdm_merge_equal(const int *x, int nx, const int *y, int ny, F f) {
    int i = 0, j = 0;
    while (i < nx && j < ny) {
        int a = x[i], b = y[j];
        if (a == b) { f(i, j); i++; j++; }
        else if (a < b) i++;
        else j++;
    }
}

// The token pairs {t, u}, u <= t < n, each once, as p runs over [0, n (n/2 + 1)): distance class dd = p / n,
// x = p % n, the pair {x, x - dd mod n} (at distance dd, or n - dd for the x < dd that wrap); false for the repeats of
// dd = n/2. Consecutive p (a warp's lanes) sit on distinct rows and distinct columns, and near pairs come first.
__device__ __forceinline__ bool sdm_fold_pair(int p, int n, int &t, int &u) {
    int dd = p / n, x = p % n, y = x >= dd ? x - dd : x - dd + n;
    if (2 * dd == n && x >= dd) return false;
    t = max(x, y);
    u = min(x, y);
    return true;
}
__device__ __forceinline__ int sdm_fold_pairs(int n) { return n * (n / 2 + 1); }

// atomicMax / atomicMin of a link that only ever moves one way: skipped when the link already holds a nearer entry,
// which, with near pairs visited first, spares the L2 atomics of the many farther pairs of a slot that many tokens
// share (the load may be stale: then the atomic runs anyway)
__device__ __forceinline__ void sdm_link_max(int *p, int v) {
    if (__ldcg(p) < v) atomicMax(p, v);
}
__device__ __forceinline__ void sdm_link_min(int *p, int v) {
    if (__ldcg(p) > v) atomicMin(p, v);
}

__global__ void __launch_bounds__(256) sdm_wy_kernel(SdmOpArgs a, const int *wslot, const float *kappa,
                                                     const float *gamma, const float *beta, const int *rslot,
                                                     const float *rho) {
    extern __shared__ int sdm_smem_slots[];
    pdl_enter();
    const int c = blockIdx.x, s = blockIdx.y, C = a.C, W = a.W, R = a.R;
    const int nvalid = min(C, a.T - c * C); // tokens of this chunk inside the sequence; the rest are inert padding
    const int sW = W | 1, sR = R | 1; // odd row strides: lanes walking different tokens' lists hit different banks
    int *ks = sdm_smem_slots, *qs = sdm_smem_slots + C * sW;
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * C) * W, er = ((size_t)s * a.Tp + (size_t)c * C) * R;
    int *prev = a.w_prev + ew, *next = a.w_next + ew, *lastread = a.w_lastread + ew;
    int *prevw = a.r_prevw + er, *prevr = a.r_prevr + er, *nextr = a.r_nextr + er, *nearw = a.r_nearw + er;
    float *lam = a.w_lam + ew, *gam = a.w_pi + ew, *nu = a.w_scat + ew, *lamtot = a.w_elam_tot + ew;
    float *kap = a.w_kappa + ew, *rlam = a.r_lam + er;
    // load (padding: slot -1, weights 0), initialise the links
    for (int e = threadIdx.x; e < C * W; e += blockDim.x) {
        int t = e / W;
        bool v = t < nvalid;
        size_t g = sdm_tok_off(a, s, c * C + t, W) + e % W;
        ks[t * sW + e % W] = v ? wslot[g] : -1;
        kap[e] = v ? kappa[g] : 0.f;
        gam[e] = v ? gamma[g] : 0.f;
        a.w_slot[ew + e] = ks[t * sW + e % W];
        prev[e] = -1; next[e] = -1; lastread[e] = -1;
    }
    for (int e = threadIdx.x; e < C * R; e += blockDim.x) {
        int t = e / R;
        bool v = t < nvalid;
        size_t g = sdm_tok_off(a, s, c * C + t, R) + e % R;
        qs[t * sR + e % R] = v ? rslot[g] : -1;
        a.r_rho[er + e] = v ? rho[g] : 0.f;
        a.r_slot[er + e] = qs[t * sR + e % R];
        prevw[e] = -1; prevr[e] = -1; nextr[e] = -1; nearw[e] = INT_MAX;
    }
    for (int t = threadIdx.x; t < C; t += blockDim.x)
        a.beta[(size_t)s * a.Tp + c * C + t] = t < nvalid ? beta[sdm_tok_off(a, s, c * C + t, 1)] : 0.f;
    __syncthreads();
    // nearest-entry links by merging the slot lists of every token pair: the previous write and the previous read of
    // the same slot, the last write at or before a read (prevw) and the first write after it (kept in nearw)
    for (int p = threadIdx.x; p < sdm_fold_pairs(nvalid); p += blockDim.x) {
        int t, u;
        if (!sdm_fold_pair(p, nvalid, t, u)) continue;
        const int *kt = ks + t * sW, *ku = ks + u * sW, *qt = qs + t * sR, *qu = qs + u * sR;
        if (u < t) {
            sdm_merge_equal(kt, W, ku, W, [&](int i, int j) { sdm_link_max(prev + t * W + i, u * W + j); });
            sdm_merge_equal(qt, R, qu, R, [&](int i, int j) { sdm_link_max(prevr + t * R + i, u * R + j); });
            sdm_merge_equal(qu, R, kt, W, [&](int i, int j) { sdm_link_min(nearw + u * R + i, t * W + j); });
        }
        sdm_merge_equal(qt, R, ku, W, [&](int i, int j) { sdm_link_max(prevw + t * R + i, u * W + j); });
    }
    __syncthreads();
    // the reverse links (a chain's entries have distinct successors: plain stores); nearw = the nearest write of the
    // slot, the last at or before the read, else the first after it, else -1
    for (int e = threadIdx.x; e < C * W; e += blockDim.x)
        if (prev[e] >= 0) next[prev[e]] = e;
    for (int e = threadIdx.x; e < C * R; e += blockDim.x) {
        if (prevr[e] >= 0) nextr[prevr[e]] = e;
        nearw[e] = prevw[e] >= 0 ? prevw[e] : nearw[e] == INT_MAX ? -1 : nearw[e];
    }
    __syncthreads();
    // lastread of every write entry: the slot's last read sets it along the slot's write chain (O(L) per slot)
    for (int r = threadIdx.x; r < C * R; r += blockDim.x) {
        int w0 = nearw[r];
        if (nextr[r] >= 0 || w0 < 0) continue;
        for (int q = w0; q >= 0; q = prev[q]) lastread[q] = r;
        for (int q = next[w0]; q >= 0; q = next[q]) lastread[q] = r;
    }
    // per-slot decay scans from zero inside the chunk: lam inclusive forward, nu = sum strictly after, lamtot = slot
    // total
    for (int t = 0; t < C; t++) {
        for (int k = threadIdx.x; k < W; k += blockDim.x) {
            int e = t * W + k, pr = prev[e];
            lam[e] = pr >= 0 ? lam[pr] + gam[e] : gam[e];
        }
        __syncthreads();
    }
    for (int t = C - 1; t >= 0; t--) {
        for (int k = threadIdx.x; k < W; k += blockDim.x) {
            int e = t * W + k, nx = next[e];
            nu[e] = nx >= 0 ? gam[nx] + nu[nx] : 0.f;
            lamtot[e] = nx >= 0 ? lamtot[nx] : lam[e];
        }
        __syncthreads();
    }
    // gather/scatter weights: kappa e^lam, pi kappa (pi = e^nu); e^Lambda of the slot
    for (int e = threadIdx.x; e < C * W; e += blockDim.x) {
        float pi = expf(nu[e]);
        a.w_gath[ew + e] = kap[e] * expf(lam[e]);
        gam[e] = pi; // w_pi: gamma is no longer needed
        nu[e] = pi * kap[e]; // w_scat
        lamtot[e] = expf(lamtot[e]);
    }
    for (int e = threadIdx.x; e < C * R; e += blockDim.x) {
        int pw = prevw[e];
        float l = pw >= 0 ? lam[pw] : 0.f;
        rlam[e] = l;
        a.r_gath[er + e] = a.r_rho[er + e] * expf(l);
    }
    __syncthreads();
    // Gram matrices A (strictly lower) and S (lower with diagonal), one thread per token pair, merge order; zero
    // elsewhere
    const size_t cc = ((size_t)s * a.nc + c) * C * C;
    const float *rr = a.r_rho + er;
    for (int p = threadIdx.x; p < C * C; p += blockDim.x)
        if (p % C > p / C || p / C >= nvalid) a.A[cc + p] = a.Sm[cc + p] = 0.f;
    for (int p = threadIdx.x; p < sdm_fold_pairs(nvalid); p += blockDim.x) {
        int t, u;
        if (!sdm_fold_pair(p, nvalid, t, u)) continue;
        float av = 0.f, sv = 0.f;
        if (u < t)
            sdm_merge_equal(ks + t * sW, W, ks + u * sW, W, [&](int i, int j) {
                av += kap[t * W + i] * kap[u * W + j] * expf(lam[t * W + i] - lam[u * W + j]);
            });
        sdm_merge_equal(qs + t * sR, R, ks + u * sW, W, [&](int i, int j) {
            sv += rr[t * R + i] * kap[u * W + j] * expf(rlam[t * R + i] - lam[u * W + j]);
        });
        a.A[cc + t * C + u] = av;
        a.Sm[cc + t * C + u] = sv;
    }
    __syncthreads();
    // Linv = (I + diag(beta) A)^-1 by forward substitution, thread j owns column j; the lower triangle is kept packed
    // in shared memory (X(t, j) at t (t + 1) / 2 + j), over the slot lists that are no longer needed
    const float *Ac = a.A + cc, *bt = a.beta + (size_t)s * a.Tp + c * C;
    float *X = (float *)sdm_smem_slots;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        X[j * (j + 1) / 2 + j] = 1.f;
        for (int t = j + 1; t < C; t++) {
            float acc = 0.f;
            for (int u = j; u < t; u++) acc = fmaf(Ac[t * C + u], X[u * (u + 1) / 2 + j], acc);
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
    size_t smem = (size_t)SDM_MAX(a.C * ((a.W | 1) + (a.R | 1)), a.C * (a.C + 1) / 2) * sizeof(int);
    cudaCheck(cudaFuncSetAttribute(sdm_wy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    launch_pdl(sdm_wy_kernel, dim3(a.nc, a.S), 256, smem, stream, a, in->wslot, in->kappa, in->gamma, in->beta,
               in->rslot, in->rho);
}

#endif
