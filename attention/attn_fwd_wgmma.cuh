// attention/attn_fwd_wgmma.cuh: the bf16 attention forward at d_h = 128 with Hopper warpgroup MMAs (wgmma, sm_90a;
// core/wgmma.cuh). The same online softmax, mask and epilogue as attn_fwd_mma_kernel (attention/attn_mma.cuh), so the
// two differ only in the order the products add their terms.
#ifndef SDM_ATTN_FWD_WGMMA_CUH
#define SDM_ATTN_FWD_WGMMA_CUH

#include "attention/attn_mma.cuh"
#include "core/wgmma.cuh"

#define ATTN_WG_BM 128 // queries a CTA: two warpgroups of 64 rows
#define ATTN_WG_BN 128 // keys a tile
// dynamic shared memory: Q [BM][128], K and V [2][BN][128] bf16 in the swizzled layout, and room to align them
#define ATTN_WG_SMEM ((size_t)(ATTN_WG_BM + 4 * ATTN_WG_BN) * 128 * sizeof(bf16) + 1024)

// rows [row0, row0+ROWS) of a [T, stride] bf16 matrix (128 columns) into a swizzled smem tile (core/wgmma.cuh); rows
// >= T read as 0.
template <int ROWS, int THREADS>
__device__ __forceinline__ void attn_load_tile_sw(unsigned char *smem, const bf16 *g, int row0, int T, size_t stride) {
    for (int c = threadIdx.x; c < ROWS * 16; c += THREADS) {
        int r = c / 16, col = (c % 16) * 8, t = row0 + r;
        bool ok = t < T;
        core_cp_async16(smem + wg_tile_offset(ROWS, r, col), ok ? g + (size_t)t * stride + col : g, ok);
    }
}

// A warp's accumulator of 16 x 16KK scores as the A fragments of KK k-steps of 16 (the layouts coincide).
template <int KK>
__device__ __forceinline__ void attn_wg_frags(uint32_t (&a)[KK][4], const float (&s)[2 * KK][4]) {
#pragma unroll
    for (int kk = 0; kk < KK; kk++) attn_acc_to_a<2 * KK>(a[kk], s, kk);
}

#ifdef CORE_HAVE_WGMMA
// o [64 x 128] += A (fragments a: KK k-steps of 16) . B, B a swizzled [16 KK][128] tile read MN-major (V for P V;
// dO, Q, K in the backward). Issued and committed, not waited for.
template <int KK>
__device__ __forceinline__ void attn_wg_acc(float (&o)[64], const uint32_t (&a)[KK][4], uint32_t b_tile) {
    wg_fence_acc(o);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < KK; kk++) wg_mma_rs_t(o, a[kk], wg_desc_mnmajor(b_tile, 16 * KK, kk));
    wg_commit();
}
#endif

// CTA = 2 warpgroups = 128 queries of one (b, head); warpgroup w owns rows 64w.. and warp i of it 16 of them, the
// layout of a wgmma accumulator (each warp's part is an mma.sync accumulator, so the softmax and epilogue of the
// mma.sync kernel apply as they are). Key loop over the 128-key tiles the CTA's rows can see; at tile n a warpgroup
// issues S = Q K_n^T and the previous tile's O += P V_{n-1} together, and the softmax of S runs while P V does: O is
// rescaled to the new maximum once P V has finished (the same operations in the same order as one tile at a time).
// K_{n+1} and V_n load (cp.async) during tile n into double buffers. A tile a warpgroup sees in part is masked, one
// it does not see at all (a window's first tile) masked whole.
__global__ void __launch_bounds__(256, 1) attn_fwd_wgmma_kernel(AttnArgs p) {
#ifdef CORE_HAVE_WGMMA
    constexpr int D = 128, BM = ATTN_WG_BM, BN = ATTN_WG_BN, TILE = BN * D * (int)sizeof(bf16);
    extern __shared__ __align__(16) unsigned char attn_smem[];
    unsigned char *Qs = wg_align_smem(attn_smem);
    unsigned char *Ks = Qs + BM * D * sizeof(bf16), *Vs = Ks + 2 * TILE; // K, V [2] tiles each
    uint32_t q_addr = (uint32_t)__cvta_generic_to_shared(Qs), k_addr = q_addr + BM * D * sizeof(bf16),
             v_addr = k_addr + 2 * TILE;
    int mb = gridDim.x - 1 - blockIdx.x, j = blockIdx.y, b = blockIdx.z, g = j / (p.nh / p.nkv); // longest first
    int warp = threadIdx.x / 32, wg = warp / 4, m0 = mb * BM, w0 = m0 + wg * 64, r0 = m0 + warp * 16;
    const bf16 *qg = (const bf16 *)p.q + ((size_t)b * p.T * p.nh + j) * D;
    const bf16 *kg = (const bf16 *)p.k + ((size_t)b * p.T * p.nkv + g) * D;
    const bf16 *vg = (const bf16 *)p.v + ((size_t)b * p.T * p.nkv + g) * D;
    size_t qstride = (size_t)p.nh * D, kstride = (size_t)p.nkv * D;
    int n_lo = attn_first_key_dev(m0, p.window) / BN, n_hi = (min(p.T, m0 + BM) + BN - 1) / BN;
    unsigned wlim = attn_wlim(p.window);

    attn_load_tile_sw<BM, 256>(Qs, qg, m0, p.T, qstride);
    attn_load_tile_sw<BN, 256>(Ks + (n_lo & 1) * TILE, kg, n_lo * BN, p.T, kstride);
    core_cp_async_commit();

    float o[D / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float(&of)[64] = *reinterpret_cast<float(*)[64]>(&o);
    uint32_t a[BN / 16][4]; // P of the tile before, as A fragments

    for (int n = n_lo; n < n_hi; n++) {
        int key0 = n * BN;
        // K_{n+1} and V_n into the buffers K_{n-1} and V_{n-2} left (read by products waited for last tile)
        if (n + 1 < n_hi) attn_load_tile_sw<BN, 256>(Ks + ((n + 1) & 1) * TILE, kg, key0 + BN, p.T, kstride);
        attn_load_tile_sw<BN, 256>(Vs + (n & 1) * TILE, vg, key0, p.T, kstride);
        core_cp_async_commit();
        core_cp_async_wait<1>(); // K_n and V_{n-1} have landed
        wg_fence_smem();         // this thread's copies, visible to the products of every warpgroup after the barrier
        __syncthreads();
        float s[BN / 8][4];
        float(&sf)[64] = *reinterpret_cast<float(*)[64]>(&s);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
            wg_mma_ss(sf, wg_desc_kmajor(q_addr, BM, wg * 64, ks), wg_desc_kmajor(k_addr + (n & 1) * TILE, BN, 0, ks),
                      ks > 0);
        wg_commit();
        if (n > n_lo) {
            attn_wg_acc<BN / 16>(of, a, v_addr + ((n - 1) & 1) * TILE);
            wg_wait<1>(); // S
        } else {
            wg_wait<0>();
        }
        wg_fence_acc(sf);
        if (!attn_block_all(w0, 64, key0, BN, p.window, p.T)) attn_mask_scores<BN / 8>(s, r0, key0, wlim, p.T);
        float alpha[2];
        attn_softmax_tile<BN / 8>(s, m, l, alpha, p.scale_log2);
        wg_wait<0>(); // P V
        wg_fence_acc(of);
        attn_rescale<D / 8>(o, alpha);
        attn_wg_frags<BN / 16>(a, s);
    }
    core_cp_async_wait<0>(); // the last V
    wg_fence_smem();
    __syncthreads();
    attn_wg_acc<BN / 16>(of, a, v_addr + ((n_hi - 1) & 1) * TILE);
    wg_wait<0>();
    wg_fence_acc(of);
    attn_fwd_finish<D>(p, b, j, r0, m, l, o);
#endif
}

// Whether this build has the wgmma kernels (a build for sm_90a).
static inline bool attn_wgmma_available() {
#ifdef CORE_HAVE_WGMMA
    return true;
#else
    return false;
#endif
}

// Whether the bf16 passes at head width D and window w take the wgmma kernels: at d_h = 128, full attention and
// windows over 256 (at w = 128 the mma.sync kernels' 64-row tiles waste less of a tile on the mask and win:
// BENCHMARKS.md, attention).
static inline bool attn_use_wgmma(int D, int window) {
    return D == 128 && attn_wgmma_available() && (window == 0 || window > 256);
}

static inline void attn_fwd_wgmma(const AttnArgs &p, int B, cudaStream_t st) {
    attn_launch(attn_fwd_wgmma_kernel, dim3((p.T + ATTN_WG_BM - 1) / ATTN_WG_BM, p.nh, B), 256, ATTN_WG_SMEM, st, p);
}

#endif
