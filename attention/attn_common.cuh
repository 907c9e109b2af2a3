// attention/attn_common.cuh: what the attention kernels share (docs/MODEL.md#attention): the bf16 alias, small device
// helpers (the mask's first visible key), AttnArgs (the core kernels' arguments: q, out [B,T,n_h,d_h]; k, v
// [B,T,n_kv,d_h]; lse, delta [B,n_h,T] fp32), the row-per-warp building blocks of the fp32 core (one query row per
// warp, online softmax over a source of key/value rows; decode reads its cache through AttnKvRows too), and the host
// helpers every entry point uses (dimension check, arguments, launches).
#ifndef SDM_ATTN_COMMON_CUH
#define SDM_ATTN_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>

#include <type_traits>

#include "attention/attention_ref.h" // attn_rope_inv_freq: the host computes the RoPE frequencies exactly as the CPU
                                     // reference
#include "attention/attn_dims.h"
#include "core/common.h"
#include "core/cuda_common.cuh" // Dtype, cudaCheck, core_warp_sum

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------------------------------------------
// Small device helpers

#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

__device__ __forceinline__ int attn_first_key_dev(int p, int window) {
    return window == 0 ? 0 : max(0, p - window + 1);
}

// ---------------------------------------------------------------------------------------------------------------
// Shared arguments of the core kernels

typedef struct {
    const void *q, *k, *v, *o, *dout; // o, dout: backward only
    void *out, *dq, *dk, *dv;
    float *lse;         // [B,n_h,T]: written by the training forward (NULL: inference), read by the backward
    float *delta;       // [B,n_h,T]: rowsum(dout * o), backward workspace
    int T, nh, nkv, window;
    float scale_log2;   // log2(e) / sqrt(d_h): scores in base-2 units
} AttnArgs;

// ---------------------------------------------------------------------------------------------------------------
// Row-per-warp kernels: the fp32 path of the core and the decode path. Lane l holds elements l, l+32, ... of a row.

// A source of key/value rows: position s lives in row (s % C) (C huge for a plain sequence) of stride `stride`.
template <typename T> struct AttnKvRows {
    const T *k, *v;
    size_t stride;
    int C;
    __device__ __forceinline__ const T *krow(int s) const { return k + (size_t)(s % C) * stride; }
    __device__ __forceinline__ const T *vrow(int s) const { return v + (size_t)(s % C) * stride; }
};

template <typename T, int D> __device__ __forceinline__ void attn_load_row(float (&x)[D / 32], const T *row) {
    for (int i = 0; i < D / 32; i++) x[i] = dtype_to_float(row[i * 32 + (threadIdx.x & 31)]);
}

template <typename T, int D> __device__ __forceinline__ float attn_row_dot(const float (&x)[D / 32], const T *row) {
    float s = 0.0f;
    for (int i = 0; i < D / 32; i++) s += x[i] * dtype_to_float(row[i * 32 + (threadIdx.x & 31)]);
    return core_warp_sum(s);
}

// Online softmax of one query over positions s_lo..s_hi in increasing order. Leaves o unnormalised; lse (natural
// log) is returned; o must be divided by l.
template <typename T, int D>
__device__ void attn_warp_attend(const float (&q)[D / 32], const AttnKvRows<T> &kv, int s_lo, int s_hi,
                                 float scale_log2, float (&o)[D / 32], float &l, float &lse) {
    float m = -INFINITY;
    l = 0.0f;
    for (int i = 0; i < D / 32; i++) o[i] = 0.0f;
    for (int s = s_lo; s <= s_hi; s++) {
        float sc = attn_row_dot<T, D>(q, kv.krow(s)) * scale_log2;
        float m_new = fmaxf(m, sc), alpha = exp2f(m - m_new), p = exp2f(sc - m_new);
        const T *vr = kv.vrow(s);
        l = l * alpha + p;
        for (int i = 0; i < D / 32; i++) o[i] = o[i] * alpha + p * dtype_to_float(vr[i * 32 + (threadIdx.x & 31)]);
        m = m_new;
    }
    lse = (m + log2f(l)) * ATTN_LN2;
}

// ---------------------------------------------------------------------------------------------------------------
// Host API

static inline void attn_check_dims(const AttnDims *a) {
    if (a->head_dim != 64 && a->head_dim != 128)
        sdm_die("attention: head_dim %d is not supported by the GPU kernels (64 or 128)", a->head_dim);
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0)
        sdm_die("attention: n_heads %d is not a multiple of n_kv_heads %d", a->n_heads, a->n_kv_heads);
    if (a->window < 0) sdm_die("attention: negative window %d", a->window);
}

static inline AttnArgs attn_args(const AttnDims *a, int T) {
    AttnArgs p;
    memset(&p, 0, sizeof p);
    p.T = T;
    p.nh = a->n_heads;
    p.nkv = a->n_kv_heads;
    p.window = a->window;
    p.scale_log2 = ATTN_LOG2E / sqrtf((float)a->head_dim);
    return p;
}

// Launch a kernel (arguments: the AttnArgs and any more) with `smem` bytes of dynamic shared memory, raising the
// kernel's limit first.
template <typename K, typename... A>
static inline void attn_launch(K kernel, dim3 grid, int threads, size_t smem, cudaStream_t st, const A &...args) {
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<grid, threads, smem, st>>>(args...);
    cudaCheckLast();
}

// Launch a row-per-warp kernel over `rows` warps.
template <typename K>
static inline void attn_launch_rows(K kernel, int rows, cudaStream_t st, const AttnArgs &p) {
    kernel<<<(unsigned)((rows + 3) / 4), 128, 0, st>>>(p, rows);
    cudaCheckLast();
}

#endif
