// attention/attn_bwd_wgmma.cuh: the bf16 attention backward at d_h = 128 with Hopper warpgroup MMAs (wgmma, sm_90a;
// core/wgmma.cuh): the two passes of attention/attn_bwd.cuh (dK/dV per key tile, dQ per query tile, every output
// with one owner, no atomics) with each warpgroup's products as wgmma. Both warpgroups of a CTA load the shared tiles
// (cp.async, double-buffered) and meet at a barrier once a tile.
#ifndef SDM_ATTN_BWD_WGMMA_CUH
#define SDM_ATTN_BWD_WGMMA_CUH

#include "attention/attn_fwd_wgmma.cuh" // attn_load_tile_sw
#include "attention/attn_mma.cuh"
#include "core/wgmma.cuh"

#define ATTN_WGB_ROWS 128 // a CTA's own rows (keys for dK/dV, queries for dQ): two warpgroups of 64
#define ATTN_WGB_STEP 64  // the rows of the other side a step brings (queries for dK/dV, keys for dQ)
#define ATTN_WGB_SMEM \
    ((size_t)(2 * ATTN_WGB_ROWS + 4 * ATTN_WGB_STEP) * 128 * sizeof(bf16) + 4 * ATTN_WGB_STEP * sizeof(float) + 1024)

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

// dK/dV: CTA = 128 keys of one (b, kv head), warpgroup w its keys 64w.., warp i of it 16; steps over the query heads
// of the group and the 64-query tiles that can see the keys, as attn_bwd_dkdv_mma_kernel: S^T = K Q^T,
// dP^T = V dO^T, P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q.
__global__ void __launch_bounds__(256, 1) attn_bwd_dkdv_wgmma_kernel(AttnArgs p) {
#ifdef CORE_HAVE_WGMMA
    constexpr int D = 128, BN = ATTN_WGB_ROWS, BM = ATTN_WGB_STEP, BIG = BN * D * 2, SMALL = BM * D * 2;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    unsigned char *Ks = wg_align_smem(attn_smem);
    unsigned char *Vs = Ks + BIG, *Qs = Vs + BIG, *Os = Qs + 2 * SMALL; // Q, dO: [2] tiles each
    float *Ls = (float *)(Os + 2 * SMALL), *Ds = Ls + 2 * BM;          // lse (base 2), delta: [2][BM] each
    uint32_t k_addr = (uint32_t)__cvta_generic_to_shared(Ks), v_addr = k_addr + BIG, q_addr = v_addr + BIG,
             o_addr = q_addr + 2 * SMALL;
    int g = blockIdx.y, b = blockIdx.z, warp = threadIdx.x / 32, wg = warp / 4, group = p.nh / p.nkv;
    int n0 = blockIdx.x * BN, k0 = n0 + warp * 16, kw = n0 + wg * 64;
    size_t qstride = (size_t)p.nh * D, kstride = (size_t)p.nkv * D;
    int q_hi = p.window == 0 ? p.T : min(p.T, n0 + BN - 1 + p.window); // queries < q_hi can see the tile
    int m_lo = n0 / BM, m_hi = (q_hi + BM - 1) / BM, per_head = m_hi - m_lo, steps = per_head * group;
    unsigned wlim = attn_wlim(p.window);

    // step i = (head j = g*group + i / per_head, query tile m_lo + i % per_head)
    auto load_step = [&](int i, int buf) {
        int j = g * group + i / per_head, m0 = (m_lo + i % per_head) * BM;
        attn_load_tile_sw<BM, 256>(Qs + buf * SMALL, (const bf16 *)p.q + ((size_t)b * p.T * p.nh + j) * D, m0, p.T,
                                   qstride);
        attn_load_tile_sw<BM, 256>(Os + buf * SMALL, (const bf16 *)p.dout + ((size_t)b * p.T * p.nh + j) * D, m0,
                                   p.T, qstride);
        for (int r = threadIdx.x; r < BM; r += 256) {
            size_t hrow = ((size_t)b * p.nh + j) * p.T + m0 + r;
            bool ok = m0 + r < p.T;
            Ls[buf * BM + r] = ok ? p.lse[hrow] * ATTN_LOG2E : 0.0f;
            Ds[buf * BM + r] = ok ? p.delta[hrow] : 0.0f;
        }
    };

    attn_load_tile_sw<BN, 256>(Ks, (const bf16 *)p.k + ((size_t)b * p.T * p.nkv + g) * D, n0, p.T, kstride);
    attn_load_tile_sw<BN, 256>(Vs, (const bf16 *)p.v + ((size_t)b * p.T * p.nkv + g) * D, n0, p.T, kstride);
    load_step(0, 0);
    core_cp_async_commit();

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[dt][e] = dv[dt][e] = 0.0f;
    float(&dkf)[64] = *reinterpret_cast<float(*)[64]>(&dk);
    float(&dvf)[64] = *reinterpret_cast<float(*)[64]>(&dv);

    for (int i = 0; i < steps; i++) {
        int buf = i & 1, m0 = (m_lo + i % per_head) * BM;
        if (i + 1 < steps) load_step(i + 1, buf ^ 1);
        core_cp_async_commit();
        core_cp_async_wait<1>();
        wg_fence_smem();
        __syncthreads();
        if (attn_block_any(m0, BM, kw, 64, p.window, p.T)) { // uniform over the warpgroup
            const float *Lb = Ls + buf * BM, *Db = Ds + buf * BM;
            float st[BM / 8][4], dpt[BM / 8][4]; // S^T, dP^T: 16 keys x 64 queries a warp
            float(&stf)[32] = *reinterpret_cast<float(*)[32]>(&st);
            float(&dptf)[32] = *reinterpret_cast<float(*)[32]>(&dpt);
            attn_wg_pair(stf, dptf, k_addr, v_addr, BN, wg * 64, q_addr + buf * SMALL, o_addr + buf * SMALL);
            wg_wait<0>();
            wg_fence_acc(stf);
            wg_fence_acc(dptf);
            if (!attn_block_all(m0, BM, kw, 64, p.window, p.T)) attn_dkdv_mask<BM / 8>(st, k0, m0, wlim, p.T);
            attn_dkdv_p_ds<BM / 8>(st, dpt, Lb, Db, p.scale_log2);
            uint32_t pa[4][4], da[4][4];
            attn_wg_frags<4>(pa, st);
            attn_wg_frags<4>(da, dpt);
            attn_wg_acc<4>(dvf, pa, o_addr + buf * SMALL);
            attn_wg_acc<4>(dkf, da, q_addr + buf * SMALL);
            wg_wait<0>();
            wg_fence_acc(dvf);
            wg_fence_acc(dkf);
        }
        __syncthreads(); // every warpgroup's products have read this buffer before it is loaded again
    }
    float one[2] = {1.0f, 1.0f}, scale = p.scale_log2 / ATTN_LOG2E, sc[2] = {scale, scale};
    attn_store_acc<D>((bf16 *)p.dk + ((size_t)b * p.T * p.nkv + g) * D, kstride, k0, p.T, dk, sc);
    attn_store_acc<D>((bf16 *)p.dv + ((size_t)b * p.T * p.nkv + g) * D, kstride, k0, p.T, dv, one);
#endif
}

// dQ: CTA = 128 queries of one (b, head), warpgroup w its queries 64w.., warp i of it 16; loops over the 64-key
// tiles as the forward: S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.
__global__ void __launch_bounds__(256, 1) attn_bwd_dq_wgmma_kernel(AttnArgs p) {
#ifdef CORE_HAVE_WGMMA
    constexpr int D = 128, BM = ATTN_WGB_ROWS, BN = ATTN_WGB_STEP, BIG = BM * D * 2, SMALL = BN * D * 2;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    unsigned char *Qs = wg_align_smem(attn_smem);
    unsigned char *Os = Qs + BIG, *Ks = Os + BIG, *Vs = Ks + 2 * SMALL; // K, V: [2] tiles each
    uint32_t q_addr = (uint32_t)__cvta_generic_to_shared(Qs), o_addr = q_addr + BIG, k_addr = o_addr + BIG,
             v_addr = k_addr + 2 * SMALL;
    int mb = gridDim.x - 1 - blockIdx.x, j = blockIdx.y, b = blockIdx.z, g = j / (p.nh / p.nkv); // longest first
    int warp = threadIdx.x / 32, wg = warp / 4, m0 = mb * BM, w0 = m0 + wg * 64, r0 = m0 + warp * 16;
    size_t qstride = (size_t)p.nh * D, kstride = (size_t)p.nkv * D;
    const bf16 *kg = (const bf16 *)p.k + ((size_t)b * p.T * p.nkv + g) * D;
    const bf16 *vg = (const bf16 *)p.v + ((size_t)b * p.T * p.nkv + g) * D;
    int n_lo = attn_first_key_dev(m0, p.window) / BN, n_hi = (min(p.T, m0 + BM) + BN - 1) / BN;
    unsigned wlim = attn_wlim(p.window);

    attn_load_tile_sw<BM, 256>(Qs, (const bf16 *)p.q + ((size_t)b * p.T * p.nh + j) * D, m0, p.T, qstride);
    attn_load_tile_sw<BM, 256>(Os, (const bf16 *)p.dout + ((size_t)b * p.T * p.nh + j) * D, m0, p.T, qstride);
    attn_load_tile_sw<BN, 256>(Ks, kg, n_lo * BN, p.T, kstride);
    attn_load_tile_sw<BN, 256>(Vs, vg, n_lo * BN, p.T, kstride);
    core_cp_async_commit();

    float lse2[2], delta[2];
    attn_rows_lse_delta(p, b, j, r0, lse2, delta);
    float dq[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;
    float(&dqf)[64] = *reinterpret_cast<float(*)[64]>(&dq);

    for (int n = n_lo; n < n_hi; n++) {
        int buf = (n - n_lo) & 1, key0 = n * BN;
        if (n + 1 < n_hi) {
            attn_load_tile_sw<BN, 256>(Ks + (buf ^ 1) * SMALL, kg, key0 + BN, p.T, kstride);
            attn_load_tile_sw<BN, 256>(Vs + (buf ^ 1) * SMALL, vg, key0 + BN, p.T, kstride);
        }
        core_cp_async_commit();
        core_cp_async_wait<1>();
        wg_fence_smem();
        __syncthreads();
        if (attn_block_any(w0, 64, key0, BN, p.window, p.T)) { // uniform over the warpgroup
            float s[BN / 8][4], dp[BN / 8][4]; // S, dP: 16 queries x 64 keys a warp
            float(&sf)[32] = *reinterpret_cast<float(*)[32]>(&s);
            float(&dpf)[32] = *reinterpret_cast<float(*)[32]>(&dp);
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
        __syncthreads(); // every warpgroup's products have read this buffer before it is loaded again
    }
    float scale = p.scale_log2 / ATTN_LOG2E, sc[2] = {scale, scale};
    attn_store_acc<D>((bf16 *)p.dq + ((size_t)b * p.T * p.nh + j) * D, qstride, r0, p.T, dq, sc);
#endif
}

static inline void attn_dkdv_wgmma(const AttnArgs &p, int B, cudaStream_t st) {
    attn_launch(attn_bwd_dkdv_wgmma_kernel, dim3((p.T + ATTN_WGB_ROWS - 1) / ATTN_WGB_ROWS, p.nkv, B), 256,
                ATTN_WGB_SMEM, st, p);
}
static inline void attn_dq_wgmma(const AttnArgs &p, int B, cudaStream_t st) {
    attn_launch(attn_bwd_dq_wgmma_kernel, dim3((p.T + ATTN_WGB_ROWS - 1) / ATTN_WGB_ROWS, p.nh, B), 256,
                ATTN_WGB_SMEM, st, p);
}

#endif
