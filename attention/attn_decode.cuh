// attention/attn_decode.cuh: the attention decode step on the GPU (docs/MODEL.md#inference, docs/MODEL.md#attention),
// one launch: RoPE on each stream's newest q [B,n_h,d_h] and k [B,n_kv,d_h] at its position pos[b], the rotated k and
// v appended to its KV cache [B,C,n_kv,d_h] (position p lives in slot p % C), and out [B,n_h,d_h] = attention of the
// newest query over positions 0..pos[b] (the last w of them for SWA), one block per (stream, head).
#ifndef SDM_ATTN_DECODE_CUH
#define SDM_ATTN_DECODE_CUH

#include "attention/attn_common.cuh"
#include "attention/attn_rope_gate.cuh"

// One block per (stream b, head j). First the block turns its query row and its kv head's newest k row by RoPE (the
// bits of attn_rope) and writes k and v to cache slot pos % C: every block of a kv head's group writes the same
// values, and each reads the slot only after its own write, so no block waits for another (one launch where RoPE,
// the append and the attention took three, each a few microseconds of latency at a decode's few rows). Then the
// positions visible to the query are split into ATTN_DECODE_WARPS consecutive pieces, one per warp, each attended
// with the online softmax; the pieces merge through their log-sum-exps, in warp order (deterministic). The warps
// fetch their keys at once, where one warp walking every key in turn is bound by memory latency.
// q, out [B,n_h,d_h]; k, v [B,n_kv,d_h]; caches [B,C,n_kv,d_h]; inv_freq [d_h/2] (AttnRope).
#define ATTN_DECODE_WARPS 16

template <typename T, int D>
__global__ void __launch_bounds__(32 * ATTN_DECODE_WARPS)
attn_decode_kernel(const T *q, const T *k, const T *v, T *kc, T *vc, T *out, const int *pos, const float *inv_freq,
                   int nh, int nkv, int C, int window, float scale_log2) {
    __shared__ float part_o[ATTN_DECODE_WARPS][D], part_lse[ATTN_DECODE_WARPS]; // each piece's softmax output, lse
    __shared__ T q_rot[D];
    pdl_enter();
    int bh = blockIdx.x, j = bh % nh, b = bh / nh, g = j / (nh / nkv), p = pos[b], L = p + 1;
    const T *qrow = q + (size_t)bh * D, *krow = k + ((size_t)b * nkv + g) * D, *vrow = v + ((size_t)b * nkv + g) * D;
    size_t slot = (((size_t)b * C + p % C) * nkv + g) * D;
    for (int m = threadIdx.x; m < D / 2; m += blockDim.x) {
        float sn, cs, y0, y1;
        sincosf((float)p * inv_freq[m], &sn, &cs);
        attn_rope_turn(dtype_to_float(qrow[2 * m]), dtype_to_float(qrow[2 * m + 1]), sn, cs, y0, y1);
        q_rot[2 * m] = dtype_from_float<T>(y0);
        q_rot[2 * m + 1] = dtype_from_float<T>(y1);
        attn_rope_turn(dtype_to_float(krow[2 * m]), dtype_to_float(krow[2 * m + 1]), sn, cs, y0, y1);
        kc[slot + 2 * m] = dtype_from_float<T>(y0);
        kc[slot + 2 * m + 1] = dtype_from_float<T>(y1);
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) vc[slot + i] = vrow[i];
    __syncthreads(); // the block's cache writes and q_rot are visible to its warps
    int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    int lo = attn_first_key_dev(L - 1, window), per = (L - lo + ATTN_DECODE_WARPS - 1) / ATTN_DECODE_WARPS;
    int s0 = lo + w * per, s1 = min(L - 1, s0 + per - 1);
    float lse = -INFINITY; // an empty piece weighs nothing
    if (s0 <= s1) {
        AttnKvRows<T> kv = {kc + ((size_t)b * C * nkv + g) * D, vc + ((size_t)b * C * nkv + g) * D, (size_t)nkv * D,
                            C};
        float qv[D / 32], o[D / 32], l;
        attn_load_row<T, D>(qv, q_rot);
        attn_warp_attend<T, D>(qv, kv, s0, s1, scale_log2, o, l, lse);
        for (int i = 0; i < D / 32; i++) part_o[w][i * 32 + lane] = o[i] / l;
    }
    if (lane == 0) part_lse[w] = lse;
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float mx = -INFINITY, num = 0.0f, den = 0.0f;
        for (int i = 0; i < ATTN_DECODE_WARPS; i++) mx = fmaxf(mx, part_lse[i]);
        for (int i = 0; i < ATTN_DECODE_WARPS; i++)
            if (part_lse[i] > -INFINITY) {
                float e = expf(part_lse[i] - mx);
                den += e;
                num += e * part_o[i][c];
            }
        out[(size_t)bh * D + c] = dtype_from_float<T>(num / den);
    }
}

template <typename T, int D>
static inline void attn_decode_launch(const AttnDims *a, int B, const AttnRope *r, const void *q, const void *k,
                                      const void *v, void *kc, void *vc, int C, const int *pos, void *out,
                                      cudaStream_t st) {
    launch_pdl(attn_decode_kernel<T, D>, (unsigned)(B * a->n_heads), 32 * ATTN_DECODE_WARPS, 0, st, (const T *)q,
               (const T *)k, (const T *)v, (T *)kc, (T *)vc, (T *)out, pos, (const float *)r->inv_freq, a->n_heads,
               a->n_kv_heads, C, a->window, ATTN_LOG2E / sqrtf((float)D));
    cudaCheckLast();
}

// Decode step of B streams: the newest token's q [B,n_h,d_h], k, v [B,n_kv,d_h] (before RoPE) at positions pos[b]
// (device): k, v appended to the caches [B,C,n_kv,d_h] after RoPE, out [B,n_h,d_h] = attention of q over positions
// 0..pos[b]. SWA needs C >= w, full attention C > pos[b] (the caller checks).
static inline void attn_decode(const AttnDims *a, int B, Dtype dt, const AttnRope *r, const void *q, const void *k,
                               const void *v, void *k_cache, void *v_cache, int C, const int *pos, void *out,
                               cudaStream_t st) {
    attn_check_dims(a);
    if (a->window > 0 && C < a->window)
        sdm_die("attention: KV cache of %d entries is shorter than the window %d", C, a->window);
    if (r->head_dim != a->head_dim)
        sdm_die("attention: RoPE table for head_dim %d used with %d", r->head_dim, a->head_dim);
    if (B == 0) return;
    auto launch = dt == DT_BF16 ? (a->head_dim == 64 ? attn_decode_launch<bf16, 64> : attn_decode_launch<bf16, 128>)
                                : (a->head_dim == 64 ? attn_decode_launch<float, 64> : attn_decode_launch<float, 128>);
    launch(a, B, r, q, k, v, k_cache, v_cache, C, pos, out, st);
}

#endif
