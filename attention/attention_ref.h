// attention/attention_ref.h: the double-precision CPU reference of one attention layer (docs/MODEL.md#attention),
// written to be read as the definition. Speed does not matter here; the GPU kernels and the whole-model oracle are
// checked against it.
//
//   q = Wq x [B,T,n_h,d_h];  k = Wk x, v = Wv x [B,T,n_kv,d_h]          (no biases)
//   q, k <- RoPE(q), RoPE(k) at positions 0..T-1 of each row
//   o_j = softmax(q_j k_g^T / sqrt(d_h) + mask) v_g,  g = j / (n_h / n_kv)     (GQA)
//   o <- sigmoid(Wg x) * o  when gated;   y = Wo o
//   mask: key s visible from query p iff 0 <= p - s < w (w = 0: iff s <= p, full causal)
//
// Weights are (out, in) row-major: q[b,t,:] = wq . x[b,t,:].
#ifndef SDM_ATTENTION_REF_H
#define SDM_ATTENTION_REF_H

#include <math.h>

#include "attention/attn_dims.h"
#include "core/common.h"
#include "core/ref_ops.h"

typedef struct { const double *wq, *wk, *wv, *wo, *wg; } AttnRefParams; // wg NULL when !gated
typedef struct { double *wq, *wk, *wv, *wo, *wg; } AttnRefGrads;        // accumulated with +=

// ---------------------------------------------------------------------------------------------------------------
// Mask

// 1 iff key position s is visible from query position p under window w (0 = full causal).
static inline int attn_visible(int p, int s, int window) {
    int lag = p - s;
    return lag >= 0 && (window == 0 || lag < window);
}

// The first key position visible from query p (the last is p itself).
static inline int attn_first_key(int p, int window) { return window == 0 ? 0 : SDM_MAX(0, p - window + 1); }

// ---------------------------------------------------------------------------------------------------------------
// RoPE. The angle is computed in fp32 as the model does (fp32 inverse frequency times fp32 position, one rounded
// product), so the GPU, which computes the same two fp32 numbers, rotates by exactly the same angle.

// fp32 inverse frequency of pair m: theta^(-2m/d_h), rounded once to float. Shared by the GPU code (host side).
static inline float attn_rope_inv_freq(int m, int head_dim, double theta) {
    return (float)(1.0 / pow(theta, (double)(2 * m) / (double)head_dim));
}

// The fp32 rotation angle of pair m at position pos.
static inline float attn_rope_angle(int pos, int m, int head_dim, double theta) {
    return (float)pos * attn_rope_inv_freq(m, head_dim, theta);
}

// In place on x [B,T,n,d_h]: rotate each pair (2m, 2m+1) of row t by +angle (direction = 1, the forward) or by
// -angle (direction = -1: the transpose of the rotation, which is the backward of the forward).
static inline void attn_rope_ref(double *x, int B, int T, int n, int head_dim, double theta, int direction) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int m = 0; m < head_dim / 2; m++) {
                double ang = (double)attn_rope_angle(t, m, head_dim, theta);
                double c = cos(ang), s = direction * sin(ang);
                for (int h = 0; h < n; h++) {
                    double *pair = x + (((size_t)b * T + t) * n + h) * head_dim + 2 * m;
                    double x0 = pair[0], x1 = pair[1];
                    pair[0] = x0 * c - x1 * s;
                    pair[1] = x0 * s + x1 * c;
                }
            }
}

// ---------------------------------------------------------------------------------------------------------------
// Attention core on q, k, v after RoPE. Uses a->n_heads, a->n_kv_heads, a->head_dim, a->window.
// q, o, dq, dout: [B,T,n_h,d_h]; k, v, dk, dv: [B,T,n_kv,d_h]; lse: [B,n_h,T].

typedef struct { const double *q, *k, *v; } AttnRefQKV;

static inline const double *attn_ref_row(const double *x, int b, int t, int h, int T, int n, int head_dim) {
    return x + (((size_t)b * T + t) * n + h) * head_dim;
}

// Probabilities of query (b, t, head j) over its visible keys s0..t: prob[s - s0]. Returns the logsumexp of the
// scaled scores. prob holds at least t - s0 + 1 entries.
static inline double attn_ref_probs(const AttnDims *a, int T, const AttnRefQKV *in, int b, int t, int j, double *prob) {
    int d = a->head_dim, g = j / (a->n_heads / a->n_kv_heads), s0 = attn_first_key(t, a->window);
    const double *qr = attn_ref_row(in->q, b, t, j, T, a->n_heads, d);
    double scale = 1.0 / sqrt((double)d), mx = -INFINITY, sum = 0.0;
    for (int s = s0; s <= t; s++) {
        prob[s - s0] = scale * ref_dot(qr, attn_ref_row(in->k, b, s, g, T, a->n_kv_heads, d), d);
        mx = fmax(mx, prob[s - s0]);
    }
    for (int s = s0; s <= t; s++) sum += exp(prob[s - s0] - mx);
    for (int s = s0; s <= t; s++) prob[s - s0] = exp(prob[s - s0] - mx) / sum;
    return mx + log(sum);
}

// One output row: orow [d_h] = attention of query (b, t, head j); returns its logsumexp. prob: scratch of T entries.
static inline double attn_core_forward_row_ref(const AttnDims *a, int T, const AttnRefQKV *in, int b, int t, int j,
                                               double *orow, double *prob) {
    int d = a->head_dim, g = j / (a->n_heads / a->n_kv_heads), s0 = attn_first_key(t, a->window);
    double l = attn_ref_probs(a, T, in, b, t, j, prob);
    for (int i = 0; i < d; i++) orow[i] = 0.0;
    for (int s = s0; s <= t; s++) {
        const double *vr = attn_ref_row(in->v, b, s, g, T, a->n_kv_heads, d);
        for (int i = 0; i < d; i++) orow[i] += prob[s - s0] * vr[i];
    }
    return l;
}

// o [B,T,n_h,d_h] = masked softmax attention; lse [B,n_h,T] (may be NULL).
static inline void attn_core_forward_ref(const AttnDims *a, int B, int T, const double *q, const double *k,
                                         const double *v, double *o, double *lse) {
    int nh = a->n_heads;
    AttnRefQKV in = {q, k, v};
    double *prob = (double *)sdm_malloc((size_t)T * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < nh; j++) {
                double l = attn_core_forward_row_ref(a, T, &in, b, t, j,
                                                     o + (((size_t)b * T + t) * nh + j) * a->head_dim, prob);
                if (lse) lse[((size_t)b * nh + j) * T + t] = l;
            }
    free(prob);
}

// Backward of the core: given dout, overwrite dq, dk, dv. With P the probabilities, dP_s = dout . v_s,
// dS_s = P_s (dP_s - sum_s' P_s' dP_s'); dq = scale sum_s dS_s k_s; dk_s += scale dS_s q; dv_s += P_s dout.
// GQA: dk, dv of a kv head sum over its query heads.
static inline void attn_core_backward_ref(const AttnDims *a, int B, int T, const double *q, const double *k,
                                          const double *v, const double *dout, double *dq, double *dk, double *dv) {
    int d = a->head_dim, nh = a->n_heads, nkv = a->n_kv_heads;
    double scale = 1.0 / sqrt((double)d);
    AttnRefQKV in = {q, k, v};
    double *prob = (double *)sdm_malloc((size_t)T * sizeof(double));
    double *dp = (double *)sdm_malloc((size_t)T * sizeof(double));
    memset(dq, 0, (size_t)B * T * nh * d * sizeof(double));
    memset(dk, 0, (size_t)B * T * nkv * d * sizeof(double));
    memset(dv, 0, (size_t)B * T * nkv * d * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < nh; j++) {
                int g = j / (nh / nkv), s0 = attn_first_key(t, a->window);
                const double *qr = attn_ref_row(q, b, t, j, T, nh, d);
                const double *dor = attn_ref_row(dout, b, t, j, T, nh, d);
                double *dqr = dq + (((size_t)b * T + t) * nh + j) * d;
                attn_ref_probs(a, T, &in, b, t, j, prob);
                double pdp = 0.0; // sum_s P_s dP_s = dout . o
                for (int s = s0; s <= t; s++) {
                    dp[s - s0] = ref_dot(dor, attn_ref_row(v, b, s, g, T, nkv, d), d);
                    pdp += prob[s - s0] * dp[s - s0];
                }
                for (int s = s0; s <= t; s++) {
                    double ds = prob[s - s0] * (dp[s - s0] - pdp);
                    const double *kr = attn_ref_row(k, b, s, g, T, nkv, d);
                    double *dkr = dk + (((size_t)b * T + s) * nkv + g) * d;
                    double *dvr = dv + (((size_t)b * T + s) * nkv + g) * d;
                    for (int i = 0; i < d; i++) {
                        dqr[i] += scale * ds * kr[i];
                        dkr[i] += scale * ds * qr[i];
                        dvr[i] += prob[s - s0] * dor[i];
                    }
                }
            }
    free(prob);
    free(dp);
}

// ---------------------------------------------------------------------------------------------------------------
// The full layer

// Everything the layer's forward computes, kept for the backward.
typedef struct {
    double *q, *k, *v; // after RoPE: [B,T,n_h,d_h], [B,T,n_kv,d_h] x2
    double *o;         // attention output before the gate [B,T,n_h,d_h]
    double *z;         // gate logits Wg x [B,T,n_h*d_h] (gated only)
    double *og;        // gated output, the input of Wo [B,T,n_h*d_h]
} AttnRefActs;

static inline AttnRefActs attn_ref_acts_alloc(const AttnDims *a, int B, int T) {
    size_t nq = (size_t)B * T * a->n_heads * a->head_dim, nk = (size_t)B * T * a->n_kv_heads * a->head_dim;
    AttnRefActs s;
    s.q = (double *)sdm_malloc(nq * sizeof(double));
    s.k = (double *)sdm_malloc(nk * sizeof(double));
    s.v = (double *)sdm_malloc(nk * sizeof(double));
    s.o = (double *)sdm_malloc(nq * sizeof(double));
    s.z = (double *)sdm_malloc(nq * sizeof(double));
    s.og = (double *)sdm_malloc(nq * sizeof(double));
    return s;
}

static inline void attn_ref_acts_free(AttnRefActs *s) {
    free(s->q); free(s->k); free(s->v); free(s->o); free(s->z); free(s->og);
}

static inline void attn_ref_layer_acts(const AttnDims *a, int B, int T, const AttnRefParams *p, const double *x,
                                       AttnRefActs *s) {
    int N = B * T, D = a->dim, nq = a->n_heads * a->head_dim, nk = a->n_kv_heads * a->head_dim;
    ref_linear_forward(x, p->wq, NULL, s->q, N, D, nq);
    ref_linear_forward(x, p->wk, NULL, s->k, N, D, nk);
    ref_linear_forward(x, p->wv, NULL, s->v, N, D, nk);
    attn_rope_ref(s->q, B, T, a->n_heads, a->head_dim, a->rope_theta, 1);
    attn_rope_ref(s->k, B, T, a->n_kv_heads, a->head_dim, a->rope_theta, 1);
    attn_core_forward_ref(a, B, T, s->q, s->k, s->v, s->o, NULL);
    if (a->gated) {
        ref_linear_forward(x, p->wg, NULL, s->z, N, D, nq);
        for (size_t i = 0; i < (size_t)N * nq; i++) s->og[i] = ref_sigmoid(s->z[i]) * s->o[i];
    } else {
        memcpy(s->og, s->o, (size_t)N * nq * sizeof(double));
    }
}

// y [B,T,D] = the layer applied to x [B,T,D].
static inline void attn_layer_forward_ref(const AttnDims *a, int B, int T, const AttnRefParams *p, const double *x,
                                          double *y) {
    AttnRefActs s = attn_ref_acts_alloc(a, B, T);
    attn_ref_layer_acts(a, B, T, p, x, &s);
    ref_linear_forward(s.og, p->wo, NULL, y, B * T, a->n_heads * a->head_dim, a->dim);
    attn_ref_acts_free(&s);
}

// Given dy [B,T,D]: overwrite dx [B,T,D] and accumulate the weight gradients into g (+=). Recomputes the forward.
static inline void attn_layer_backward_ref(const AttnDims *a, int B, int T, const AttnRefParams *p, const double *x,
                                           const double *dy, double *dx, AttnRefGrads *g) {
    int N = B * T, D = a->dim, nq = a->n_heads * a->head_dim, nk = a->n_kv_heads * a->head_dim;
    size_t nqe = (size_t)N * nq, nke = (size_t)N * nk;
    AttnRefActs s = attn_ref_acts_alloc(a, B, T);
    attn_ref_layer_acts(a, B, T, p, x, &s);
    double *dog = (double *)sdm_calloc(nqe, sizeof(double)); // d og
    double *dq = (double *)sdm_malloc(nqe * sizeof(double));
    double *dk = (double *)sdm_malloc(nke * sizeof(double));
    double *dv = (double *)sdm_malloc(nke * sizeof(double));
    memset(dx, 0, (size_t)N * D * sizeof(double));

    ref_linear_backward(s.og, p->wo, dy, dog, g->wo, NULL, N, nq, D);
    if (a->gated) { // og = sigmoid(z) o: do = sigmoid(z) dog (in place), dz = dog o sigmoid'(z) (into s.z)
        for (size_t i = 0; i < nqe; i++) {
            double sg = ref_sigmoid(s.z[i]);
            s.z[i] = dog[i] * s.o[i] * sg * (1.0 - sg);
            dog[i] *= sg;
        }
        ref_linear_backward(x, p->wg, s.z, dx, g->wg, NULL, N, D, nq);
    }
    attn_core_backward_ref(a, B, T, s.q, s.k, s.v, dog, dq, dk, dv);
    attn_rope_ref(dq, B, T, a->n_heads, a->head_dim, a->rope_theta, -1);
    attn_rope_ref(dk, B, T, a->n_kv_heads, a->head_dim, a->rope_theta, -1);
    ref_linear_backward(x, p->wq, dq, dx, g->wq, NULL, N, D, nq);
    ref_linear_backward(x, p->wk, dk, dx, g->wk, NULL, N, D, nk);
    ref_linear_backward(x, p->wv, dv, dx, g->wv, NULL, N, D, nk);

    free(dog); free(dq); free(dk); free(dv);
    attn_ref_acts_free(&s);
}

#endif
