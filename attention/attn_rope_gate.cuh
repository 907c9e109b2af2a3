// attention/attn_rope_gate.cuh: the pointwise parts of the attention layer on the GPU (docs/MODEL.md#attention): RoPE
// in place on q [B,T,n_h,d_h] and k [B,T,n_kv,d_h] (forward, or its transpose for the backward; positions from pos0[b]
// for decode), and the sigmoid output gate og = sigmoid(z) * o with its backward, elementwise on [B,T,n_h*d_h].
#ifndef SDM_ATTN_ROPE_GATE_CUH
#define SDM_ATTN_ROPE_GATE_CUH

#include "attention/attn_common.cuh"

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
    r.inv_freq = (float *)device_alloc(MEM_SCRATCH, (size_t)(head_dim / 2) * sizeof(float));
    device_upload(r.inv_freq, h, (size_t)(head_dim / 2) * sizeof(float));
    free(h);
    return r;
}

static inline void attn_rope_destroy(AttnRope *r) { device_free(r->inv_freq); r->inv_freq = NULL; }

// Pair (x0, x1) turned by the angle of sine sn and cosine cs (RoPE; its transpose with sn negated). Every RoPE on
// the GPU goes through here, so the decode step's fused rotation has the bits of the prefill's.
__device__ __forceinline__ void attn_rope_turn(float x0, float x1, float sn, float cs, float &y0, float &y1) {
    y0 = x0 * cs - x1 * sn;
    y1 = x0 * sn + x1 * cs;
}

#define ATTN_ROPE_HEADS 8

// One thread per (row b*T+t, group of ATTN_ROPE_HEADS heads of q then k, 16 bytes of a head: V pairs from m0): the V
// angles' sincos once for its group, all its 16-byte loads issued before its stores; a warp's threads cover
// consecutive 16-byte pieces of head rows. Position = pos0[b] + t (pos0 NULL: t).
template <typename T>
__global__ void attn_rope_kernel(T *q, T *k, int T_, int nh, int nkv, int half, const float *inv_freq,
                                 const int *pos0, float direction, size_t n) {
    typedef DtypeVec<T> Vec;
    constexpr int V = Vec::N / 2;
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int pieces = half / V, groups = (nh + nkv + ATTN_ROPE_HEADS - 1) / ATTN_ROPE_HEADS, m0 = (int)(i % pieces) * V;
    int h0 = (int)(i / pieces % groups) * ATTN_ROPE_HEADS;
    size_t row = i / pieces / groups;
    int t = (int)(row % T_), b = (int)(row / T_);
    float pos = (float)((pos0 ? pos0[b] : 0) + t), sn[V], cs[V];
#pragma unroll
    for (int p = 0; p < V; p++) {
        sincosf(pos * inv_freq[m0 + p], &sn[p], &cs[p]);
        sn[p] *= direction;
    }
    T *x[ATTN_ROPE_HEADS];
    Vec v[ATTN_ROPE_HEADS];
#pragma unroll
    for (int j = 0; j < ATTN_ROPE_HEADS; j++) {
        int h = h0 + j;
        x[j] = h >= nh + nkv ? NULL
               : h < nh     ? q + (row * nh + h) * 2 * half + 2 * m0
                            : k + (row * nkv + (h - nh)) * 2 * half + 2 * m0;
        if (x[j]) v[j] = dtype_pack_load<Vec>(x[j]);
    }
#pragma unroll
    for (int j = 0; j < ATTN_ROPE_HEADS; j++)
        if (x[j]) {
#pragma unroll
            for (int p = 0; p < V; p++) {
                float y0, y1;
                attn_rope_turn(v[j].get(2 * p), v[j].get(2 * p + 1), sn[p], cs[p], y0, y1);
                v[j].set(2 * p, y0);
                v[j].set(2 * p + 1, y1);
            }
            dtype_pack_store(x[j], v[j]);
        }
}

// In place on q [B,T,n_h,d_h] and k [B,T,n_kv,d_h]; direction 1 = forward, -1 = backward (the transpose).
static inline void attn_rope(const AttnRope *r, const AttnDims *a, int B, int T, Dtype dt, void *q, void *k,
                             const int *pos0, int direction, cudaStream_t st) {
    if (r->head_dim != a->head_dim)
        sdm_die("attention: RoPE table for head_dim %d used with %d", r->head_dim, a->head_dim);
    if (a->head_dim % 8) sdm_die("attention: RoPE on the GPU takes head_dim a multiple of 8, not %d", a->head_dim);
    int half = a->head_dim / 2, pieces = (int)(half * dtype_size(dt) / 8); // 16 bytes of a head row a thread
    size_t groups = (size_t)(a->n_heads + a->n_kv_heads + ATTN_ROPE_HEADS - 1) / ATTN_ROPE_HEADS;
    size_t n = (size_t)B * T * groups * pieces;
    if (n == 0) return;
    unsigned grid = (unsigned)((n + 255) / 256);
    if (dt == DT_BF16)
        launch_pdl(attn_rope_kernel<bf16>, grid, 256, 0, st, (bf16 *)q, (bf16 *)k, T, a->n_heads, a->n_kv_heads,
                   half, r->inv_freq, pos0, (float)direction, n);
    else
        launch_pdl(attn_rope_kernel<float>, grid, 256, 0, st, (float *)q, (float *)k, T, a->n_heads, a->n_kv_heads,
                   half, r->inv_freq, pos0, (float)direction, n);
    cudaCheckLast();
}

// ---------------------------------------------------------------------------------------------------------------
// Sigmoid gate: og = sigmoid(z) * o; backward do = sigmoid(z) * dog, dz = dog * o * sigmoid'(z). Elementwise on n
// entries (o, z [B,T,n_h*d_h]); do and dz may alias dog.

template <typename T>
__global__ void attn_gate_forward_kernel(const T *z, const T *o, T *og, size_t n) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) og[i] = dtype_from_float<T>(core_sigmoid_gate(dtype_to_float(z[i]), dtype_to_float(o[i])));
}

template <typename T>
__global__ void attn_gate_backward_kernel(const T *z, const T *o, const T *dog, T *d_o, T *dz, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 1.0f / (1.0f + expf(-dtype_to_float(z[i]))), g = dtype_to_float(dog[i]), ov = dtype_to_float(o[i]);
    d_o[i] = dtype_from_float<T>(s * g);
    dz[i] = dtype_from_float<T>(g * ov * s * (1.0f - s));
}

static inline void attn_gate_forward(Dtype dt, size_t n, const void *z, const void *o, void *og, cudaStream_t st) {
    if (n == 0) return;
    unsigned grid = (unsigned)((n + 255) / 256);
    if (dt == DT_BF16)
        launch_pdl(attn_gate_forward_kernel<bf16>, grid, 256, 0, st, (const bf16 *)z, (const bf16 *)o, (bf16 *)og, n);
    else
        launch_pdl(attn_gate_forward_kernel<float>, grid, 256, 0, st, (const float *)z, (const float *)o, (float *)og,
                   n);
    cudaCheckLast();
}

static inline void attn_gate_backward(Dtype dt, size_t n, const void *z, const void *o, const void *dog, void *d_o,
                                      void *dz, cudaStream_t st) {
    if (n == 0) return;
    unsigned grid = (unsigned)((n + 255) / 256);
    if (dt == DT_BF16)
        attn_gate_backward_kernel<bf16><<<grid, 256, 0, st>>>((const bf16 *)z, (const bf16 *)o, (const bf16 *)dog,
                                                              (bf16 *)d_o, (bf16 *)dz, n);
    else
        attn_gate_backward_kernel<float><<<grid, 256, 0, st>>>((const float *)z, (const float *)o, (const float *)dog,
                                                               (float *)d_o, (float *)dz, n);
    cudaCheckLast();
}

#endif
