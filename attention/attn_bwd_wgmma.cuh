// attention/attn_bwd_wgmma.cuh: the bf16 attention backward at d_h = 128 with Hopper warpgroup MMAs (wgmma, sm_90a;
// core/wgmma.cuh): the two passes of attention/attn_bwd.cuh (dK/dV per key tile, dQ per query tile, every output
// with one owner, no atomics) with each warpgroup's products as wgmma, their tiles brought by TMA from a producer
// warpgroup as in the forward (attention/attn_fwd_wgmma.cuh).
#ifndef SDM_ATTN_BWD_WGMMA_CUH
#define SDM_ATTN_BWD_WGMMA_CUH

#include "attention/attn_fwd_wgmma.cuh" // attn_wg_acc, attn_wg_frags
#include "attention/attn_mma.cuh"
#include "core/wgmma.cuh"

#define ATTN_WGB_ROWS 128 // a CTA's own rows (keys for dK/dV, queries for dQ): two warpgroups of 64
#define ATTN_WGB_STEP 64  // the rows of the other side a step brings (queries for dK/dV, keys for dQ)
// dynamic shared memory: two [ROWS][128] and four [STEP][128] bf16 tiles, lse and delta [2][STEP], room to align
// them and the mbarriers after them
#define ATTN_WGB_SMEM \
    ((size_t)(2 * ATTN_WGB_ROWS + 4 * ATTN_WGB_STEP) * 128 * sizeof(bf16) + 4 * ATTN_WGB_STEP * sizeof(float) + 1152)

#ifdef CORE_HAVE_WGMMA
// s = A1 B1^T and d = A2 B2^T [64 x 64] for a warpgroup: A1, A2 its 64 rows (from row0) of two swizzled [rows1][128]
// tiles, B1, B2 swizzled [64][128] tiles, all K-major. Issued and committed.
__device__ __forceinline__ void attn_wg_pair(float (&s)[32], float (&d)[32], uint32_t a1, uint32_t a2, int rows1,
                                             int row0, uint32_t b1, uint32_t b2) {
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ks++)
        wg_mma_ss(s, wg_desc_kmajor(a1, rows1, row0, ks), wg_desc_kmajor(b1, ATTN_WGB_STEP, 0, ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < 8; ks++)
        wg_mma_ss(d, wg_desc_kmajor(a2, rows1, row0, ks), wg_desc_kmajor(b2, ATTN_WGB_STEP, 0, ks), ks > 0);
    wg_commit();
}
#endif

// dK/dV: CTA = a producer warpgroup and 2 consumer warpgroups; the consumers own 128 keys of one (b, kv head),
// warpgroup w its keys 64w.., warp i of it 16. The producer's one thread issues TMA copies of K and V once, then of
// each step's Q and dO tiles into double buffers (a buffer refilled once every consumer warp has arrived on its empty
// barrier); its warp 9 writes the step's lse (base 2) and delta into shared memory. Steps as
// attn_bwd_dkdv_mma_kernel: over the query heads of the group and the 64-query tiles that can see the keys,
// S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q. The
// consumers take 240 registers a thread (dK and dV are 128 of them), the producer 24.
__global__ void __launch_bounds__(384, 1) attn_bwd_dkdv_wgmma_kernel(AttnArgs p, const __grid_constant__ CUtensorMap tq,
                                                                   const __grid_constant__ CUtensorMap tdo,
                                                                   const __grid_constant__ CUtensorMap tk,
                                                                   const __grid_constant__ CUtensorMap tv) {
#ifdef CORE_HAVE_WGMMA
    constexpr int D = 128, BN = ATTN_WGB_ROWS, BM = ATTN_WGB_STEP, BIG = BN * D * 2, SMALL = BM * D * 2;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    unsigned char *base = wg_align_smem(attn_smem);
    uint32_t k_addr = (uint32_t)__cvta_generic_to_shared(base), v_addr = k_addr + BIG, q_addr = v_addr + BIG,
             o_addr = q_addr + 2 * SMALL, l_addr = o_addr + 2 * SMALL, d_addr = l_addr + 2 * BM * 4,
             bars = d_addr + 2 * BM * 4;
    float *Ls = (float *)(base + (l_addr - k_addr)), *Ds = (float *)(base + (d_addr - k_addr)); // [2][BM] each
    int g = blockIdx.y, b = blockIdx.z, warp = threadIdx.x / 32, group = p.nh / p.nkv;
    int n0 = blockIdx.x * BN;
    int q_hi = p.window == 0 ? p.T : min(p.T, n0 + BN - 1 + p.window);
    int m_lo = n0 / BM, m_hi = (q_hi + BM - 1) / BM, per_head = m_hi - m_lo, steps = per_head * group;
    uint32_t kv_full = bars;
    auto full = [&](int i) { return bars + 8 + 8 * (i & 1); };
    auto empty = [&](int i) { return bars + 24 + 8 * (i & 1); };
    if (threadIdx.x == 0) {
        wg_bar_init(kv_full, 1);
        for (int i = 0; i < 2; i++) wg_bar_init(full(i), 33); // the copies' thread and the 32 lanes of warp 9
        for (int i = 0; i < 2; i++) wg_bar_init(empty(i), 8);
        wg_bar_init_fence();
    }
    __syncthreads();

    if (warp >= 8) {
        wg_setmaxnreg_dec<24>();
        if (warp == 9) { // lse (base 2) and delta of each step's queries, rows past T as 0, by plain loads
            int lane = threadIdx.x & 31;
            for (int i = 0; i < steps; i++) {
                int j = g * group + i / per_head, m0 = (m_lo + i % per_head) * BM, buf = i & 1;
                wg_wait_released(empty(i), i);
                for (int r = lane; r < BM; r += 32) {
                    size_t hrow = ((size_t)b * p.nh + j) * p.T + m0 + r;
                    bool ok = m0 + r < p.T;
                    Ls[buf * BM + r] = ok ? p.lse[hrow] * ATTN_LOG2E : 0.0f;
                    Ds[buf * BM + r] = ok ? p.delta[hrow] : 0.0f;
                }
                wg_bar_arrive(full(i));
            }
            return;
        }
        if (threadIdx.x != 256) return;
        // Both tiles' bytes in one expect: each barrier counts one arrival of this thread and expect_tx arrives,
        // so an expect per tile could let the first tile's bytes complete the phase before the second is counted.
        wg_bar_expect(kv_full, 2 * BIG);
        wg_tma_tile(k_addr, &tk, g, n0, b, BN, kv_full);
        wg_tma_tile(v_addr, &tv, g, n0, b, BN, kv_full);
        for (int i = 0; i < steps; i++) {
            int j = g * group + i / per_head, m0 = (m_lo + i % per_head) * BM, buf = i & 1;
            wg_wait_released(empty(i), i);
            wg_bar_expect(full(i), 2 * SMALL);
            wg_tma_tile(q_addr + buf * SMALL, &tq, j, m0, b, BM, full(i));
            wg_tma_tile(o_addr + buf * SMALL, &tdo, j, m0, b, BM, full(i));
        }
        return;
    }

    wg_setmaxnreg_inc<240>();
    int wg = warp / 4, k0 = n0 + warp * 16, kw = n0 + wg * 64;
    bool signal = (threadIdx.x & 31) == 0;
    unsigned wlim = attn_wlim(p.window);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[dt][e] = dv[dt][e] = 0.0f;
    float(&dkf)[64] = *reinterpret_cast<float(*)[64]>(&dk);
    float(&dvf)[64] = *reinterpret_cast<float(*)[64]>(&dv);
    wg_bar_wait(kv_full, 0);

    for (int i = 0; i < steps; i++) {
        int buf = i & 1, m0 = (m_lo + i % per_head) * BM;
        wg_wait_filled(full(i), i);
        bool any = attn_block_any(m0, BM, kw, 64, p.window, p.T); // uniform over the warpgroup
        float st[BM / 8][4], dpt[BM / 8][4];
        float(&stf)[32] = *reinterpret_cast<float(*)[32]>(&st);
        float(&dptf)[32] = *reinterpret_cast<float(*)[32]>(&dpt);
        if (any) {
            attn_wg_pair(stf, dptf, k_addr, v_addr, BN, wg * 64, q_addr + buf * SMALL, o_addr + buf * SMALL);
            wg_wait<0>();
            wg_fence_acc(stf);
            wg_fence_acc(dptf);
            if (!attn_block_all(m0, BM, kw, 64, p.window, p.T)) attn_dkdv_mask<BM / 8>(st, k0, m0, wlim, p.T);
            attn_dkdv_p_ds<BM / 8>(st, dpt, Ls + buf * BM, Ds + buf * BM, p.scale_log2);
            uint32_t pa[4][4], da[4][4];
            attn_wg_frags<4>(pa, st);
            attn_wg_frags<4>(da, dpt);
            attn_wg_acc<4>(dvf, pa, o_addr + buf * SMALL);
            attn_wg_acc<4>(dkf, da, q_addr + buf * SMALL);
            wg_wait<0>();
            wg_fence_acc(dvf);
            wg_fence_acc(dkf);
        }
        if (signal) wg_bar_arrive(empty(i));
    }
    size_t kstride = (size_t)p.nkv * D;
    float one[2] = {1.0f, 1.0f}, scale = p.scale_log2 / ATTN_LOG2E, sc[2] = {scale, scale};
    attn_store_acc<D>((bf16 *)p.dk + ((size_t)b * p.T * p.nkv + g) * D, kstride, k0, p.T, dk, sc);
    attn_store_acc<D>((bf16 *)p.dv + ((size_t)b * p.T * p.nkv + g) * D, kstride, k0, p.T, dv, one);
#endif
}

// dQ: CTA = a producer warpgroup and 2 consumer warpgroups owning 128 queries of one (b, head), warpgroup w its
// queries 64w.., warp i of it 16. The producer's one thread issues TMA copies of Q and dO once, then of the 64-key K
// and V tiles into double buffers, as the forward; the consumers loop over the tiles: S = Q K^T, dP = dO V^T,
// dS = P (dP - delta), dQ += dS K.
__global__ void __launch_bounds__(384, 1) attn_bwd_dq_wgmma_kernel(AttnArgs p, const __grid_constant__ CUtensorMap tq,
                                                                 const __grid_constant__ CUtensorMap tdo,
                                                                 const __grid_constant__ CUtensorMap tk,
                                                                 const __grid_constant__ CUtensorMap tv) {
#ifdef CORE_HAVE_WGMMA
    constexpr int D = 128, BM = ATTN_WGB_ROWS, BN = ATTN_WGB_STEP, BIG = BM * D * 2, SMALL = BN * D * 2;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    uint32_t q_addr = (uint32_t)__cvta_generic_to_shared(wg_align_smem(attn_smem)), o_addr = q_addr + BIG,
             k_addr = o_addr + BIG, v_addr = k_addr + 2 * SMALL, bars = v_addr + 2 * SMALL;
    int mb = gridDim.x - 1 - blockIdx.x, j = blockIdx.y, b = blockIdx.z, g = j / (p.nh / p.nkv);
    int warp = threadIdx.x / 32, m0 = mb * BM;
    int n_lo = attn_first_key_dev(m0, p.window) / BN, n_hi = (min(p.T, m0 + BM) + BN - 1) / BN, N = n_hi - n_lo;
    uint32_t qo_full = bars;
    auto full = [&](int i) { return bars + 8 + 8 * (i & 1); };
    auto empty = [&](int i) { return bars + 24 + 8 * (i & 1); };
    if (threadIdx.x == 0) {
        for (int i = 0; i < 3; i++) wg_bar_init(bars + 8 * i, 1);
        for (int i = 3; i < 5; i++) wg_bar_init(bars + 8 * i, 8); // one lane of each consumer warp
        wg_bar_init_fence();
    }
    __syncthreads();

    if (warp >= 8) {
        wg_setmaxnreg_dec<40>();
        if (threadIdx.x != 256) return;
        wg_bar_expect(qo_full, 2 * BIG); // both tiles in one expect, as in the dK, dV kernel's producer
        wg_tma_tile(q_addr, &tq, j, m0, b, BM, qo_full);
        wg_tma_tile(o_addr, &tdo, j, m0, b, BM, qo_full);
        for (int i = 0; i < N; i++) {
            int row = (n_lo + i) * BN, buf = i & 1;
            wg_wait_released(empty(i), i);
            wg_bar_expect(full(i), 2 * SMALL);
            wg_tma_tile(k_addr + buf * SMALL, &tk, g, row, b, BN, full(i));
            wg_tma_tile(v_addr + buf * SMALL, &tv, g, row, b, BN, full(i));
        }
        return;
    }

    wg_setmaxnreg_inc<232>();
    int wg = warp / 4, w0 = m0 + wg * 64, r0 = m0 + warp * 16;
    bool signal = (threadIdx.x & 31) == 0;
    unsigned wlim = attn_wlim(p.window);
    float lse2[2], delta[2];
    attn_rows_lse_delta(p, b, j, r0, lse2, delta);
    float dq[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;
    float(&dqf)[64] = *reinterpret_cast<float(*)[64]>(&dq);
    wg_bar_wait(qo_full, 0);

    for (int i = 0; i < N; i++) {
        int buf = i & 1, key0 = (n_lo + i) * BN;
        wg_wait_filled(full(i), i);
        bool any = attn_block_any(w0, 64, key0, BN, p.window, p.T);
        float s[BN / 8][4], dp[BN / 8][4];
        float(&sf)[32] = *reinterpret_cast<float(*)[32]>(&s);
        float(&dpf)[32] = *reinterpret_cast<float(*)[32]>(&dp);
        if (any) {
            attn_wg_pair(sf, dpf, q_addr, o_addr, BM, wg * 64, k_addr + buf * SMALL, v_addr + buf * SMALL);
            wg_wait<0>();
            wg_fence_acc(sf);
            wg_fence_acc(dpf);
            if (!attn_block_all(w0, 64, key0, BN, p.window, p.T)) attn_mask_scores<BN / 8>(s, r0, key0, wlim, p.T);
            attn_dq_ds<BN / 8>(s, dp, lse2, delta, p.scale_log2);
            uint32_t da[4][4];
            attn_wg_frags<4>(da, s);
            attn_wg_acc<4>(dqf, da, k_addr + buf * SMALL);
            wg_wait<0>();
            wg_fence_acc(dqf);
        }
        if (signal) wg_bar_arrive(empty(i));
    }
    float scale = p.scale_log2 / ATTN_LOG2E, sc[2] = {scale, scale};
    attn_store_acc<D>((bf16 *)p.dq + ((size_t)b * p.T * p.nh + j) * D, (size_t)p.nh * D, r0, p.T, dq, sc);
#endif
}

static inline void attn_dkdv_wgmma(const AttnArgs &p, int B, cudaStream_t st) {
#ifdef CORE_HAVE_WGMMA
    CUtensorMap tq = wg_tensor_map(p.q, B, p.T, p.nh, ATTN_WGB_STEP),
                tdo = wg_tensor_map(p.dout, B, p.T, p.nh, ATTN_WGB_STEP),
                tk = wg_tensor_map(p.k, B, p.T, p.nkv, ATTN_WGB_ROWS),
                tv = wg_tensor_map(p.v, B, p.T, p.nkv, ATTN_WGB_ROWS);
    attn_launch(attn_bwd_dkdv_wgmma_kernel, dim3((p.T + ATTN_WGB_ROWS - 1) / ATTN_WGB_ROWS, p.nkv, B), 384,
                ATTN_WGB_SMEM, st, p, tq, tdo, tk, tv);
#else
    (void)p, (void)B, (void)st;
    sdm_die("attn_dkdv_wgmma: this build has no sm_90a kernels");
#endif
}
static inline void attn_dq_wgmma(const AttnArgs &p, int B, cudaStream_t st) {
#ifdef CORE_HAVE_WGMMA
    CUtensorMap tq = wg_tensor_map(p.q, B, p.T, p.nh, ATTN_WGB_ROWS),
                tdo = wg_tensor_map(p.dout, B, p.T, p.nh, ATTN_WGB_ROWS),
                tk = wg_tensor_map(p.k, B, p.T, p.nkv, ATTN_WGB_STEP),
                tv = wg_tensor_map(p.v, B, p.T, p.nkv, ATTN_WGB_STEP);
    attn_launch(attn_bwd_dq_wgmma_kernel, dim3((p.T + ATTN_WGB_ROWS - 1) / ATTN_WGB_ROWS, p.nh, B), 384,
                ATTN_WGB_SMEM, st, p, tq, tdo, tk, tv);
#else
    (void)p, (void)B, (void)st;
    sdm_die("attn_dq_wgmma: this build has no sm_90a kernels");
#endif
}

#endif
