// attention/attn_fwd_wgmma.cuh: the bf16 attention forward at d_h = 128 with Hopper warpgroup MMAs (wgmma, sm_90a;
// core/wgmma.cuh). The same online softmax, mask and epilogue as attn_fwd_mma_kernel (attention/attn_mma.cuh), so the
// two differ only in the order the products add their terms.
#ifndef SDM_ATTN_FWD_WGMMA_CUH
#define SDM_ATTN_FWD_WGMMA_CUH

#include "attention/attn_mma.cuh"
#include "core/wgmma.cuh"

#define ATTN_WG_BM 128 // queries a CTA: two warpgroups of 64 rows
#define ATTN_WG_BN 128 // keys a tile
// dynamic shared memory: Q [BM][128], K and V [2][BN][128] bf16 in the swizzled layout, room to align them and the
// mbarriers after them
#define ATTN_WG_SMEM ((size_t)(ATTN_WG_BM + 4 * ATTN_WG_BN) * 128 * sizeof(bf16) + 1152)

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

// CTA = a producer warpgroup and 2 consumer warpgroups = 128 queries of one (b, head). The producer's one thread
// issues TMA copies: Q once, then K_n and V_n of each 128-key tile into double buffers, each buffer refilled once the
// consumers have said (an mbarrier arrival a warp) that they are done with it. Consumer warpgroup w owns rows 64w..
// and warp i of it 16 of them, the layout of a wgmma accumulator (each warp's part is an mma.sync accumulator, so the
// softmax and epilogue of the mma.sync kernel apply as they are). Key loop over the tiles the CTA's rows can see: at
// tile n a warpgroup issues S = Q K_n^T and the previous tile's O += P V_{n-1} together, and the softmax of S runs
// while P V does: O is rescaled to the new maximum once P V has finished (the same operations in the same order as one
// tile at a time). The two warpgroups take turns to issue (named barriers 1 and 2), so one's softmax runs while the
// other's products do. A tile a warpgroup sees in part is masked, one it does not see at all (a window's first tile)
// masked whole. The producer keeps 40 registers a thread and the consumers take the rest (232).
__global__ void __launch_bounds__(384, 1) attn_fwd_wgmma_kernel(AttnArgs p, const __grid_constant__ CUtensorMap tq,
                                                                const __grid_constant__ CUtensorMap tk,
                                                                const __grid_constant__ CUtensorMap tv) {
#ifdef CORE_HAVE_WGMMA
    constexpr int D = 128, BM = ATTN_WG_BM, BN = ATTN_WG_BN, TILE = BN * D * (int)sizeof(bf16);
    extern __shared__ __align__(16) unsigned char attn_smem[];
    uint32_t q_addr = (uint32_t)__cvta_generic_to_shared(wg_align_smem(attn_smem)),
             k_addr = q_addr + BM * D * sizeof(bf16), v_addr = k_addr + 2 * TILE, bars = v_addr + 2 * TILE;
    int mb = gridDim.x - 1 - blockIdx.x, j = blockIdx.y, b = blockIdx.z, g = j / (p.nh / p.nkv); // longest first
    int warp = threadIdx.x / 32, m0 = mb * BM;
    int n_lo = attn_first_key_dev(m0, p.window) / BN, n_hi = (min(p.T, m0 + BM) + BN - 1) / BN, N = n_hi - n_lo;
    // mbarriers: Q landed; K_i, V_i landed (buffer i % 2); K_i, V_i read by every consumer warp
    uint32_t q_full = bars;
    auto k_full = [&](int i) { return bars + 8 + 8 * (i & 1); };
    auto v_full = [&](int i) { return bars + 24 + 8 * (i & 1); };
    auto k_empty = [&](int i) { return bars + 40 + 8 * (i & 1); };
    auto v_empty = [&](int i) { return bars + 56 + 8 * (i & 1); };
    if (threadIdx.x == 0) {
        for (int i = 0; i < 5; i++) wg_bar_init(bars + 8 * i, 1); // the producer's arrival with the bytes
        for (int i = 5; i < 9; i++) wg_bar_init(bars + 8 * i, 8); // one lane of each consumer warp
        wg_bar_init_fence();
    }
    __syncthreads();

    if (warp >= 8) { // the producer warpgroup; one thread issues every copy (both 64-column halves of a tile)
        wg_setmaxnreg_dec<40>();
        if (threadIdx.x != 256) return;
        auto tile = [&](uint32_t smem, const CUtensorMap *tm, int head, int row, int rows, uint32_t bar) {
            wg_bar_expect(bar, rows * D * sizeof(bf16));
            wg_tma_tile(smem, tm, head, row, b, rows, bar);
        };
        tile(q_addr, &tq, j, m0, BM, q_full);
        for (int i = 0; i < N; i++) {
            int row = (n_lo + i) * BN;
            wg_wait_released(k_empty(i), i); // K_{i-2} read
            tile(k_addr + (i & 1) * TILE, &tk, g, row, BN, k_full(i));
            wg_wait_released(v_empty(i), i);
            tile(v_addr + (i & 1) * TILE, &tv, g, row, BN, v_full(i));
        }
        return;
    }

    wg_setmaxnreg_inc<232>();
    int wg = warp / 4, w0 = m0 + wg * 64, r0 = m0 + warp * 16;
    bool signal = (threadIdx.x & 31) == 0; // the lane that arrives on the empty barriers for its warp
    unsigned wlim = attn_wlim(p.window);
    float o[D / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float(&of)[64] = *reinterpret_cast<float(*)[64]>(&o);
    uint32_t a[BN / 16][4]; // P of the tile before, as A fragments
    wg_bar_wait(q_full, 0);
    if (wg == 1) wg_named_arrive(1, 256); // warpgroup 0 issues first

    for (int i = 0; i < N; i++) {
        int key0 = (n_lo + i) * BN;
        wg_wait_filled(k_full(i), i);
        if (i > 0) wg_wait_filled(v_full(i - 1), i - 1);
        float s[BN / 8][4];
        float(&sf)[64] = *reinterpret_cast<float(*)[64]>(&s);
        wg_named_sync(1 + wg, 256); // this warpgroup's turn
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
            wg_mma_ss(sf, wg_desc_kmajor(q_addr, BM, wg * 64, ks), wg_desc_kmajor(k_addr + (i & 1) * TILE, BN, 0, ks),
                      ks > 0);
        wg_commit();
        if (i > 0) {
            attn_wg_acc<BN / 16>(of, a, v_addr + ((i - 1) & 1) * TILE);
            wg_wait<1>(); // S
        } else {
            wg_wait<0>();
        }
        // the other's turn; arriving before the wait above would make ptxas serialise the products
        wg_named_arrive(2 - wg, 256);
        wg_fence_acc(sf);
        if (signal) wg_bar_arrive(k_empty(i));
        if (!attn_block_all(w0, 64, key0, BN, p.window, p.T)) attn_mask_scores<BN / 8>(s, r0, key0, wlim, p.T);
        float alpha[2];
        attn_softmax_tile<BN / 8>(s, m, l, alpha, p.scale_log2);
        wg_wait<0>(); // P V
        wg_fence_acc(of);
        if (i > 0 && signal) wg_bar_arrive(v_empty(i - 1));
        attn_rescale<D / 8>(o, alpha);
        attn_wg_frags<BN / 16>(a, s);
    }
    if (wg == 0) wg_named_sync(1, 256); // warpgroup 1's last turn: no arrival is left on barrier 1
    wg_wait_filled(v_full(N - 1), N - 1);
    attn_wg_acc<BN / 16>(of, a, v_addr + ((N - 1) & 1) * TILE);
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

// Whether the bf16 passes at head width D take the wgmma kernels: at d_h = 128, every window (at w = 128 too they
// beat the mma.sync kernels' 64-row tiles, whose masks waste less: BENCHMARKS.md, attention).
static inline bool attn_use_wgmma(int D) { return D == 128 && attn_wgmma_available(); }

static inline void attn_fwd_wgmma(const AttnArgs &p, int B, cudaStream_t st) {
#ifdef CORE_HAVE_WGMMA
    CUtensorMap tq = wg_tensor_map(p.q, B, p.T, p.nh, ATTN_WG_BM), tk = wg_tensor_map(p.k, B, p.T, p.nkv, ATTN_WG_BN),
                tv = wg_tensor_map(p.v, B, p.T, p.nkv, ATTN_WG_BN);
    attn_launch(attn_fwd_wgmma_kernel, dim3((p.T + ATTN_WG_BM - 1) / ATTN_WG_BM, p.nh, B), 384,
                ATTN_WG_SMEM, st, p, tq, tk, tv);
#else
    (void)p, (void)B, (void)st;
    sdm_die("attn_fwd_wgmma: this build has no sm_90a kernels");
#endif
}

#endif
