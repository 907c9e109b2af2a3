// attention/attn_bwd.cuh: the attention backward on the GPU (docs/MODEL.md#attention): attn_backward overwrites dq
// [B,T,n_h,d_h], dk, dv [B,T,n_kv,d_h] from q, k, v, the forward's out and lse and dout, with delta = rowsum(dout *
// out) [B,n_h,T] fp32 in the workspace. bf16: two tensor-core passes (dK/dV per key tile, dQ per query tile) so
// every output has one owner (at d_h = 128 on sm_90a builds the wgmma kernels of attention/attn_bwd_wgmma.cuh);
// fp32: one warp per row. No atomics: bitwise reproducible.
#ifndef SDM_ATTN_BWD_CUH
#define SDM_ATTN_BWD_CUH

#include "attention/attn_bwd_wgmma.cuh"
#include "attention/attn_common.cuh"
#include "attention/attn_mma.cuh"

// delta[b,j,t] = dout . o (one warp per row), both element types.
template <typename T, int D>
__global__ void attn_delta_kernel(AttnArgs p, int rows) {
    int w = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    if (w >= rows) return;
    int j = w % p.nh, t = w / p.nh % p.T, b = w / p.nh / p.T;
    float x[D / 32];
    attn_load_row<T, D>(x, (const T *)p.dout + (size_t)w * D);
    float d = attn_row_dot<T, D>(x, (const T *)p.o + (size_t)w * D);
    if ((threadIdx.x & 31) == 0) p.delta[((size_t)b * p.nh + j) * p.T + t] = d;
}

// dq of one query row (b, t, j): sum over visible keys s of P (dP - delta) k_s, times 1/sqrt(d_h).
template <int D>
__global__ void attn_bwd_dq_rows_kernel(AttnArgs p, int rows) {
    int w = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    if (w >= rows) return;
    int lane = threadIdx.x & 31, j = w % p.nh, t = w / p.nh % p.T, b = w / p.nh / p.T, g = j / (p.nh / p.nkv);
    size_t hrow = ((size_t)b * p.nh + j) * p.T + t;
    float lse2 = p.lse[hrow] * ATTN_LOG2E, delta = p.delta[hrow];
    float q[D / 32], dout[D / 32], dq[D / 32];
    attn_load_row<float, D>(q, (const float *)p.q + (size_t)w * D);
    attn_load_row<float, D>(dout, (const float *)p.dout + (size_t)w * D);
    for (int i = 0; i < D / 32; i++) dq[i] = 0.0f;
    const float *k = (const float *)p.k + ((size_t)b * p.T * p.nkv + g) * D,
                *v = (const float *)p.v + ((size_t)b * p.T * p.nkv + g) * D;
    for (int s = attn_first_key_dev(t, p.window); s <= t; s++) {
        const float *kr = k + (size_t)s * p.nkv * D, *vr = v + (size_t)s * p.nkv * D;
        float pr = exp2f(attn_row_dot<float, D>(q, kr) * p.scale_log2 - lse2);
        float ds = pr * (attn_row_dot<float, D>(dout, vr) - delta);
        for (int i = 0; i < D / 32; i++) dq[i] += ds * kr[i * 32 + lane];
    }
    float scale = p.scale_log2 / ATTN_LOG2E;
    float *dqrow = (float *)p.dq + (size_t)w * D;
    for (int i = 0; i < D / 32; i++) dqrow[i * 32 + lane] = dq[i] * scale;
}

// dk, dv of one key row (b, s, kv head g): sums over the query heads of the group, then over visible queries p.
template <int D>
__global__ void attn_bwd_dkdv_rows_kernel(AttnArgs p, int rows) {
    int w = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    if (w >= rows) return;
    int lane = threadIdx.x & 31, g = w % p.nkv, s = w / p.nkv % p.T, b = w / p.nkv / p.T, group = p.nh / p.nkv;
    float k[D / 32], v[D / 32], dk[D / 32], dv[D / 32];
    attn_load_row<float, D>(k, (const float *)p.k + (size_t)w * D);
    attn_load_row<float, D>(v, (const float *)p.v + (size_t)w * D);
    for (int i = 0; i < D / 32; i++) dk[i] = dv[i] = 0.0f;
    int p_hi = p.window == 0 ? p.T - 1 : min(p.T - 1, s + p.window - 1);
    for (int j = g * group; j < (g + 1) * group; j++)
        for (int t = s; t <= p_hi; t++) {
            size_t qoff = (((size_t)b * p.T + t) * p.nh + j) * D, hrow = ((size_t)b * p.nh + j) * p.T + t;
            const float *qr = (const float *)p.q + qoff, *dor = (const float *)p.dout + qoff;
            float pr = exp2f(attn_row_dot<float, D>(k, qr) * p.scale_log2 - p.lse[hrow] * ATTN_LOG2E);
            float ds = pr * (attn_row_dot<float, D>(v, dor) - p.delta[hrow]);
            for (int i = 0; i < D / 32; i++) {
                dk[i] += ds * qr[i * 32 + lane];
                dv[i] += pr * dor[i * 32 + lane];
            }
        }
    float scale = p.scale_log2 / ATTN_LOG2E;
    for (int i = 0; i < D / 32; i++) {
        ((float *)p.dk)[(size_t)w * D + i * 32 + lane] = dk[i] * scale;
        ((float *)p.dv)[(size_t)w * D + i * 32 + lane] = dv[i];
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Backward (bf16), two passes so that every output has one owner:
//   dK/dV: CTA = a tile of 16*NW keys of one (b, kv head); each warp owns 16 keys and loops over the query heads of
//          the group and the BM-query tiles that can see them: P^T = exp(K Q^T - lse), dP^T = V dO^T,
//          dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q.
//   dQ:    CTA = a tile of 16*NW queries; loops over key tiles as the forward: dQ += dS K.

template <int D, int NW, int BM, int MINB, bool SKIP>
__global__ void __launch_bounds__(NW * 32, MINB) attn_bwd_dkdv_mma_kernel(AttnArgs p) {
    constexpr int BN = 16 * NW, SD = D + ATTN_PAD, KS = D / 16, NT = BM / 8, DT = D / 8;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    bf16 *Ks = (bf16 *)attn_smem, *Vs = Ks + BN * SD; // [BN][SD] each
    bf16 *Qs = Vs + BN * SD, *Os = Qs + 2 * BM * SD;  // Q, dO: [2][BM][SD] each
    float *Ls = (float *)(Os + 2 * BM * SD), *Ds = Ls + 2 * BM; // lse (base 2), delta: [2][BM] each
    int g = blockIdx.y, b = blockIdx.z, warp = threadIdx.x / 32, group = p.nh / p.nkv;
    int n0 = blockIdx.x * BN, k0 = n0 + warp * 16;
    size_t qstride = (size_t)p.nh * D, kstride = (size_t)p.nkv * D;
    const bf16 *kg = (const bf16 *)p.k + ((size_t)b * p.T * p.nkv + g) * D;
    const bf16 *vg = (const bf16 *)p.v + ((size_t)b * p.T * p.nkv + g) * D;
    int q_hi = p.window == 0 ? p.T : min(p.T, n0 + BN - 1 + p.window); // queries < q_hi can see the tile
    int m_lo = n0 / BM, m_hi = (q_hi + BM - 1) / BM, per_head = m_hi - m_lo, steps = per_head * group;
    int query_hi = attn_keys_query_hi(k0, p.window, p.T);

    // step i = (head j = g*group + i / per_head, query tile m_lo + i % per_head)
    auto load_step = [&](int i, int buf) {
        int j = g * group + i / per_head, m0 = (m_lo + i % per_head) * BM;
        const bf16 *qg = (const bf16 *)p.q + ((size_t)b * p.T * p.nh + j) * D;
        const bf16 *dog = (const bf16 *)p.dout + ((size_t)b * p.T * p.nh + j) * D;
        attn_load_tile<D, BM, NW * 32>(Qs + buf * BM * SD, qg, m0, p.T, qstride);
        attn_load_tile<D, BM, NW * 32>(Os + buf * BM * SD, dog, m0, p.T, qstride);
        for (int r = threadIdx.x; r < BM; r += NW * 32) {
            size_t hrow = ((size_t)b * p.nh + j) * p.T + m0 + r;
            bool ok = m0 + r < p.T;
            Ls[buf * BM + r] = ok ? p.lse[hrow] * ATTN_LOG2E : 0.0f;
            Ds[buf * BM + r] = ok ? p.delta[hrow] : 0.0f;
        }
    };

    attn_load_tile<D, BN, NW * 32>(Ks, kg, n0, p.T, kstride);
    attn_load_tile<D, BN, NW * 32>(Vs, vg, n0, p.T, kstride);
    load_step(0, 0);
    core_cp_async_commit();

    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[dt][e] = dv[dt][e] = 0.0f;

    for (int i = 0; i < steps; i++) {
        int buf = i & 1, m0 = (m_lo + i % per_head) * BM;
        if (i + 1 < steps) load_step(i + 1, buf ^ 1);
        core_cp_async_commit();
        core_cp_async_wait<1>();
        __syncthreads();
        unsigned wlim = attn_wlim(p.window);
        auto tile = [&](auto partial) {
            constexpr bool PARTIAL = decltype(partial)::value, SKIPS = PARTIAL && SKIP;
            const bf16 *Qb = Qs + buf * BM * SD, *Ob = Os + buf * BM * SD;
            const float *Lb = Ls + buf * BM, *Db = Ds + buf * BM;
            int glo = 0, ghi = BM / 16;
            if (SKIPS) attn_groups(m0, BM, k0, query_hi, glo, ghi);
            float st[NT][4], dpt[NT][4]; // S^T, dP^T: 16 keys x BM queries
            attn_mma_bt_pair<NT, KS, SKIPS>(st, dpt, Ks, Qb, Vs, Ob, SD, warp * 16, glo, ghi);
            if (PARTIAL) attn_dkdv_mask<NT>(st, k0, m0, wlim, p.T);
            attn_dkdv_p_ds<NT>(st, dpt, Lb, Db, p.scale_log2);
#pragma unroll
            for (int kk = 0; kk < BM / 16; kk++) {
                if (SKIPS && (kk < glo || kk >= ghi)) continue;
                uint32_t a[4];
                attn_acc_to_a<NT>(a, st, kk);
                attn_mma_b<DT>(dv, a, Ob, SD, kk * 16);
                attn_acc_to_a<NT>(a, dpt, kk);
                attn_mma_b<DT>(dk, a, Qb, SD, kk * 16);
            }
        };
        if (attn_block_all(m0, BM, k0, 16, p.window, p.T)) tile(std::false_type());
        else if (attn_block_any(m0, BM, k0, 16, p.window, p.T)) tile(std::true_type());
        __syncthreads();
    }
    float one[2] = {1.0f, 1.0f}, scale = p.scale_log2 / ATTN_LOG2E, sc[2] = {scale, scale};
    attn_store_acc<D>((bf16 *)p.dk + ((size_t)b * p.T * p.nkv + g) * D, kstride, k0, p.T, dk, sc);
    attn_store_acc<D>((bf16 *)p.dv + ((size_t)b * p.T * p.nkv + g) * D, kstride, k0, p.T, dv, one);
}

template <int D, int NW, int BN, int MINB, bool SKIP>
__global__ void __launch_bounds__(NW * 32, MINB) attn_bwd_dq_mma_kernel(AttnArgs p) {
    constexpr int BM = 16 * NW, SD = D + ATTN_PAD, KS = D / 16, NT = BN / 8, DT = D / 8;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    bf16 *Qs = (bf16 *)attn_smem, *Os = Qs + BM * SD, *Ks = Os + BM * SD, *Vs = Ks + 2 * BN * SD;
    int mb = gridDim.x - 1 - blockIdx.x, j = blockIdx.y, b = blockIdx.z, g = j / (p.nh / p.nkv);
    int warp = threadIdx.x / 32, m0 = mb * BM, r0 = m0 + warp * 16;
    size_t qstride = (size_t)p.nh * D, kstride = (size_t)p.nkv * D;
    const bf16 *kg = (const bf16 *)p.k + ((size_t)b * p.T * p.nkv + g) * D;
    const bf16 *vg = (const bf16 *)p.v + ((size_t)b * p.T * p.nkv + g) * D;
    int n_lo = attn_first_key_dev(m0, p.window) / BN, n_hi = (min(p.T, m0 + BM) + BN - 1) / BN;
    int key_lo = attn_first_key_dev(r0, p.window), key_hi = attn_rows_key_hi(r0, p.T);

    attn_load_tile<D, BM, NW * 32>(Qs, (const bf16 *)p.q + ((size_t)b * p.T * p.nh + j) * D, m0, p.T, qstride);
    attn_load_tile<D, BM, NW * 32>(Os, (const bf16 *)p.dout + ((size_t)b * p.T * p.nh + j) * D, m0, p.T, qstride);
    attn_load_tile<D, BN, NW * 32>(Ks, kg, n_lo * BN, p.T, kstride);
    attn_load_tile<D, BN, NW * 32>(Vs, vg, n_lo * BN, p.T, kstride);
    core_cp_async_commit();

    float lse2[2], delta[2];
    attn_rows_lse_delta(p, b, j, r0, lse2, delta);
    float dq[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;

    for (int n = n_lo; n < n_hi; n++) {
        int buf = (n - n_lo) & 1, key0 = n * BN;
        attn_kv_step<D, BN, NW * 32>(Ks, Vs, kg, vg, buf ^ 1, n + 1 < n_hi, key0 + BN, p.T, kstride);
        unsigned wlim = attn_wlim(p.window);
        auto tile = [&](auto partial) {
            constexpr bool PARTIAL = decltype(partial)::value, SKIPS = PARTIAL && SKIP;
            const bf16 *Kb = Ks + buf * BN * SD, *Vb = Vs + buf * BN * SD;
            int glo = 0, ghi = BN / 16;
            if (SKIPS) attn_groups(key0, BN, key_lo, key_hi, glo, ghi);
            float s[NT][4], dp[NT][4]; // S, dP: 16 queries x BN keys
            attn_mma_bt_pair<NT, KS, SKIPS>(s, dp, Qs, Kb, Os, Vb, SD, warp * 16, glo, ghi);
            if (PARTIAL) attn_mask_scores<NT>(s, r0, key0, wlim, p.T); // rows >= T are never stored
            attn_dq_ds<NT>(s, dp, lse2, delta, p.scale_log2);
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                if (SKIPS && (kk < glo || kk >= ghi)) continue;
                uint32_t a[4];
                attn_acc_to_a<NT>(a, s, kk);
                attn_mma_b<DT>(dq, a, Kb, SD, kk * 16);
            }
        };
        if (attn_block_all(r0, 16, key0, BN, p.window, p.T)) tile(std::false_type());
        else if (attn_block_any(r0, 16, key0, BN, p.window, p.T)) tile(std::true_type());
        __syncthreads();
    }
    float scale = p.scale_log2 / ATTN_LOG2E, sc[2] = {scale, scale};
    attn_store_acc<D>((bf16 *)p.dq + ((size_t)b * p.T * p.nh + j) * D, qstride, r0, p.T, dq, sc);
}

template <int D, int NW, int BM, int MINB, bool SKIP>
static inline void attn_dkdv_mma(const AttnArgs &p, int B, cudaStream_t st) {
    constexpr int BN = 16 * NW;
    size_t smem = (size_t)(2 * BN + 4 * BM) * (D + ATTN_PAD) * sizeof(bf16) + 4 * BM * sizeof(float);
    attn_launch(attn_bwd_dkdv_mma_kernel<D, NW, BM, MINB, SKIP>, dim3((p.T + BN - 1) / BN, p.nkv, B),
                NW * 32, smem, st, p);
}

template <int D, int NW, int BN, int MINB, bool SKIP>
static inline void attn_dq_mma(const AttnArgs &p, int B, cudaStream_t st) {
    constexpr int BM = 16 * NW;
    size_t smem = (size_t)(2 * BM + 4 * BN) * (D + ATTN_PAD) * sizeof(bf16);
    attn_launch(attn_bwd_dq_mma_kernel<D, NW, BN, MINB, SKIP>, dim3((p.T + BM - 1) / BM, p.nh, B),
                NW * 32, smem, st, p);
}

template <typename T, int D> static inline void attn_delta(const AttnArgs &p, int B, cudaStream_t st) {
    attn_launch_rows(attn_delta_kernel<T, D>, B * p.T * p.nh, st, p);
}

// Workspace of the backward: delta [B,n_h,T] fp32.
static inline size_t attn_backward_workspace_bytes(const AttnDims *a, int B, int T) {
    return (size_t)B * a->n_heads * T * sizeof(float);
}

template <int D> static inline void attn_backward_d(const AttnArgs &p, int B, Dtype dt, cudaStream_t st) {
    if (dt == DT_FP32) {
        attn_delta<float, D>(p, B, st);
        attn_launch_rows(attn_bwd_dq_rows_kernel<D>, B * p.T * p.nh, st, p);
        attn_launch_rows(attn_bwd_dkdv_rows_kernel<D>, B * p.T * p.nkv, st, p);
        return;
    }
    attn_delta<bf16, D>(p, B, st);
    if (attn_use_wgmma(D)) {
        attn_dkdv_wgmma(p, B, st);
        attn_dq_wgmma(p, B, st);
        return;
    }
    attn_dkdv_mma<D, ATTN_DKDV_CFG>(p, B, st);
    attn_dq_mma<D, ATTN_DQ_CFG>(p, B, st);
}

// Given the forward's out and lse and the gradient dout, overwrite dq, dk, dv (same element type as q, k, v).
static inline void attn_backward(const AttnDims *a, int B, int T, Dtype dt, const void *q, const void *k,
                                 const void *v, const void *out, const float *lse, const void *dout, void *dq, void *dk,
                                 void *dv, void *workspace, cudaStream_t st) {
    attn_check_dims(a);
    if (B == 0 || T == 0) return;
    AttnArgs p = attn_args(a, T);
    p.q = q; p.k = k; p.v = v; p.o = out; p.dout = dout; p.lse = (float *)lse;
    p.dq = dq; p.dk = dk; p.dv = dv; p.delta = (float *)workspace;
    if (a->head_dim == 64) attn_backward_d<64>(p, B, dt, st);
    else attn_backward_d<128>(p, B, dt, st);
}

#endif
