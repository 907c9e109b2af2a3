// attention/attn_fwd.cuh: the attention forward on the GPU (docs/MODEL.md#attention): attn_forward gives out
// [B,T,n_h,d_h] = softmax(q k^T / sqrt(d_h), causal or sliding-window mask) v from q [B,T,n_h,d_h], k, v [B,T,n_kv,d_h]
// (after RoPE) and, for training, lse [B,n_h,T] fp32. bf16: the flash-style tensor-core kernel; fp32: one warp per row.
#ifndef SDM_ATTN_FWD_CUH
#define SDM_ATTN_FWD_CUH

#include "attention/attn_common.cuh"
#include "attention/attn_fwd_wgmma.cuh"
#include "attention/attn_mma.cuh"

// One warp per (b, t, head j): out row and lse.
template <int D>
__global__ void attn_fwd_rows_kernel(AttnArgs p, int rows) {
    int w = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    if (w >= rows) return;
    int j = w % p.nh, t = w / p.nh % p.T, b = w / p.nh / p.T, g = j / (p.nh / p.nkv);
    const float *qrow = (const float *)p.q + (size_t)w * D;
    AttnKvRows<float> kv = {(const float *)p.k + ((size_t)b * p.T * p.nkv + g) * D,
                            (const float *)p.v + ((size_t)b * p.T * p.nkv + g) * D, (size_t)p.nkv * D, 0x7fffffff};
    float q[D / 32], o[D / 32], l, lse;
    attn_load_row<float, D>(q, qrow);
    attn_warp_attend<float, D>(q, kv, attn_first_key_dev(t, p.window), t, p.scale_log2, o, l, lse);
    float *orow = (float *)p.out + (size_t)w * D;
    for (int i = 0; i < D / 32; i++) orow[i * 32 + (threadIdx.x & 31)] = o[i] / l;
    if (p.lse && (threadIdx.x & 31) == 0) p.lse[((size_t)b * p.nh + j) * p.T + t] = lse;
}

// ---------------------------------------------------------------------------------------------------------------
// Forward (bf16): CTA = NW warps = a tile of 16*MT*NW queries of one (b, head); each warp owns 16*MT query rows
// (MT row tiles share every K and V fragment it reads) and loops over the BN-key tiles its rows can see (K, V
// double-buffered by cp.async), keeping a running max and sum; key tiles no row of the CTA can see are never loaded,
// so a window costs O(w) per query. A tile wholly inside the mask runs branch-free; a partial one is masked, and with
// SKIP its 16-key groups no row of the warp can see are skipped.

template <int D, int NW, int BN, int MT, int MINB, bool SKIP>
__global__ void __launch_bounds__(NW * 32, MINB) attn_fwd_mma_kernel(AttnArgs p) {
    constexpr int RW = 16 * MT, BM = RW * NW, SD = D + ATTN_PAD, KS = D / 16, NT = BN / 8, DT = D / 8;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    bf16 *Qs = (bf16 *)attn_smem, *Ks = Qs + BM * SD, *Vs = Ks + 2 * BN * SD; // Q [BM][SD]; K, V [2][BN][SD]
    int mb = gridDim.x - 1 - blockIdx.x, j = blockIdx.y, b = blockIdx.z, g = j / (p.nh / p.nkv); // longest tiles first
    int warp = threadIdx.x / 32, m0 = mb * BM, r0 = m0 + warp * RW;
    const bf16 *qg = (const bf16 *)p.q + ((size_t)b * p.T * p.nh + j) * D;
    const bf16 *kg = (const bf16 *)p.k + ((size_t)b * p.T * p.nkv + g) * D;
    const bf16 *vg = (const bf16 *)p.v + ((size_t)b * p.T * p.nkv + g) * D;
    size_t qstride = (size_t)p.nh * D, kstride = (size_t)p.nkv * D;
    int n_lo = attn_first_key_dev(m0, p.window) / BN, n_hi = (min(p.T, m0 + BM) + BN - 1) / BN;
    int key_lo = attn_first_key_dev(r0, p.window), key_hi = min(r0 + RW - 1, p.T - 1);

    attn_load_tile<D, BM, NW * 32>(Qs, qg, m0, p.T, qstride);
    attn_load_tile<D, BN, NW * 32>(Ks, kg, n_lo * BN, p.T, kstride);
    attn_load_tile<D, BN, NW * 32>(Vs, vg, n_lo * BN, p.T, kstride);
    core_cp_async_commit();

    float o[MT][DT][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
    }

    for (int n = n_lo; n < n_hi; n++) {
        int buf = (n - n_lo) & 1, key0 = n * BN;
        attn_kv_step<D, BN, NW * 32>(Ks, Vs, kg, vg, buf ^ 1, n + 1 < n_hi, key0 + BN, p.T, kstride);
        unsigned wlim = attn_wlim(p.window);
        auto tile = [&](auto partial) {
            constexpr bool PARTIAL = decltype(partial)::value, SKIPS = PARTIAL && SKIP;
            const bf16 *Kb = Ks + buf * BN * SD, *Vb = Vs + buf * BN * SD;
            int glo = 0, ghi = BN / 16;
            if (SKIPS) attn_groups(key0, BN, key_lo, key_hi, glo, ghi);
            float s[MT][NT][4]; // raw scores q.k, masked to -inf
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) attn_ldsm_a(a[mt], Qs, SD, warp * RW + mt * 16, ks * 16);
                attn_mma_bt_m<MT, NT, SKIPS>(s, a, Kb, SD, ks * 16, glo, ghi);
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (PARTIAL) attn_mask_scores<NT>(s[mt], r0 + mt * 16, key0, wlim, p.T);
                attn_online_softmax<NT, DT>(s[mt], m[mt], l[mt], o[mt], p.scale_log2);
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                if (SKIPS && (kk < glo || kk >= ghi)) continue;
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) attn_acc_to_a<NT>(a[mt], s[mt], kk);
                attn_mma_b_m<MT, DT>(o, a, Vb, SD, kk * 16);
            }
        };
        if (attn_block_all(r0, RW, key0, BN, p.window, p.T)) tile(std::false_type());
        else if (attn_block_any(r0, RW, key0, BN, p.window, p.T)) tile(std::true_type());
        __syncthreads();
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++) attn_fwd_finish<D>(p, b, j, r0 + mt * 16, m[mt], l[mt], o[mt]);
}

// The tensor-core kernels at a given tile configuration (NW warps, BN/BM tile, MINB CTAs per SM). The defaults below
// were chosen by tests/bench_attention.cu, which also times the alternatives.
template <int D, int NW, int BN, int MT, int MINB, bool SKIP>
static inline void attn_fwd_mma(const AttnArgs &p, int B, cudaStream_t st) {
    constexpr int BM = 16 * MT * NW;
    size_t smem = (size_t)(BM + 4 * BN) * (D + ATTN_PAD) * sizeof(bf16);
    attn_launch(attn_fwd_mma_kernel<D, NW, BN, MT, MINB, SKIP>, dim3((p.T + BM - 1) / BM, p.nh, B),
                NW * 32, smem, st, p);
}

// The mma.sync forward at the configuration for this mask.
template <int D> static inline void attn_fwd_mma_for_mask(const AttnArgs &p, int B, cudaStream_t st) {
    if (p.window > 0 && p.window <= 256) attn_fwd_mma<D, ATTN_FWD_SWA_CFG>(p, B, st);
    else attn_fwd_mma<D, ATTN_FWD_CFG>(p, B, st);
}

template <int D> static inline void attn_forward_d(const AttnArgs &p, int B, Dtype dt, cudaStream_t st) {
    if (dt == DT_FP32) attn_launch_rows(attn_fwd_rows_kernel<D>, B * p.T * p.nh, st, p);
    else if (attn_use_wgmma(D)) attn_fwd_wgmma(p, B, st);
    else attn_fwd_mma_for_mask<D>(p, B, st);
}

// out = attention(q, k, v) after RoPE; lse [B,n_h,T] is written when non-NULL (training), skipped for inference.
static inline void attn_forward(const AttnDims *a, int B, int T, Dtype dt, const void *q, const void *k,
                                const void *v, void *out, float *lse, cudaStream_t st) {
    attn_check_dims(a);
    if (B == 0 || T == 0) return;
    AttnArgs p = attn_args(a, T);
    p.q = q; p.k = k; p.v = v; p.out = out; p.lse = lse;
    if (a->head_dim == 64) attn_forward_d<64>(p, B, dt, st);
    else attn_forward_d<128>(p, B, dt, st);
}

#endif
