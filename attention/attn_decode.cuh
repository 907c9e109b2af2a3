// attention/attn_decode.cuh: attention decode on the GPU (docs/MODEL.md#inference, docs/MODEL.md#attention): append
// each stream's newest k, v [B,n_kv,d_h] to its KV cache [B,C,n_kv,d_h] (position pos lives in slot pos % C), and out
// [B,n_h,d_h] = attention of each stream's newest query over its cached positions 0..len[b]-1 (the last w of them for
// SWA), one block per (stream, head).
#ifndef SDM_ATTN_DECODE_CUH
#define SDM_ATTN_DECODE_CUH

#include "attention/attn_common.cuh"

// Decode: one block per (stream b, head j); the stream holds positions 0..len[b]-1, of which the last w (w > 0) or
// all are visible to its newest query. They are split into ATTN_DECODE_WARPS consecutive pieces, one per warp, each
// attended with the online softmax; the pieces merge through their log-sum-exps, in warp order (deterministic).
// The warps fetch their keys at once, where one warp walking every key in turn is bound by memory latency.
// q, out [B,n_h,d_h]; caches [B,C,n_kv,d_h].
#define ATTN_DECODE_WARPS 16

template <typename T, int D>
__global__ void __launch_bounds__(32 * ATTN_DECODE_WARPS)
attn_decode_kernel(const T *q, const T *kc, const T *vc, T *out, const int *len, int nh, int nkv, int C, int window,
                   float scale_log2) {
    __shared__ float part_o[ATTN_DECODE_WARPS][D], part_lse[ATTN_DECODE_WARPS]; // each piece's softmax output, lse
    pdl_enter();
    int bh = blockIdx.x, j = bh % nh, b = bh / nh, g = j / (nh / nkv), L = len[b];
    int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    int lo = attn_first_key_dev(L - 1, window), per = (L - lo + ATTN_DECODE_WARPS - 1) / ATTN_DECODE_WARPS;
    int s0 = lo + w * per, s1 = min(L - 1, s0 + per - 1);
    float lse = -INFINITY; // an empty piece weighs nothing
    if (s0 <= s1) {
        AttnKvRows<T> kv = {kc + ((size_t)b * C * nkv + g) * D, vc + ((size_t)b * C * nkv + g) * D, (size_t)nkv * D,
                            C};
        float qv[D / 32], o[D / 32], l;
        attn_load_row<T, D>(qv, q + (size_t)bh * D);
        attn_warp_attend<T, D>(qv, kv, s0, s1, scale_log2, o, l, lse);
        for (int i = 0; i < D / 32; i++) part_o[w][i * 32 + lane] = o[i] / l;
    }
    if (lane == 0) part_lse[w] = lse;
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float mx = -INFINITY, num = 0.0f, den = 0.0f;
        for (int k = 0; k < ATTN_DECODE_WARPS; k++) mx = fmaxf(mx, part_lse[k]);
        for (int k = 0; k < ATTN_DECODE_WARPS; k++)
            if (part_lse[k] > -INFINITY) {
                float e = expf(part_lse[k] - mx);
                den += e;
                num += e * part_o[k][c];
            }
        out[(size_t)bh * D + c] = dtype_from_float<T>(num / den);
    }
}

// Write the new token's k, v [B,n_kv,d_h] into slot pos[b] % C of each stream's cache.
template <typename T>
__global__ void attn_kv_append_kernel(const T *k, const T *v, T *kc, T *vc, const int *pos, int C, size_t row,
                                      size_t n) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    size_t b = i / row, dst = (b * C + pos[b] % C) * row + i % row;
    kc[dst] = k[i];
    vc[dst] = v[i];
}

// Append the newest token's k, v [B,n_kv,d_h] at positions pos[b] (device) to caches [B,C,n_kv,d_h].
static inline void attn_kv_cache_append(const AttnDims *a, int B, Dtype dt, const void *k, const void *v,
                                        void *k_cache, void *v_cache, int C, const int *pos, cudaStream_t st) {
    size_t row = (size_t)a->n_kv_heads * a->head_dim, n = (size_t)B * row;
    if (n == 0) return;
    unsigned grid = (unsigned)((n + 255) / 256);
    if (dt == DT_BF16)
        launch_pdl(attn_kv_append_kernel<bf16>, grid, 256, 0, st, (const bf16 *)k, (const bf16 *)v, (bf16 *)k_cache,
                   (bf16 *)v_cache, pos, C, row, n);
    else
        launch_pdl(attn_kv_append_kernel<float>, grid, 256, 0, st, (const float *)k, (const float *)v,
                   (float *)k_cache, (float *)v_cache, pos, C, row, n);
    cudaCheckLast();
}

template <typename T, int D>
static inline void attn_decode_launch(const AttnDims *a, int B, const void *q, const void *kc, const void *vc, int C,
                                      const int *len, void *out, cudaStream_t st) {
    launch_pdl(attn_decode_kernel<T, D>, (unsigned)(B * a->n_heads), 32 * ATTN_DECODE_WARPS, 0, st, (const T *)q,
               (const T *)kc, (const T *)vc, (T *)out, len, a->n_heads, a->n_kv_heads, C, a->window,
               ATTN_LOG2E / sqrtf((float)D));
    cudaCheckLast();
}

// Decode: out [B,n_h,d_h] = attention of each stream's newest query q [B,n_h,d_h] over its cached positions
// 0..len[b]-1 (len on the device; the newest token's k, v already appended). SWA needs C >= w, full attention
// C >= len[b].
static inline void attn_decode(const AttnDims *a, int B, Dtype dt, const void *q, const void *k_cache,
                               const void *v_cache, int C, const int *len, void *out, cudaStream_t st) {
    attn_check_dims(a);
    if (a->window > 0 && C < a->window)
        sdm_die("attention: KV cache of %d entries is shorter than the window %d", C, a->window);
    if (B == 0) return;
    if (dt == DT_BF16 && a->head_dim == 64) attn_decode_launch<bf16, 64>(a, B, q, k_cache, v_cache, C, len, out, st);
    else if (dt == DT_BF16) attn_decode_launch<bf16, 128>(a, B, q, k_cache, v_cache, C, len, out, st);
    else if (a->head_dim == 64) attn_decode_launch<float, 64>(a, B, q, k_cache, v_cache, C, len, out, st);
    else attn_decode_launch<float, 128>(a, B, q, k_cache, v_cache, C, len, out, st);
}

#endif
