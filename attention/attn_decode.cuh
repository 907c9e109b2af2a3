// attention/attn_decode.cuh: attention decode on the GPU (docs/MODEL.md#inference, docs/MODEL.md#attention): append each stream's newest k, v
// [B,n_kv,d_h] to its KV cache [B,C,n_kv,d_h] (position pos lives in slot pos % C), and out [B,n_h,d_h] = attention
// of each stream's newest query over its cached positions 0..len[b]-1 (the last w of them for SWA), one warp per
// (stream, head).
#ifndef SDM_ATTN_DECODE_CUH
#define SDM_ATTN_DECODE_CUH

#include "attention/attn_common.cuh"

// Decode: one warp per (stream b, head j); the stream holds positions 0..len[b]-1, of which the last w (w > 0) or
// all are visible to its newest query. q, out [B,n_h,d_h]; caches [B,C,n_kv,d_h].
template <typename T, int D>
__global__ void attn_decode_kernel(const T *q, const T *kc, const T *vc, T *out, const int *len, int B, int nh, int nkv,
                                   int C, int window, float scale_log2) {
    int w = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    if (w >= B * nh) return;
    int j = w % nh, b = w / nh, g = j / (nh / nkv), L = len[b];
    AttnKvRows<T> kv = {kc + ((size_t)b * C * nkv + g) * D, vc + ((size_t)b * C * nkv + g) * D, (size_t)nkv * D, C};
    float qv[D / 32], o[D / 32], l, lse;
    attn_load_row<T, D>(qv, q + (size_t)w * D);
    attn_warp_attend<T, D>(qv, kv, attn_first_key_dev(L - 1, window), L - 1, scale_log2, o, l, lse);
    for (int i = 0; i < D / 32; i++) out[(size_t)w * D + i * 32 + (threadIdx.x & 31)] = dtype_from_float<T>(o[i] / l);
}

// Write the new token's k, v [B,n_kv,d_h] into slot pos[b] % C of each stream's cache.
template <typename T>
__global__ void attn_kv_append_kernel(const T *k, const T *v, T *kc, T *vc, const int *pos, int C, size_t row, size_t n) {
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
        attn_kv_append_kernel<bf16><<<grid, 256, 0, st>>>((const bf16 *)k, (const bf16 *)v, (bf16 *)k_cache,
                                                          (bf16 *)v_cache, pos, C, row, n);
    else
        attn_kv_append_kernel<float><<<grid, 256, 0, st>>>((const float *)k, (const float *)v, (float *)k_cache,
                                                           (float *)v_cache, pos, C, row, n);
    cudaCheckLast();
}

template <typename T, int D>
static inline void attn_decode_launch(const AttnDims *a, int B, const void *q, const void *kc, const void *vc, int C,
                                      const int *len, void *out, cudaStream_t st) {
    int rows = B * a->n_heads;
    attn_decode_kernel<T, D><<<(unsigned)((rows + 3) / 4), 128, 0, st>>>(
        (const T *)q, (const T *)kc, (const T *)vc, (T *)out, len, B, a->n_heads, a->n_kv_heads, C, a->window,
        ATTN_LOG2E / sqrtf((float)D));
    cudaCheckLast();
}

// Decode: out [B,n_h,d_h] = attention of each stream's newest query q [B,n_h,d_h] over its cached positions
// 0..len[b]-1 (len on the device; the newest token's k, v already appended). SWA needs C >= w, full attention
// C >= len[b].
static inline void attn_decode(const AttnDims *a, int B, Dtype dt, const void *q, const void *k_cache,
                               const void *v_cache, int C, const int *len, void *out, cudaStream_t st) {
    attn_check_dims(a);
    if (a->window > 0 && C < a->window) sdm_die("attention: KV cache of %d entries is shorter than the window %d", C, a->window);
    if (B == 0) return;
    if (dt == DT_BF16 && a->head_dim == 64) attn_decode_launch<bf16, 64>(a, B, q, k_cache, v_cache, C, len, out, st);
    else if (dt == DT_BF16) attn_decode_launch<bf16, 128>(a, B, q, k_cache, v_cache, C, len, out, st);
    else if (a->head_dim == 64) attn_decode_launch<float, 64>(a, B, q, k_cache, v_cache, C, len, out, st);
    else attn_decode_launch<float, 128>(a, B, q, k_cache, v_cache, C, len, out, st);
}

#endif
