// attention/attention.cuh: causal and sliding-window attention on the GPU (docs/MODEL.md#attention): RoPE, the attention core
// (flash-style forward with logsumexp, deterministic backward), the sigmoid gate, and decode against a KV cache.
//
// Layouts (row-major, last index fastest; what the projection GEMM writes):
//   q, out, dq, dout [B,T,n_h,d_h];  k, v, dk, dv [B,T,n_kv,d_h];  lse [B,n_h,T] fp32 (natural log)
//   KV cache [B,C,n_kv,d_h]: position pos of stream b lives in slot pos % C (C = w: a ring buffer for SWA layers;
//   C >= the longest stream for full attention).
// Element type: ATTN_BF16 (tensor cores, mma.sync m16n8k16, fp32 accumulation) or ATTN_FP32 (plain fp32 arithmetic,
// for tight tests). Mask: key s visible from query p iff 0 <= p - s < w (w = 0: s <= p). GQA: query head j reads kv
// head j / (n_h / n_kv) by indexing. Head dims 64 and 128. Nothing here uses floating-point atomics: every output
// element is written by one thread, which sums its terms in a fixed order, so results are bitwise reproducible.
#ifndef SDM_ATTENTION_CUH
#define SDM_ATTENTION_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>

#include <type_traits>

#include "attention/attention_ref.h" // attn_rope_inv_freq: the host computes the RoPE frequencies exactly as the CPU reference
#include "attention/attn_dims.h"
#include "core/common.h"

typedef enum { ATTN_BF16 = 0, ATTN_FP32 = 1 } AttnDtype;
typedef __nv_bfloat16 bf16;

static inline void attn_cuda_check(cudaError_t e, const char *what) {
    if (e != cudaSuccess) sdm_die("attention: %s: %s", what, cudaGetErrorString(e));
}

// ---------------------------------------------------------------------------------------------------------------
// Small device helpers

#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

__device__ __forceinline__ float attn_f(float x) { return x; }
__device__ __forceinline__ float attn_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T attn_cast(float x);
template <> __device__ __forceinline__ float attn_cast<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 attn_cast<bf16>(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ int attn_first_key_dev(int p, int window) { return window == 0 ? 0 : max(0, p - window + 1); }

__device__ __forceinline__ float attn_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE (fused: q and k of all heads in one launch). Pair (2m, 2m+1) of position pos turns by the fp32 angle
// pos * inv_freq[m]: the one rounded product the CPU reference also uses.

typedef struct {
    float *inv_freq; // [d_h/2] on the device
    int head_dim;
} AttnRope;

static inline AttnRope attn_rope_create(int head_dim, double theta) {
    AttnRope r;
    r.head_dim = head_dim;
    float *h = (float *)sdm_malloc((size_t)(head_dim / 2) * sizeof(float));
    for (int m = 0; m < head_dim / 2; m++) h[m] = attn_rope_inv_freq(m, head_dim, theta);
    attn_cuda_check(cudaMalloc((void **)&r.inv_freq, (size_t)(head_dim / 2) * sizeof(float)), "rope table");
    attn_cuda_check(cudaMemcpy(r.inv_freq, h, (size_t)(head_dim / 2) * sizeof(float), cudaMemcpyHostToDevice), "rope table");
    free(h);
    return r;
}

static inline void attn_rope_destroy(AttnRope *r) { cudaFree(r->inv_freq); r->inv_freq = NULL; }

// One thread per (row b*T+t, head of q or k, pair m). Position = pos0[b] + t (pos0 NULL: t).
template <typename T>
__global__ void attn_rope_kernel(T *q, T *k, int T_, int nh, int nkv, int half, const float *inv_freq,
                                 const int *pos0, float direction, size_t n_pairs) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_pairs) return;
    int m = (int)(i % half), h = (int)(i / half % (nh + nkv));
    size_t row = i / half / (nh + nkv);
    int t = (int)(row % T_), b = (int)(row / T_);
    float ang = (float)((pos0 ? pos0[b] : 0) + t) * inv_freq[m];
    float sn, cs;
    sincosf(ang, &sn, &cs);
    sn *= direction;
    T *x = h < nh ? q + (row * nh + h) * 2 * half + 2 * m : k + (row * nkv + (h - nh)) * 2 * half + 2 * m;
    float x0 = attn_f(x[0]), x1 = attn_f(x[1]);
    x[0] = attn_cast<T>(x0 * cs - x1 * sn);
    x[1] = attn_cast<T>(x0 * sn + x1 * cs);
}

// In place on q [B,T,n_h,d_h] and k [B,T,n_kv,d_h]; direction 1 = forward, -1 = backward (the transpose).
static inline void attn_rope(const AttnRope *r, const AttnDims *a, int B, int T, AttnDtype dt, void *q, void *k,
                             const int *pos0, int direction, cudaStream_t st) {
    if (r->head_dim != a->head_dim) sdm_die("attention: RoPE table for head_dim %d used with %d", r->head_dim, a->head_dim);
    int half = a->head_dim / 2;
    size_t n = (size_t)B * T * (a->n_heads + a->n_kv_heads) * half;
    if (n == 0) return;
    unsigned grid = (unsigned)((n + 255) / 256);
    if (dt == ATTN_BF16)
        attn_rope_kernel<bf16><<<grid, 256, 0, st>>>((bf16 *)q, (bf16 *)k, T, a->n_heads, a->n_kv_heads, half,
                                                     r->inv_freq, pos0, (float)direction, n);
    else
        attn_rope_kernel<float><<<grid, 256, 0, st>>>((float *)q, (float *)k, T, a->n_heads, a->n_kv_heads, half,
                                                      r->inv_freq, pos0, (float)direction, n);
    attn_cuda_check(cudaGetLastError(), "rope launch");
}

// ---------------------------------------------------------------------------------------------------------------
// Sigmoid gate: og = sigmoid(z) * o; backward do = sigmoid(z) * dog, dz = dog * o * sigmoid'(z). Elementwise on n
// entries (o, z [B,T,n_h*d_h]); do and dz may alias dog.

template <typename T>
__global__ void attn_gate_forward_kernel(const T *z, const T *o, T *og, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) og[i] = attn_cast<T>(attn_f(o[i]) / (1.0f + expf(-attn_f(z[i]))));
}

template <typename T>
__global__ void attn_gate_backward_kernel(const T *z, const T *o, const T *dog, T *d_o, T *dz, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 1.0f / (1.0f + expf(-attn_f(z[i]))), g = attn_f(dog[i]), ov = attn_f(o[i]);
    d_o[i] = attn_cast<T>(s * g);
    dz[i] = attn_cast<T>(g * ov * s * (1.0f - s));
}

static inline void attn_gate_forward(AttnDtype dt, size_t n, const void *z, const void *o, void *og, cudaStream_t st) {
    if (n == 0) return;
    unsigned grid = (unsigned)((n + 255) / 256);
    if (dt == ATTN_BF16)
        attn_gate_forward_kernel<bf16><<<grid, 256, 0, st>>>((const bf16 *)z, (const bf16 *)o, (bf16 *)og, n);
    else
        attn_gate_forward_kernel<float><<<grid, 256, 0, st>>>((const float *)z, (const float *)o, (float *)og, n);
    attn_cuda_check(cudaGetLastError(), "gate forward launch");
}

static inline void attn_gate_backward(AttnDtype dt, size_t n, const void *z, const void *o, const void *dog, void *d_o,
                                      void *dz, cudaStream_t st) {
    if (n == 0) return;
    unsigned grid = (unsigned)((n + 255) / 256);
    if (dt == ATTN_BF16)
        attn_gate_backward_kernel<bf16><<<grid, 256, 0, st>>>((const bf16 *)z, (const bf16 *)o, (const bf16 *)dog,
                                                              (bf16 *)d_o, (bf16 *)dz, n);
    else
        attn_gate_backward_kernel<float><<<grid, 256, 0, st>>>((const float *)z, (const float *)o, (const float *)dog,
                                                               (float *)d_o, (float *)dz, n);
    attn_cuda_check(cudaGetLastError(), "gate backward launch");
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
    for (int i = 0; i < D / 32; i++) x[i] = attn_f(row[i * 32 + (threadIdx.x & 31)]);
}

template <typename T, int D> __device__ __forceinline__ float attn_row_dot(const float (&x)[D / 32], const T *row) {
    float s = 0.0f;
    for (int i = 0; i < D / 32; i++) s += x[i] * attn_f(row[i * 32 + (threadIdx.x & 31)]);
    return attn_warp_sum(s);
}

// Online softmax of one query over positions s_lo..s_hi in increasing order. Leaves o unnormalised; lse (natural
// log) is returned; o must be divided by l.
template <typename T, int D>
__device__ void attn_warp_attend(const float (&q)[D / 32], const AttnKvRows<T> &kv, int s_lo, int s_hi, float scale_log2,
                                 float (&o)[D / 32], float &l, float &lse) {
    float m = -INFINITY;
    l = 0.0f;
    for (int i = 0; i < D / 32; i++) o[i] = 0.0f;
    for (int s = s_lo; s <= s_hi; s++) {
        float sc = attn_row_dot<T, D>(q, kv.krow(s)) * scale_log2;
        float m_new = fmaxf(m, sc), alpha = exp2f(m - m_new), p = exp2f(sc - m_new);
        const T *vr = kv.vrow(s);
        l = l * alpha + p;
        for (int i = 0; i < D / 32; i++) o[i] = o[i] * alpha + p * attn_f(vr[i * 32 + (threadIdx.x & 31)]);
        m = m_new;
    }
    lse = (m + log2f(l)) * ATTN_LN2;
}

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
    const float *k = (const float *)p.k + ((size_t)b * p.T * p.nkv + g) * D, *v = (const float *)p.v + ((size_t)b * p.T * p.nkv + g) * D;
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
    for (int i = 0; i < D / 32; i++) out[(size_t)w * D + i * 32 + (threadIdx.x & 31)] = attn_cast<T>(o[i] / l);
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

__device__ __forceinline__ void attn_cp_async16(void *smem, const void *gmem, bool valid) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int n = valid ? 16 : 0; // 0: zero-fill (rows past T)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void attn_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void attn_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// rows [row0, row0+ROWS) of a [T, stride] bf16 matrix (D columns used) into smem [ROWS][D+PAD]; rows >= T read as 0.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void attn_load_tile(bf16 *smem, const bf16 *g, int row0, int T, size_t stride) {
    constexpr int CH = D / 8;
    for (int c = threadIdx.x; c < ROWS * CH; c += THREADS) {
        int r = c / CH, col = (c % CH) * 8, t = row0 + r;
        bool ok = t < T;
        attn_cp_async16(smem + r * (D + ATTN_PAD) + col, ok ? g + (size_t)t * stride + col : g, ok);
    }
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
__device__ __forceinline__ void attn_mma_b_m(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][4], const bf16 *tile, int sd,
                                             int k0) {
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
__device__ __forceinline__ void attn_mma_bt(float (&acc)[NT][4], const uint32_t (&a)[4], const bf16 *tile, int sd, int k0,
                                            int glo, int ghi) {
    attn_mma_bt_m<1, NT, SKIP>(*reinterpret_cast<float(*)[1][NT][4]>(&acc), *reinterpret_cast<const uint32_t(*)[1][4]>(&a),
                                  tile, sd, k0, glo, ghi);
}
template <int NT>
__device__ __forceinline__ void attn_mma_b(float (&acc)[NT][4], const uint32_t (&a)[4], const bf16 *tile, int sd, int k0) {
    attn_mma_b_m<1, NT>(*reinterpret_cast<float(*)[1][NT][4]>(&acc), *reinterpret_cast<const uint32_t(*)[1][4]>(&a), tile,
                        sd, k0);
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
            *(uint32_t *)(out + attn_acc_col(dt, 0)) = attn_pack(acc[dt][2 * h] * rowscale[h], acc[dt][2 * h + 1] * rowscale[h]);
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
    attn_cp_async_commit();

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
        if (n + 1 < n_hi) {
            attn_load_tile<D, BN, NW * 32>(Ks + (buf ^ 1) * BN * SD, kg, key0 + BN, p.T, kstride);
            attn_load_tile<D, BN, NW * 32>(Vs + (buf ^ 1) * BN * SD, vg, key0 + BN, p.T, kstride);
        }
        attn_cp_async_commit();
        attn_cp_async_wait<1>();
        __syncthreads();
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
                if (PARTIAL) {
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            int row = r0 + mt * 16 + attn_acc_row(e), key = key0 + attn_acc_col(nt, e);
                            if (attn_hidden(row, key, wlim, p.T)) s[mt][nt][e] = -INFINITY;
                        }
                }
#pragma unroll
                for (int h = 0; h < 2; h++) { // rows lane/4 and lane/4 + 8; m in base-2 units of the scaled score
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    float m_new = fmaxf(m[mt][h], mx * p.scale_log2), m_use = m_new == -INFINITY ? 0.0f : m_new;
                    float alpha = exp2f(m[mt][h] - m_use);
                    m[mt][h] = m_new;
                    l[mt][h] *= alpha;
#pragma unroll
                    for (int dt = 0; dt < DT; dt++) o[mt][dt][2 * h] *= alpha, o[mt][dt][2 * h + 1] *= alpha;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        s[mt][nt][2 * h] = exp2f(fmaf(s[mt][nt][2 * h], p.scale_log2, -m_use));
                        s[mt][nt][2 * h + 1] = exp2f(fmaf(s[mt][nt][2 * h + 1], p.scale_log2, -m_use));
                        l[mt][h] += s[mt][nt][2 * h] + s[mt][nt][2 * h + 1];
                    }
                }
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
    for (int mt = 0; mt < MT; mt++) {
        float inv[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            l[mt][h] += __shfl_xor_sync(0xffffffffu, l[mt][h], 1);
            l[mt][h] += __shfl_xor_sync(0xffffffffu, l[mt][h], 2);
            inv[h] = 1.0f / l[mt][h];
            int row = r0 + mt * 16 + attn_acc_row(2 * h);
            if (p.lse && (threadIdx.x & 3) == 0 && row < p.T)
                p.lse[((size_t)b * p.nh + j) * p.T + row] = (m[mt][h] + log2f(l[mt][h])) * ATTN_LN2;
        }
        attn_store_acc<D>((bf16 *)p.out + ((size_t)b * p.T * p.nh + j) * D, qstride, r0 + mt * 16, p.T, o[mt], inv);
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
    attn_cp_async_commit();

    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[dt][e] = dv[dt][e] = 0.0f;

    for (int i = 0; i < steps; i++) {
        int buf = i & 1, m0 = (m_lo + i % per_head) * BM;
        if (i + 1 < steps) load_step(i + 1, buf ^ 1);
        attn_cp_async_commit();
        attn_cp_async_wait<1>();
        __syncthreads();
        unsigned wlim = attn_wlim(p.window);
        auto tile = [&](auto partial) {
            constexpr bool PARTIAL = decltype(partial)::value, SKIPS = PARTIAL && SKIP;
            const bf16 *Qb = Qs + buf * BM * SD, *Ob = Os + buf * BM * SD;
            const float *Lb = Ls + buf * BM, *Db = Ds + buf * BM;
            int glo = 0, ghi = BM / 16;
            if (SKIPS) attn_groups(m0, BM, k0, query_hi, glo, ghi);
            float st[NT][4], dpt[NT][4]; // S^T, dP^T: 16 keys x BM queries
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) st[nt][e] = dpt[nt][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t a[4];
                attn_ldsm_a(a, Ks, SD, warp * 16, ks * 16);
                attn_mma_bt<NT, SKIPS>(st, a, Qb, SD, ks * 16, glo, ghi);
                attn_ldsm_a(a, Vs, SD, warp * 16, ks * 16);
                attn_mma_bt<NT, SKIPS>(dpt, a, Ob, SD, ks * 16, glo, ghi);
            }
            if (PARTIAL) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int key = k0 + attn_acc_row(e), query = m0 + attn_acc_col(nt, e);
                        if (query >= p.T || attn_hidden(query, key, wlim, p.T)) st[nt][e] = -INFINITY;
                    }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int col = attn_acc_col(nt, e);
                    float pr = exp2f(fmaf(st[nt][e], p.scale_log2, -Lb[col]));
                    st[nt][e] = pr;
                    dpt[nt][e] = pr * (dpt[nt][e] - Db[col]);
                }
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
    attn_cp_async_commit();

    float lse2[2], delta[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = min(r0 + attn_acc_row(2 * h), p.T - 1);
        size_t hrow = ((size_t)b * p.nh + j) * p.T + row;
        lse2[h] = p.lse[hrow] * ATTN_LOG2E;
        delta[h] = p.delta[hrow];
    }
    float dq[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;

    for (int n = n_lo; n < n_hi; n++) {
        int buf = (n - n_lo) & 1, key0 = n * BN;
        if (n + 1 < n_hi) {
            attn_load_tile<D, BN, NW * 32>(Ks + (buf ^ 1) * BN * SD, kg, key0 + BN, p.T, kstride);
            attn_load_tile<D, BN, NW * 32>(Vs + (buf ^ 1) * BN * SD, vg, key0 + BN, p.T, kstride);
        }
        attn_cp_async_commit();
        attn_cp_async_wait<1>();
        __syncthreads();
        unsigned wlim = attn_wlim(p.window);
        auto tile = [&](auto partial) {
            constexpr bool PARTIAL = decltype(partial)::value, SKIPS = PARTIAL && SKIP;
            const bf16 *Kb = Ks + buf * BN * SD, *Vb = Vs + buf * BN * SD;
            int glo = 0, ghi = BN / 16;
            if (SKIPS) attn_groups(key0, BN, key_lo, key_hi, glo, ghi);
            float s[NT][4], dp[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t a[4];
                attn_ldsm_a(a, Qs, SD, warp * 16, ks * 16);
                attn_mma_bt<NT, SKIPS>(s, a, Kb, SD, ks * 16, glo, ghi);
                attn_ldsm_a(a, Os, SD, warp * 16, ks * 16);
                attn_mma_bt<NT, SKIPS>(dp, a, Vb, SD, ks * 16, glo, ghi);
            }
            if (PARTIAL) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int row = r0 + attn_acc_row(e), key = key0 + attn_acc_col(nt, e);
                        if (attn_hidden(row, key, wlim, p.T)) s[nt][e] = -INFINITY; // rows >= T are never stored
                    }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float pr = exp2f(fmaf(s[nt][e], p.scale_log2, -lse2[e >> 1]));
                    s[nt][e] = pr * (dp[nt][e] - delta[e >> 1]);
                }
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

// Launch a kernel with `smem` bytes of dynamic shared memory, raising the kernel's limit first.
template <typename K>
static inline void attn_launch(K kernel, dim3 grid, int threads, size_t smem, cudaStream_t st, const AttnArgs &p,
                               const char *what) {
    attn_cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), what);
    kernel<<<grid, threads, smem, st>>>(p);
    attn_cuda_check(cudaGetLastError(), what);
}

// Launch a row-per-warp kernel over `rows` warps.
template <typename K>
static inline void attn_launch_rows(K kernel, int rows, cudaStream_t st, const AttnArgs &p, const char *what) {
    kernel<<<(unsigned)((rows + 3) / 4), 128, 0, st>>>(p, rows);
    attn_cuda_check(cudaGetLastError(), what);
}

// The tensor-core kernels at a given tile configuration (NW warps, BN/BM tile, MINB CTAs per SM). The defaults below
// were chosen by tests/bench_attention.cu, which also times the alternatives.
template <int D, int NW, int BN, int MT, int MINB, bool SKIP>
static inline void attn_fwd_mma(const AttnArgs &p, int B, cudaStream_t st) {
    constexpr int BM = 16 * MT * NW;
    size_t smem = (size_t)(BM + 4 * BN) * (D + ATTN_PAD) * sizeof(bf16);
    attn_launch(attn_fwd_mma_kernel<D, NW, BN, MT, MINB, SKIP>, dim3((p.T + BM - 1) / BM, p.nh, B), NW * 32, smem, st, p,
                "attention forward");
}

template <int D, int NW, int BM, int MINB, bool SKIP> static inline void attn_dkdv_mma(const AttnArgs &p, int B, cudaStream_t st) {
    constexpr int BN = 16 * NW;
    size_t smem = (size_t)(2 * BN + 4 * BM) * (D + ATTN_PAD) * sizeof(bf16) + 4 * BM * sizeof(float);
    attn_launch(attn_bwd_dkdv_mma_kernel<D, NW, BM, MINB, SKIP>, dim3((p.T + BN - 1) / BN, p.nkv, B), NW * 32, smem, st, p,
                "attention backward dk dv");
}

template <int D, int NW, int BN, int MINB, bool SKIP> static inline void attn_dq_mma(const AttnArgs &p, int B, cudaStream_t st) {
    constexpr int BM = 16 * NW;
    size_t smem = (size_t)(2 * BM + 4 * BN) * (D + ATTN_PAD) * sizeof(bf16);
    attn_launch(attn_bwd_dq_mma_kernel<D, NW, BN, MINB, SKIP>, dim3((p.T + BM - 1) / BM, p.nh, B), NW * 32, smem, st, p,
                "attention backward dq");
}

template <typename T, int D> static inline void attn_delta(const AttnArgs &p, int B, cudaStream_t st) {
    attn_launch_rows(attn_delta_kernel<T, D>, B * p.T * p.nh, st, p, "attention backward delta");
}

template <int D> static inline void attn_forward_d(const AttnArgs &p, int B, AttnDtype dt, cudaStream_t st) {
    if (dt == ATTN_FP32) attn_launch_rows(attn_fwd_rows_kernel<D>, B * p.T * p.nh, st, p, "attention forward (fp32)");
    else if (p.window > 0 && p.window <= 256) attn_fwd_mma<D, ATTN_FWD_SWA_CFG>(p, B, st);
    else attn_fwd_mma<D, ATTN_FWD_CFG>(p, B, st);
}

// out = attention(q, k, v) after RoPE; lse [B,n_h,T] is written when non-NULL (training), skipped for inference.
static inline void attn_forward(const AttnDims *a, int B, int T, AttnDtype dt, const void *q, const void *k,
                                const void *v, void *out, float *lse, cudaStream_t st) {
    attn_check_dims(a);
    if (B == 0 || T == 0) return;
    AttnArgs p = attn_args(a, T);
    p.q = q; p.k = k; p.v = v; p.out = out; p.lse = lse;
    if (a->head_dim == 64) attn_forward_d<64>(p, B, dt, st);
    else attn_forward_d<128>(p, B, dt, st);
}

// Workspace of the backward: delta [B,n_h,T] fp32.
static inline size_t attn_backward_workspace_bytes(const AttnDims *a, int B, int T) {
    return (size_t)B * a->n_heads * T * sizeof(float);
}

template <int D> static inline void attn_backward_d(const AttnArgs &p, int B, AttnDtype dt, cudaStream_t st) {
    if (dt == ATTN_FP32) {
        attn_delta<float, D>(p, B, st);
        attn_launch_rows(attn_bwd_dq_rows_kernel<D>, B * p.T * p.nh, st, p, "attention backward dq (fp32)");
        attn_launch_rows(attn_bwd_dkdv_rows_kernel<D>, B * p.T * p.nkv, st, p, "attention backward dk dv (fp32)");
        return;
    }
    attn_delta<bf16, D>(p, B, st);
    attn_dkdv_mma<D, ATTN_DKDV_CFG>(p, B, st);
    attn_dq_mma<D, ATTN_DQ_CFG>(p, B, st);
}

// Given the forward's out and lse and the gradient dout, overwrite dq, dk, dv (same element type as q, k, v).
static inline void attn_backward(const AttnDims *a, int B, int T, AttnDtype dt, const void *q, const void *k,
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

// Append the newest token's k, v [B,n_kv,d_h] at positions pos[b] (device) to caches [B,C,n_kv,d_h].
static inline void attn_kv_cache_append(const AttnDims *a, int B, AttnDtype dt, const void *k, const void *v,
                                        void *k_cache, void *v_cache, int C, const int *pos, cudaStream_t st) {
    size_t row = (size_t)a->n_kv_heads * a->head_dim, n = (size_t)B * row;
    if (n == 0) return;
    unsigned grid = (unsigned)((n + 255) / 256);
    if (dt == ATTN_BF16)
        attn_kv_append_kernel<bf16><<<grid, 256, 0, st>>>((const bf16 *)k, (const bf16 *)v, (bf16 *)k_cache,
                                                          (bf16 *)v_cache, pos, C, row, n);
    else
        attn_kv_append_kernel<float><<<grid, 256, 0, st>>>((const float *)k, (const float *)v, (float *)k_cache,
                                                           (float *)v_cache, pos, C, row, n);
    attn_cuda_check(cudaGetLastError(), "kv cache append");
}

template <typename T, int D>
static inline void attn_decode_launch(const AttnDims *a, int B, const void *q, const void *kc, const void *vc, int C,
                                      const int *len, void *out, cudaStream_t st) {
    int rows = B * a->n_heads;
    attn_decode_kernel<T, D><<<(unsigned)((rows + 3) / 4), 128, 0, st>>>(
        (const T *)q, (const T *)kc, (const T *)vc, (T *)out, len, B, a->n_heads, a->n_kv_heads, C, a->window,
        ATTN_LOG2E / sqrtf((float)D));
    attn_cuda_check(cudaGetLastError(), "attention decode");
}

// Decode: out [B,n_h,d_h] = attention of each stream's newest query q [B,n_h,d_h] over its cached positions
// 0..len[b]-1 (len on the device; the newest token's k, v already appended). SWA needs C >= w, full attention
// C >= len[b].
static inline void attn_decode(const AttnDims *a, int B, AttnDtype dt, const void *q, const void *k_cache,
                               const void *v_cache, int C, const int *len, void *out, cudaStream_t st) {
    attn_check_dims(a);
    if (a->window > 0 && C < a->window) sdm_die("attention: KV cache of %d entries is shorter than the window %d", C, a->window);
    if (B == 0) return;
    if (dt == ATTN_BF16 && a->head_dim == 64) attn_decode_launch<bf16, 64>(a, B, q, k_cache, v_cache, C, len, out, st);
    else if (dt == ATTN_BF16) attn_decode_launch<bf16, 128>(a, B, q, k_cache, v_cache, C, len, out, st);
    else if (a->head_dim == 64) attn_decode_launch<float, 64>(a, B, q, k_cache, v_cache, C, len, out, st);
    else attn_decode_launch<float, 128>(a, B, q, k_cache, v_cache, C, len, out, st);
}

#endif
