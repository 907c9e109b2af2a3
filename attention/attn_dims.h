// attention/attn_dims.h: the hyper-parameters of one attention layer (docs/MODEL.md#attention), full or sliding-window.
#ifndef SDM_ATTN_DIMS_H
#define SDM_ATTN_DIMS_H

typedef struct {
    int dim;           // D, model width
    int n_heads;       // n_h query heads
    int n_kv_heads;    // n_kv key/value heads; n_h % n_kv == 0, query head j uses kv head j / (n_h / n_kv)
    int head_dim;      // d_h, even
    int window;        // 0: full causal; w > 0: key s visible from query p iff 0 <= p - s < w
    int gated;         // o = sigmoid(W_gate x) * o before the output projection
    double rope_theta; // RoPE base
} AttnDims;

// Query-key pairs inside the mask of one sequence of T tokens, the sum over positions p of min(p + 1, w) (w = 0:
// full causal, p + 1): the products QKᵀ and PV cost 4 d_h FLOPs per pair and query head.
static inline double attn_mask_pairs(int T, int window) {
    double t = T, w = window;
    if (window <= 0 || window >= T) return t * (t + 1) / 2;
    return w * (w + 1) / 2 + (t - w) * w;
}

#endif
