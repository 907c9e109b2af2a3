// attention/attn_mma.cuh: the tensor-core building blocks of the bf16 attention kernels (mma.sync m16n8k16, fp32
// accumulation): cp.async tile loads into padded shared-memory tiles, ldmatrix fragments, the MMA products, the
// accumulator layout and stores, the mask tests of a (query tile, key tile) block, and the default tile
// configurations of the forward and backward kernels.
#ifndef SDM_ATTN_MMA_CUH
#define SDM_ATTN_MMA_CUH

#include "attention/attn_common.cuh"

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core building blocks (bf16 m16n8k16, fp32 accumulate). Shared-memory tiles are row-major with rows padded
// by 8 elements (16 bytes), so the 8 rows an ldmatrix phase reads fall in distinct banks.

#define ATTN_PAD 8

// Default configurations <warps, tile, [row tiles per warp,] CTAs per SM, skip>: forward: 16*MT*warps queries
// against tile keys; dQ: 16*warps queries against tile keys; dK/dV: 16*warps keys against tile queries. skip: partial
// tiles skip the 16-wide groups no row of the warp can see (fewer products, more branches); skipping or not gives the
// same values. Chosen from the variants tests/bench_attention.cu times (H200, d=128, B=4, T=4096, 16 heads): the
// forward runs 4 warps of 32 rows for full attention and 4 warps of 16 rows for windows up to 256, without skipping.
#define ATTN_FWD_CFG 4, 64, 2, 1, false
#define ATTN_FWD_SWA_CFG 4, 64, 1, 2, false
#define ATTN_DKDV_CFG 4, 64, 2, true
#define ATTN_DQ_CFG 4, 64, 2, true

// rows [row0, row0+ROWS) of a [T, stride] bf16 matrix (D columns used) into smem [ROWS][D+PAD]; rows >= T read as 0.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void attn_load_tile(bf16 *smem, const bf16 *g, int row0, int T, size_t stride) {
    constexpr int CH = D / 8;
    for (int c = threadIdx.x; c < ROWS * CH; c += THREADS) {
        int r = c / CH, col = (c % CH) * 8, t = row0 + r;
        bool ok = t < T;
        core_cp_async16(smem + r * (D + ATTN_PAD) + col, ok ? g + (size_t)t * stride + col : g, ok);
    }
}

// The key loop's step over double-buffered K and V tiles [2][BN][D+PAD]: with `more`, the tiles from key `next` into
// buffer nbuf; then wait until the current buffer's have landed and every thread sees them.
template <int D, int BN, int THREADS>
__device__ __forceinline__ void attn_kv_step(bf16 *Ks, bf16 *Vs, const bf16 *kg, const bf16 *vg, int nbuf, bool more,
                                             int next, int T, size_t stride) {
    if (more) {
        attn_load_tile<D, BN, THREADS>(Ks + nbuf * BN * (D + ATTN_PAD), kg, next, T, stride);
        attn_load_tile<D, BN, THREADS>(Vs + nbuf * BN * (D + ATTN_PAD), vg, next, T, stride);
    }
    core_cp_async_commit();
    core_cp_async_wait<1>();
    __syncthreads();
}

__device__ __forceinline__ void attn_ldsm_x4(uint32_t (&r)[4], const bf16 *p, bool trans) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// A fragment (16 rows x 16 k) at (row0, k0) of a [rows][k] tile.
__device__ __forceinline__ void attn_ldsm_a(uint32_t (&a)[4], const bf16 *tile, int sd, int row0, int k0) {
    int l = threadIdx.x & 31;
    attn_ldsm_x4(a, tile + (row0 + (l & 7) + ((l >> 3) & 1) * 8) * sd + k0 + (l >> 4) * 8, false);
}

// B fragments of n-tiles n0 and n0+8 (b[0..1], b[2..3]) for k-step k0, from a tile stored [n][k] (e.g. K for Q K^T).
__device__ __forceinline__ void attn_ldsm_b_nk(uint32_t (&b)[4], const bf16 *tile, int sd, int n0, int k0) {
    int l = threadIdx.x & 31;
    attn_ldsm_x4(b, tile + (n0 + (l & 7) + (l >> 4) * 8) * sd + k0 + ((l >> 3) & 1) * 8, false);
}

// The same from a tile stored [k][n] (e.g. V for P V), transposed by ldmatrix.
__device__ __forceinline__ void attn_ldsm_b_kn(uint32_t (&b)[4], const bf16 *tile, int sd, int k0, int n0) {
    int l = threadIdx.x & 31;
    attn_ldsm_x4(b, tile + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * sd + n0 + (l >> 4) * 8, true);
}

__device__ __forceinline__ void attn_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[mt] (16 x 8NT) += a[mt] (16 x 16, k-step k0) . B^T for MT row tiles sharing each B fragment; B stored [n][k]
// from row 0. SKIP: only the 16-column groups [glo, ghi) (the others hold no visible pair and stay as they are);
// otherwise all, with no branches.
template <int MT, int NT, bool SKIP>
__device__ __forceinline__ void attn_mma_bt_m(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][4], const bf16 *tile,
                                              int sd, int k0, int glo, int ghi) {
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
        if (SKIP && (nt / 2 < glo || nt / 2 >= ghi)) continue;
        uint32_t b[4];
        attn_ldsm_b_nk(b, tile, sd, nt * 8, k0);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            attn_mma(acc[mt][nt], a[mt], b[0], b[1]);
            attn_mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
        }
    }
}

// acc[mt] (16 x 8NT) += a[mt] (16 x 16) . B, B stored [k][n] with the k-step at row k0.
template <int MT, int NT>
__device__ __forceinline__ void attn_mma_b_m(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][4], const bf16 *tile,
                                             int sd, int k0) {
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
        uint32_t b[4];
        attn_ldsm_b_kn(b, tile, sd, k0, nt * 8);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            attn_mma(acc[mt][nt], a[mt], b[0], b[1]);
            attn_mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
        }
    }
}

// The same for one row tile.
template <int NT, bool SKIP>
__device__ __forceinline__ void attn_mma_bt(float (&acc)[NT][4], const uint32_t (&a)[4], const bf16 *tile, int sd,
                                            int k0, int glo, int ghi) {
    attn_mma_bt_m<1, NT, SKIP>(*reinterpret_cast<float(*)[1][NT][4]>(&acc),
                               *reinterpret_cast<const uint32_t(*)[1][4]>(&a), tile, sd, k0, glo, ghi);
}
template <int NT>
__device__ __forceinline__ void attn_mma_b(float (&acc)[NT][4], const uint32_t (&a)[4], const bf16 *tile, int sd,
                                           int k0) {
    attn_mma_b_m<1, NT>(*reinterpret_cast<float(*)[1][NT][4]>(&acc), *reinterpret_cast<const uint32_t(*)[1][4]>(&a),
                        tile, sd, k0);
}

// s = A1 B1ᵀ and d = A2 B2ᵀ, zeroed first, over KS k-steps of 16: A1, A2 this warp's 16 rows (from row0) of two
// shared tiles, B1, B2 shared tiles of NT n-tiles (SKIP: only the n-tile pairs glo..ghi - 1). The backward's two
// score-shaped products of a tile (S and dP, or their transposes).
template <int NT, int KS, bool SKIP>
__device__ __forceinline__ void attn_mma_bt_pair(float (&s)[NT][4], float (&d)[NT][4], const bf16 *a1, const bf16 *b1,
                                                 const bf16 *a2, const bf16 *b2, int sd, int row0, int glo, int ghi) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[nt][e] = d[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        uint32_t a[4];
        attn_ldsm_a(a, a1, sd, row0, ks * 16);
        attn_mma_bt<NT, SKIP>(s, a, b1, sd, ks * 16, glo, ghi);
        attn_ldsm_a(a, a2, sd, row0, ks * 16);
        attn_mma_bt<NT, SKIP>(d, a, b2, sd, ks * 16, glo, ghi);
    }
}

__device__ __forceinline__ uint32_t attn_pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&h;
}

// The accumulator of n-tiles 2kk, 2kk+1 (16 x 16) as the A fragment of k-step kk (the layouts coincide).
template <int NT> __device__ __forceinline__ void attn_acc_to_a(uint32_t (&a)[4], const float (&c)[NT][4], int kk) {
    a[0] = attn_pack(c[2 * kk][0], c[2 * kk][1]);
    a[1] = attn_pack(c[2 * kk][2], c[2 * kk][3]);
    a[2] = attn_pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = attn_pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// Element e of n-tile nt in a thread's accumulator sits at row (lane/4 + 8*(e/2)), column (nt*8 + 2*(lane%4) + e%2).
__device__ __forceinline__ int attn_acc_row(int e) { return ((threadIdx.x & 31) >> 2) + (e >> 1) * 8; }
__device__ __forceinline__ int attn_acc_col(int nt, int e) { return nt * 8 + (threadIdx.x & 3) * 2 + (e & 1); }

// Store a warp's 16 x D accumulator (times per-row factors) to rows row0.. of a bf16 [T, stride] matrix.
template <int D>
__device__ __forceinline__ void attn_store_acc(bf16 *g, size_t stride, int row0, int T, const float (&acc)[D / 8][4],
                                               const float (&rowscale)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = row0 + attn_acc_row(2 * h);
        if (row >= T) continue;
        bf16 *out = g + (size_t)row * stride;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
            *(uint32_t *)(out + attn_acc_col(dt, 0)) =
                attn_pack(acc[dt][2 * h] * rowscale[h], acc[dt][2 * h + 1] * rowscale[h]);
    }
}

// Whether any (query, key) pair of query rows [p0, p0+np) x keys [s0, s0+ns) is visible, and whether all are.
__device__ __forceinline__ bool attn_block_any(int p0, int np, int s0, int ns, int window, int T) {
    int p1 = min(p0 + np, T) - 1, s1 = min(s0 + ns, T) - 1;
    return p0 < T && s0 < T && s0 <= p1 && s1 >= attn_first_key_dev(p0, window);
}
__device__ __forceinline__ bool attn_block_all(int p0, int np, int s0, int ns, int window, int T) {
    return p0 + np <= T && s0 + ns <= T && s0 + ns - 1 <= p0 && (window == 0 || p0 + np - 1 - s0 < window);
}

// Whether key is hidden from query row: outside [row - w + 1, row] or past T. wlim = w, or INT_MAX for full causal
// (row - key < 0 wraps to a huge unsigned value).
__device__ __forceinline__ bool attn_hidden(int row, int key, unsigned wlim, int T) {
    return (unsigned)(row - key) >= wlim || key >= T;
}
__device__ __forceinline__ unsigned attn_wlim(int window) { return window == 0 ? 0x7fffffffu : (unsigned)window; }

// A warp's 16 x 8NT scores s (raw q.k) of query rows row0.. against keys key0..: the pairs the mask hides to -inf.
template <int NT>
__device__ __forceinline__ void attn_mask_scores(float (&s)[NT][4], int row0, int key0, unsigned wlim, int T) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (attn_hidden(row0 + attn_acc_row(e), key0 + attn_acc_col(nt, e), wlim, T)) s[nt][e] = -INFINITY;
}

// One key tile of a warp's online softmax over its 16 rows: s (raw, masked scores) becomes exp2(s * scale_log2 - m)
// with m the running row maximum (base-2 units of the scaled score), and the running sum l is rescaled to the new
// maximum and increased by the tile's terms. alpha: the factor that rescales the output accumulator to the new
// maximum (the caller applies it; attn_online_softmax does at once).
template <int NT>
__device__ __forceinline__ void attn_softmax_tile(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                  float scale_log2) {
#pragma unroll
    for (int h = 0; h < 2; h++) { // rows lane/4 and lane/4 + 8
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(m[h], mx * scale_log2), m_use = m_new == -INFINITY ? 0.0f : m_new;
        alpha[h] = exp2f(m[h] - m_use);
        m[h] = m_new;
        l[h] *= alpha[h];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt][2 * h] = exp2f(fmaf(s[nt][2 * h], scale_log2, -m_use));
            s[nt][2 * h + 1] = exp2f(fmaf(s[nt][2 * h + 1], scale_log2, -m_use));
            l[h] += s[nt][2 * h] + s[nt][2 * h + 1];
        }
    }
}

// The output accumulator o [16 x 8DT] of a warp's rows times their factors alpha.
template <int DT> __device__ __forceinline__ void attn_rescale(float (&o)[DT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        o[dt][0] *= alpha[0], o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1], o[dt][3] *= alpha[1];
    }
}

template <int NT, int DT>
__device__ __forceinline__ void attn_online_softmax(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&o)[DT][4],
                                                    float scale_log2) {
    float alpha[2];
    attn_softmax_tile<NT>(s, m, l, alpha, scale_log2);
    attn_rescale<DT>(o, alpha);
}

// The backward's per-row values of a warp's 16 query rows from row0 of (b, head j): lse in base 2 and delta, for
// rows lane/4 and lane/4 + 8 (rows past T read row T-1's; they are never stored).
__device__ __forceinline__ void attn_rows_lse_delta(const AttnArgs &p, int b, int j, int row0, float (&lse2)[2],
                                                    float (&delta)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = min(row0 + attn_acc_row(2 * h), p.T - 1);
        size_t hrow = ((size_t)b * p.nh + j) * p.T + row;
        lse2[h] = p.lse[hrow] * ATTN_LOG2E;
        delta[h] = p.delta[hrow];
    }
}

// dQ pass: a warp's masked scores s (16 queries x 8NT keys) become dS = P (dP - delta), P = exp2(s * scale - lse).
template <int NT>
__device__ __forceinline__ void attn_dq_ds(float (&s)[NT][4], const float (&dp)[NT][4], const float (&lse2)[2],
                                           const float (&delta)[2], float scale_log2) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float pr = exp2f(fmaf(s[nt][e], scale_log2, -lse2[e >> 1]));
            s[nt][e] = pr * (dp[nt][e] - delta[e >> 1]);
        }
}

// dK/dV pass: a warp's S^T (16 keys from k0 x 8NT queries from m0): the pairs the mask hides (or queries past T) to
// -inf; then S^T becomes P^T = exp2(S^T * scale - lse) and dP^T becomes dS^T = P^T (dP^T - delta), lse (base 2)
// and delta per query column from shared memory.
template <int NT>
__device__ __forceinline__ void attn_dkdv_mask(float (&st)[NT][4], int k0, int m0, unsigned wlim, int T) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int key = k0 + attn_acc_row(e), query = m0 + attn_acc_col(nt, e);
            if (query >= T || attn_hidden(query, key, wlim, T)) st[nt][e] = -INFINITY;
        }
}
template <int NT>
__device__ __forceinline__ void attn_dkdv_p_ds(float (&st)[NT][4], float (&dpt)[NT][4], const float *lse2,
                                               const float *delta, float scale_log2) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int col = attn_acc_col(nt, e);
            float pr = exp2f(fmaf(st[nt][e], scale_log2, -lse2[col]));
            st[nt][e] = pr;
            dpt[nt][e] = pr * (dpt[nt][e] - delta[col]);
        }
}

// The end of a warp's forward over its 16 rows from row0 of (b, head j): the row sums l completed across the quad,
// lse (when training) and out = o / l.
template <int D>
__device__ __forceinline__ void attn_fwd_finish(const AttnArgs &p, int b, int j, int row0, float (&m)[2],
                                                float (&l)[2], const float (&o)[D / 8][4]) {
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        inv[h] = 1.0f / l[h];
        int row = row0 + attn_acc_row(2 * h);
        if (p.lse && (threadIdx.x & 3) == 0 && row < p.T)
            p.lse[((size_t)b * p.nh + j) * p.T + row] = (m[h] + log2f(l[h])) * ATTN_LN2;
    }
    attn_store_acc<D>((bf16 *)p.out + ((size_t)b * p.T * p.nh + j) * D, (size_t)p.nh * D, row0, p.T, o, inv);
}

// The 16-wide column groups [lo, hi) of a tile whose columns start at c0 (ncols of them) that hold any column of
// [v_lo, v_hi] (absolute; the caller knows the intersection is not empty). Work on the others is skipped.
__device__ __forceinline__ void attn_groups(int c0, int ncols, int v_lo, int v_hi, int &lo, int &hi) {
    lo = max(0, v_lo - c0) / 16;
    hi = min(ncols / 16, (v_hi - c0 + 16) / 16);
}

// Keys visible to some query row of [r0, r0+16): [first key of r0, last row]; queries that see some key of
// [k0, k0+16): [k0, last key + w - 1].
__device__ __forceinline__ int attn_rows_key_hi(int r0, int T) { return min(r0 + 15, T - 1); }
__device__ __forceinline__ int attn_keys_query_hi(int k0, int window, int T) {
    return window == 0 ? T - 1 : min(T - 1, min(k0 + 15, T - 1) + window - 1);
}

#endif
