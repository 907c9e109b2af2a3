// attention/attention_layer.cuh: one attention mixer of the model on the GPU (SDM_SPEC §6.3), full or sliding-window:
//   q = x Wqᵀ, k = x Wkᵀ, v = x Wvᵀ -> RoPE(q, k) -> o = attention(q, k, v) -> og = sigmoid(x Wgᵀ) * o (gated) -> y = og Woᵀ
// built from the projection GEMMs (core/matmul.cuh) and the kernels of attention/attention.cuh. The layer object owns
// the activations its backward needs; weights and their fp32 gradients live in the model's flat arrays.
#ifndef SDM_ATTENTION_LAYER_CUH
#define SDM_ATTENTION_LAYER_CUH

#include "attention/attention.cuh"
#include "core/matmul.cuh"

// Pointers into the model's working weights (compute dtype) / fp32 gradients. wg is NULL when not gated.
typedef struct { const void *wq, *wk, *wv, *wg, *wo; } AttnLayerParams;
typedef struct { float *wq, *wk, *wv, *wg, *wo; } AttnLayerGrads;

typedef struct {
    AttnDims a;
    int B, T;
    cudaDataType_t ctype;
    AttnDtype adt;
    AttnRope rope;
    void *q, *k, *v, *o, *z, *og; // saved by the forward: q, k after RoPE [n, n_h|n_kv * d_h]; z, og when gated
    float *lse;                    // [B, n_h, T]
    void *dq, *dk, *dv, *dog;      // backward scratch
    void *workspace;
} AttnLayer;

static inline void *attn_layer_alloc(size_t bytes) {
    void *p = NULL;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

static inline AttnLayer attn_layer_create(const AttnDims *a, int B, int T, cudaDataType_t ctype) {
    attn_check_dims(a);
    AttnLayer L;
    memset(&L, 0, sizeof L);
    L.a = *a;
    L.B = B;
    L.T = T;
    L.ctype = ctype;
    L.adt = ctype == CUDA_R_32F ? ATTN_FP32 : ATTN_BF16;
    L.rope = attn_rope_create(a->head_dim, a->rope_theta);
    size_t n = (size_t)B * T, es = dtype_size(ctype);
    size_t qb = n * a->n_heads * a->head_dim * es, kb = n * a->n_kv_heads * a->head_dim * es;
    L.q = attn_layer_alloc(qb);
    L.k = attn_layer_alloc(kb);
    L.v = attn_layer_alloc(kb);
    L.o = attn_layer_alloc(qb);
    if (a->gated) {
        L.z = attn_layer_alloc(qb);
        L.og = attn_layer_alloc(qb);
    }
    L.lse = (float *)attn_layer_alloc((size_t)B * a->n_heads * T * sizeof(float));
    L.dq = attn_layer_alloc(qb);
    L.dk = attn_layer_alloc(kb);
    L.dv = attn_layer_alloc(kb);
    L.dog = attn_layer_alloc(qb);
    L.workspace = attn_layer_alloc(attn_backward_workspace_bytes(a, B, T));
    return L;
}

static inline void attn_layer_destroy(AttnLayer *L) {
    void *bufs[] = {L->q, L->k, L->v, L->o, L->z, L->og, L->lse, L->dq, L->dk, L->dv, L->dog, L->workspace};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaCheck(cudaFree(bufs[i]));
    attn_rope_destroy(&L->rope);
    memset(L, 0, sizeof *L);
}

// y [B*T, D] = the layer of x [B*T, D] (compute dtype); saves what the backward needs.
static inline void attn_layer_forward(AttnLayer *L, const AttnLayerParams *p, const void *x, void *y, cudaStream_t s) {
    const AttnDims *a = &L->a;
    int n = L->B * L->T, D = a->dim, nq = a->n_heads * a->head_dim, nk = a->n_kv_heads * a->head_dim;
    matmul_forward(L->q, L->ctype, nq, x, p->wq, NULL, L->ctype, n, nq, D, s);
    matmul_forward(L->k, L->ctype, nk, x, p->wk, NULL, L->ctype, n, nk, D, s);
    matmul_forward(L->v, L->ctype, nk, x, p->wv, NULL, L->ctype, n, nk, D, s);
    attn_rope(&L->rope, a, L->B, L->T, L->adt, L->q, L->k, NULL, 1, s);
    attn_forward(a, L->B, L->T, L->adt, L->q, L->k, L->v, L->o, L->lse, s);
    const void *mixed = L->o;
    if (a->gated) {
        matmul_forward(L->z, L->ctype, nq, x, p->wg, NULL, L->ctype, n, nq, D, s);
        attn_gate_forward(L->adt, (size_t)n * nq, L->z, L->o, L->og, s);
        mixed = L->og;
    }
    matmul_forward(y, L->ctype, D, mixed, p->wo, NULL, L->ctype, n, D, nq, s);
}

// dx [B*T, D] (overwritten) and the weight gradients (+=) from dy, after attn_layer_forward on the same x.
static inline void attn_layer_backward(AttnLayer *L, const AttnLayerParams *p, const AttnLayerGrads *g, const void *x,
                                       const void *dy, void *dx, cudaStream_t s) {
    const AttnDims *a = &L->a;
    int n = L->B * L->T, D = a->dim, nq = a->n_heads * a->head_dim, nk = a->n_kv_heads * a->head_dim;
    matmul_backward_weight(g->wo, CUDA_R_32F, dy, D, a->gated ? L->og : L->o, L->ctype, n, D, nq, 1, s);
    matmul_backward_input(L->dog, L->ctype, dy, D, p->wo, L->ctype, n, D, nq, 0, s);
    // d(out of the core) and dq take two of the scratch buffers; with a gate, dz takes dog first
    void *d_o = L->dog, *dq = L->dq;
    int have_dx = 0;
    if (a->gated) {
        attn_gate_backward(L->adt, (size_t)n * nq, L->z, L->o, L->dog, L->dq, L->dog, s); // do -> dq, dz -> dog
        matmul_backward_weight(g->wg, CUDA_R_32F, L->dog, nq, x, L->ctype, n, nq, D, 1, s);
        matmul_backward_input(dx, L->ctype, L->dog, nq, p->wg, L->ctype, n, nq, D, 0, s);
        have_dx = 1;
        d_o = L->dq;
        dq = L->dog;
    }
    attn_backward(a, L->B, L->T, L->adt, L->q, L->k, L->v, L->o, L->lse, d_o, dq, L->dk, L->dv, L->workspace, s);
    attn_rope(&L->rope, a, L->B, L->T, L->adt, dq, L->dk, NULL, -1, s);
    matmul_backward_weight(g->wq, CUDA_R_32F, dq, nq, x, L->ctype, n, nq, D, 1, s);
    matmul_backward_weight(g->wk, CUDA_R_32F, L->dk, nk, x, L->ctype, n, nk, D, 1, s);
    matmul_backward_weight(g->wv, CUDA_R_32F, L->dv, nk, x, L->ctype, n, nk, D, 1, s);
    matmul_backward_input(dx, L->ctype, dq, nq, p->wq, L->ctype, n, nq, D, have_dx, s);
    matmul_backward_input(dx, L->ctype, L->dk, nk, p->wk, L->ctype, n, nk, D, 1, s);
    matmul_backward_input(dx, L->ctype, L->dv, nk, p->wv, L->ctype, n, nk, D, 1, s);
}

#endif
