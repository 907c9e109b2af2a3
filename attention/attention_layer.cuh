// attention/attention_layer.cuh: one attention mixer of the model on the GPU (docs/MODEL.md#attention), full or
// sliding-window:
//   q = x Wqᵀ, k = x Wkᵀ, v = x Wvᵀ -> RoPE(q, k) -> o = attention(q, k, v) -> og = sigmoid(x Wgᵀ) * o (gated)
//   -> y = og Woᵀ
// built from the projection GEMMs (core/matmul.cuh) and the kernels of attention/attention.cuh. The layer object owns
// the activations its backward needs; weights and their fp32 gradients live in the model's flat arrays. Backward
// temporaries (AttnLayerBwd) live only inside one backward, so a model's layers share one set. With `recompute`
// the gated output og is not kept: the backward recomputes it from z and o (the same kernel, the same bits).
#ifndef SDM_ATTENTION_LAYER_CUH
#define SDM_ATTENTION_LAYER_CUH

#include "attention/attention.cuh"
#include "core/matmul.cuh"
#include "core/profile.cuh"

// Pointers into the model's working weights (compute dtype) / fp32 gradients. wg is NULL when not gated.
typedef struct { const void *wq, *wk, *wv, *wg, *wo; } AttnLayerParams;
typedef struct { float *wq, *wk, *wv, *wg, *wo; } AttnLayerGrads;

// Backward temporaries: dq, dog [n, n_h*d_h], dk, dv [n, n_kv*d_h], the attention workspace, and (gated layers
// with recompute) og [n, n_h*d_h].
typedef struct { void *dq, *dk, *dv, *dog, *og, *workspace; } AttnLayerBwd;
typedef struct { size_t q, kv, og, workspace; } AttnBwdSizes; // bytes of each (og 0: not needed)

static inline AttnBwdSizes attn_layer_bwd_sizes(const AttnDims *a, int B, int T, Dtype ctype, int recompute) {
    size_t n = (size_t)B * T, es = dtype_size(ctype), q = n * a->n_heads * a->head_dim * es;
    AttnBwdSizes s = {q, n * a->n_kv_heads * a->head_dim * es, a->gated && recompute ? q : 0,
                      attn_backward_workspace_bytes(a, B, T)};
    return s;
}

// Sizes that fit both x and y: one set of temporaries serves layers of different head counts and widths.
static inline AttnBwdSizes attn_bwd_sizes_max(AttnBwdSizes x, AttnBwdSizes y) {
    AttnBwdSizes s = {SDM_MAX(x.q, y.q), SDM_MAX(x.kv, y.kv), SDM_MAX(x.og, y.og), SDM_MAX(x.workspace, y.workspace)};
    return s;
}

static inline AttnLayerBwd attn_layer_bwd_create(AttnBwdSizes s) {
    AttnLayerBwd b;
    b.dq = device_alloc(MEM_SCRATCH, s.q);
    b.dk = device_alloc(MEM_SCRATCH, s.kv);
    b.dv = device_alloc(MEM_SCRATCH, s.kv);
    b.dog = device_alloc(MEM_SCRATCH, s.q);
    b.og = s.og ? device_alloc(MEM_SCRATCH, s.og) : NULL;
    b.workspace = device_alloc(MEM_SCRATCH, s.workspace);
    return b;
}

static inline void attn_layer_bwd_destroy(AttnLayerBwd *b) {
    void *bufs[] = {b->dq, b->dk, b->dv, b->dog, b->og, b->workspace};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) device_free(bufs[i]);
    memset(b, 0, sizeof *b);
}

typedef struct {
    AttnDims a;
    int B, T;
    Dtype ctype;
    int recompute;                 // og lives in bw.og and is recomputed by the backward
    AttnRope rope;
    void *q, *k, *v, *o, *z, *og; // saved by the forward: q, k after RoPE [n, n_h|n_kv * d_h]; z, og when gated
    float *lse;                    // [B, n_h, T]
    AttnLayerBwd bw;               // backward temporaries: the layer's own, or shared (owns_bw = 0)
    int owns_bw;
    Profiler *prof;                // NULL: not profiled
} AttnLayer;

// A layer for B sequences of T tokens. shared: backward temporaries of at least this layer's sizes
// (attn_layer_bwd_sizes with the same `recompute`), or NULL for the layer's own.
static inline AttnLayer attn_layer_create(const AttnDims *a, int B, int T, Dtype ctype, int recompute,
                                          const AttnLayerBwd *shared) {
    attn_check_dims(a);
    AttnLayer L;
    memset(&L, 0, sizeof L);
    L.a = *a;
    L.B = B;
    L.T = T;
    L.ctype = ctype;
    L.recompute = recompute;
    L.rope = attn_rope_create(a->head_dim, a->rope_theta);
    AttnBwdSizes sz = attn_layer_bwd_sizes(a, B, T, ctype, recompute);
    L.q = device_alloc(MEM_ACTIVATIONS, sz.q);
    L.k = device_alloc(MEM_ACTIVATIONS, sz.kv);
    L.v = device_alloc(MEM_ACTIVATIONS, sz.kv);
    L.o = device_alloc(MEM_ACTIVATIONS, sz.q);
    L.lse = (float *)device_alloc(MEM_ACTIVATIONS, (size_t)B * a->n_heads * T * sizeof(float));
    L.owns_bw = shared == NULL;
    L.bw = shared ? *shared : attn_layer_bwd_create(sz);
    if (a->gated) {
        L.z = device_alloc(MEM_ACTIVATIONS, sz.q);
        L.og = recompute ? L.bw.og : device_alloc(MEM_ACTIVATIONS, sz.q);
    }
    return L;
}

static inline void attn_layer_destroy(AttnLayer *L) {
    void *bufs[] = {L->q, L->k, L->v, L->o, L->z, L->recompute ? NULL : L->og, L->lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) device_free(bufs[i]);
    if (L->owns_bw) attn_layer_bwd_destroy(&L->bw);
    attn_rope_destroy(&L->rope);
    memset(L, 0, sizeof *L);
}

// q [n, n_h*d_h] (row stride ldq), k, v [n, n_kv*d_h] (row stride ldkv) = x Wqᵀ, x Wkᵀ, x Wvᵀ for the n rows of
// x [n, D] (before RoPE), and with z (not NULL: a gated layer's decode) the gate's z [n, n_h*d_h] (stride ldq) =
// x Wgᵀ as a fourth part of the same product. norm: x's input norm (MatmulParts.norm; x its buffer) or NULL.
static inline void attn_layer_qkv(const AttnDims *a, Dtype ct, const AttnLayerParams *p, const void *x, int n,
                                  void *q, void *k, void *v, void *z, int ldq, int ldkv, cudaStream_t s,
                                  const ResidualNorm *norm = NULL) {
    int D = a->dim, nq = a->n_heads * a->head_dim, nk = a->n_kv_heads * a->head_dim;
    MatmulParts P = {z ? 4 : 3, {p->wq, p->wk, p->wv, p->wg}, {q, k, v, z}, {NULL, NULL, NULL, NULL},
                     {nq, nk, nk, nq}, {ldq, ldkv, ldkv, ldq}};
    if (norm) P.norm = *norm;
    matmul_forward_parts(&P, ct, x, ct, n, D, s); // one launch at decode
}

// y [n, D] = mixed Woᵀ for mixed [n, n_h*d_h]: og of a gated layer, else o.
static inline void attn_layer_wo(const AttnDims *a, Dtype ct, const AttnLayerParams *p, const void *mixed, int n,
                                 void *y, cudaStream_t s) {
    int D = a->dim, nq = a->n_heads * a->head_dim;
    matmul_forward(y, ct, D, mixed, p->wo, NULL, ct, n, D, nq, s);
}

// y [n, D] = og Woᵀ with og = sigmoid(x Wgᵀ) * o when gated (z, og: its buffers), else o [n, n_h*d_h]. z and og
// keep their values when `keep` (training's backward reads them); else a few rows (a prefill's) take the gate in
// x Wgᵀ's store, the same bits in og alone.
static inline void attn_layer_out(const AttnDims *a, Dtype ct, const AttnLayerParams *p, const void *x,
                                  const void *o, void *z, void *og, int n, int keep, void *y, cudaStream_t s) {
    int D = a->dim, nq = a->n_heads * a->head_dim;
    const void *mixed = o;
    if (a->gated) {
        if (keep || !matmul_forward_gate(og, o, x, p->wg, ct, n, nq, D, s)) {
            matmul_forward(z, ct, nq, x, p->wg, NULL, ct, n, nq, D, s);
            attn_gate_forward(ct, (size_t)n * nq, z, o, og, s);
        }
        mixed = og;
    }
    attn_layer_wo(a, ct, p, mixed, n, y, s);
}

// Marks of the step profile (core/profile.cuh). The region since the last mark was the layer's projections, of
// `flops` GEMM FLOPs (the gate's element-wise work is not counted)...
static inline void attn_layer_mark_proj(const AttnLayer *L, double flops, cudaStream_t s) {
    prof_mark(L->prof, L->a.window > 0 ? "SWA projections" : "attn projections", flops, 0, s);
}

// ... or its core, RoPE and the attention kernels: forward, the mask's products QKᵀ and PV, reading q, k, v and
// writing o; backward, 2.5 times the products (dQ, dK, dV, dP and the recomputed P), reading q, k, v, o, do and
// writing dq, dk, dv.
static inline void attn_layer_mark_core(const AttnLayer *L, int backward, cudaStream_t s) {
    if (!L->prof || !L->prof->on) return;
    const AttnDims *a = &L->a;
    double qkvo = 2.0 * L->B * L->T * (a->n_heads + a->n_kv_heads) * a->head_dim * dtype_size(L->ctype); // bytes
    double flops = 4.0 * L->B * a->n_heads * a->head_dim * attn_mask_pairs(L->T, a->window);
    const char *part = a->window > 0 ? (backward ? "SWA backward" : "SWA forward")
                                     : (backward ? "attn backward" : "attn forward");
    prof_mark(L->prof, part, backward ? 2.5 * flops : flops, backward ? 2 * qkvo : qkvo, s);
}

// FLOPs of the q, k, v projections and of the output side (gate and Wo) for n rows, forward.
static inline double attn_layer_qkv_flops(const AttnDims *a, int n) {
    return 2.0 * n * a->dim * (a->n_heads + 2 * a->n_kv_heads) * a->head_dim;
}
static inline double attn_layer_out_flops(const AttnDims *a, int n) {
    return 2.0 * n * a->dim * a->n_heads * a->head_dim * (a->gated ? 2 : 1);
}

// y [B*T, D] = the layer of x [B*T, D] (compute dtype); saves what the backward needs.
static inline void attn_layer_forward(AttnLayer *L, const AttnLayerParams *p, const void *x, void *y, cudaStream_t s) {
    const AttnDims *a = &L->a;
    int n = L->B * L->T;
    attn_layer_qkv(a, L->ctype, p, x, n, L->q, L->k, L->v, NULL, a->n_heads * a->head_dim,
                   a->n_kv_heads * a->head_dim, s);
    attn_layer_mark_proj(L, attn_layer_qkv_flops(a, n), s);
    attn_rope(&L->rope, a, L->B, L->T, L->ctype, L->q, L->k, NULL, 1, s);
    attn_forward(a, L->B, L->T, L->ctype, L->q, L->k, L->v, L->o, L->lse, s);
    attn_layer_mark_core(L, 0, s);
    attn_layer_out(a, L->ctype, p, x, L->o, L->z, L->og, n, 1, y, s);
    attn_layer_mark_proj(L, attn_layer_out_flops(a, n), s);
}

// dx [B*T, D] (overwritten) and the weight gradients (+=) from dy, after attn_layer_forward on the same x.
static inline void attn_layer_backward(AttnLayer *L, const AttnLayerParams *p, const AttnLayerGrads *g, const void *x,
                                       const void *dy, void *dx, cudaStream_t s) {
    const AttnDims *a = &L->a;
    int n = L->B * L->T, D = a->dim, nq = a->n_heads * a->head_dim, nk = a->n_kv_heads * a->head_dim;
    const AttnLayerBwd *b = &L->bw;
    if (a->gated && L->recompute) attn_gate_forward(L->ctype, (size_t)n * nq, L->z, L->o, L->og, s);
    matmul_backward_weight(g->wo, DT_FP32, dy, D, a->gated ? L->og : L->o, L->ctype, n, D, nq, 1, s);
    matmul_backward_input(b->dog, L->ctype, dy, D, p->wo, L->ctype, n, D, nq, 0, s);
    // d(out of the core) and dq take two of the scratch buffers; with a gate, dz takes dog first
    void *d_o = b->dog, *dq = b->dq;
    int have_dx = 0;
    if (a->gated) {
        attn_gate_backward(L->ctype, (size_t)n * nq, L->z, L->o, b->dog, b->dq, b->dog, s); // do -> dq, dz -> dog
        matmul_backward_weight(g->wg, DT_FP32, b->dog, nq, x, L->ctype, n, nq, D, 1, s);
        matmul_backward_input(dx, L->ctype, b->dog, nq, p->wg, L->ctype, n, nq, D, 0, s);
        have_dx = 1;
        d_o = b->dq;
        dq = b->dog;
    }
    attn_layer_mark_proj(L, 2 * attn_layer_out_flops(a, n), s);
    attn_backward(a, L->B, L->T, L->ctype, L->q, L->k, L->v, L->o, L->lse, d_o, dq, b->dk, b->dv, b->workspace, s);
    attn_rope(&L->rope, a, L->B, L->T, L->ctype, dq, b->dk, NULL, -1, s);
    attn_layer_mark_core(L, 1, s);
    matmul_backward_weight(g->wq, DT_FP32, dq, nq, x, L->ctype, n, nq, D, 1, s);
    matmul_backward_weight(g->wk, DT_FP32, b->dk, nk, x, L->ctype, n, nk, D, 1, s);
    matmul_backward_weight(g->wv, DT_FP32, b->dv, nk, x, L->ctype, n, nk, D, 1, s);
    matmul_backward_input(dx, L->ctype, dq, nq, p->wq, L->ctype, n, nq, D, have_dx, s);
    matmul_backward_input(dx, L->ctype, b->dk, nk, p->wk, L->ctype, n, nk, D, 1, s);
    matmul_backward_input(dx, L->ctype, b->dv, nk, p->wv, L->ctype, n, nk, D, 1, s);
    attn_layer_mark_proj(L, 2 * attn_layer_qkv_flops(a, n), s);
}

// ------------------------------------------------------------------------------------------------------------------
// Inference (docs/MODEL.md#inference): per stream a KV cache [C, n_kv, d_h] of K after RoPE and V, where position s
// lives in slot s % C: a ring buffer of C = window entries for SWA, or a full cache of C = max_tokens for full
// attention. A prefill runs one stream's prompt (positions 0..T-1) through the training kernels and stores its last C
// keys and values; a decode step appends one token per stream at its position and attends over the cache.

typedef struct {
    AttnDims a;
    int streams, rows, C; // rows = max(max_tokens, streams): the scratch buffers' token capacity
    Dtype ctype;
    AttnRope rope;
    void *q, *k, *v, *o, *z, *og; // [rows, ...] scratch of one call
    void *qkv;                    // [streams, qkv_ld]: a decode step's q | k | v (| z) rows, one product in memory
    int qkv_ld;                   // 2 n_h d_h + 2 n_kv d_h when gated, else n_h d_h + 2 n_kv d_h
    void *k_cache, *v_cache;      // [streams, C, n_kv, d_h]
} AttnInferState;

static inline AttnInferState attn_infer_create(const AttnDims *a, int streams, int max_tokens, Dtype ctype) {
    attn_check_dims(a);
    AttnInferState I;
    memset(&I, 0, sizeof I);
    I.a = *a;
    I.streams = streams;
    I.rows = max_tokens > streams ? max_tokens : streams;
    I.C = a->window > 0 ? a->window : max_tokens;
    I.ctype = ctype;
    I.rope = attn_rope_create(a->head_dim, a->rope_theta);
    size_t es = dtype_size(ctype), qb = (size_t)I.rows * a->n_heads * a->head_dim * es;
    size_t kb = (size_t)I.rows * a->n_kv_heads * a->head_dim * es;
    I.q = device_alloc(MEM_ACTIVATIONS, qb);
    I.k = device_alloc(MEM_ACTIVATIONS, kb);
    I.v = device_alloc(MEM_ACTIVATIONS, kb);
    I.o = device_alloc(MEM_ACTIVATIONS, qb);
    if (a->gated) {
        I.z = device_alloc(MEM_ACTIVATIONS, qb);
        I.og = device_alloc(MEM_ACTIVATIONS, qb);
    }
    I.qkv_ld = (a->gated ? 2 : 1) * a->n_heads * a->head_dim + 2 * a->n_kv_heads * a->head_dim;
    I.qkv = device_alloc(MEM_ACTIVATIONS, (size_t)streams * I.qkv_ld * es);
    size_t cache = (size_t)streams * I.C * a->n_kv_heads * a->head_dim * es;
    I.k_cache = device_alloc(MEM_ACTIVATIONS, cache);
    I.v_cache = device_alloc(MEM_ACTIVATIONS, cache);
    return I;
}

static inline void attn_infer_destroy(AttnInferState *I) {
    void *bufs[] = {I->q, I->k, I->v, I->o, I->z, I->og, I->qkv, I->k_cache, I->v_cache};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) device_free(bufs[i]);
    attn_rope_destroy(&I->rope);
    memset(I, 0, sizeof *I);
}

// Rows t in [T - n, T) of k, v [T, row] go to slots t % C of one stream's caches [C, row], n = min(T, C).
template <typename T>
__global__ void attn_cache_fill_kernel(const T *k, const T *v, T *kc, T *vc, int T_, int C, size_t row) {
    int n = T_ < C ? T_ : C;
    size_t total = (size_t)n * row;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = (size_t)(T_ - n) + i / row, dst = (t % C) * row + i % row;
        kc[dst] = k[t * row + i % row];
        vc[dst] = v[t * row + i % row];
    }
}

// Prefill of stream b: y [T, D] = the layer of its prompt x [T, D] at positions 0..T-1; fills its caches.
static inline void attn_infer_prefill(AttnInferState *I, const AttnLayerParams *p, int b, const void *x, void *y,
                                      int T, cudaStream_t s) {
    const AttnDims *a = &I->a;
    if (T > I->rows) sdm_die("attention inference: a prompt of %d tokens exceeds the state's %d", T, I->rows);
    if (a->window == 0 && T > I->C) sdm_die("attention inference: %d tokens exceed the KV cache of %d", T, I->C);
    attn_layer_qkv(a, I->ctype, p, x, T, I->q, I->k, I->v, NULL, a->n_heads * a->head_dim,
                   a->n_kv_heads * a->head_dim, s);
    attn_rope(&I->rope, a, 1, T, I->ctype, I->q, I->k, NULL, 1, s);
    attn_forward(a, 1, T, I->ctype, I->q, I->k, I->v, I->o, NULL, s);
    attn_layer_out(a, I->ctype, p, x, I->o, I->z, I->og, T, 0, y, s);
    size_t row = (size_t)a->n_kv_heads * a->head_dim, off = (size_t)b * I->C * row;
    if (I->ctype == DT_BF16)
        attn_cache_fill_kernel<bf16><<<256, 256, 0, s>>>((const bf16 *)I->k, (const bf16 *)I->v,
                                                         (bf16 *)I->k_cache + off, (bf16 *)I->v_cache + off, T, I->C,
                                                         row);
    else
        attn_cache_fill_kernel<float><<<256, 256, 0, s>>>((const float *)I->k, (const float *)I->v,
                                                          (float *)I->k_cache + off, (float *)I->v_cache + off, T,
                                                          I->C, row);
    cudaCheckLast();
}

// Decode step of streams 0..B-1: y [B, D] = the layer of one new token per stream x [B, D] at position pos[b]
// (device), attending over positions 0..pos[b]; norm: x's input norm (MatmulParts.norm; x its buffer) or NULL. Full
// attention needs pos[b] < C (the caller checks). A gated layer's z joins the q, k, v product and attn_decode writes
// og = sigmoid(z) * o (the bits of attn_gate_forward on z and o): three launches, the gate's product and
// element-wise step none of their own, and x is read by that product alone. q, k, v (and z) are column slices of one
// buffer, as their weights are of the model's table, so that every batch takes them as one product.
static inline void attn_infer_decode(AttnInferState *I, const AttnLayerParams *p, const void *x,
                                     const ResidualNorm *norm, void *y, const int *pos, int B, cudaStream_t s) {
    const AttnDims *a = &I->a;
    if (B < 1 || B > I->streams) sdm_die("attention inference: a decode step of %d of %d streams", B, I->streams);
    size_t es = dtype_size(I->ctype), nq = (size_t)a->n_heads * a->head_dim, nk = (size_t)a->n_kv_heads * a->head_dim;
    char *q = (char *)I->qkv, *k = q + nq * es, *v = k + nk * es, *z = a->gated ? v + nk * es : NULL;
    void *mixed = a->gated ? I->og : I->o;
    attn_layer_qkv(a, I->ctype, p, x, B, q, k, v, z, I->qkv_ld, I->qkv_ld, s, norm);
    attn_decode(a, B, I->ctype, &I->rope, q, k, v, z, I->qkv_ld, I->qkv_ld, I->k_cache, I->v_cache, I->C, pos, mixed,
                s);
    attn_layer_wo(a, I->ctype, p, mixed, B, y, s);
}

// Stream `to`'s KV caches = stream `from`'s (a generator compacting its active streams).
static inline void attn_infer_copy_stream(AttnInferState *I, int from, int to, cudaStream_t s) {
    size_t bytes = (size_t)I->C * I->a.n_kv_heads * I->a.head_dim * dtype_size(I->ctype);
    cudaCheck(cudaMemcpyAsync((char *)I->k_cache + to * bytes, (char *)I->k_cache + from * bytes, bytes,
                              cudaMemcpyDeviceToDevice, s));
    cudaCheck(cudaMemcpyAsync((char *)I->v_cache + to * bytes, (char *)I->v_cache + from * bytes, bytes,
                              cudaMemcpyDeviceToDevice, s));
}

#endif
