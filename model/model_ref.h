// model/model_ref.h: the whole hybrid model (docs/MODEL.md) in double precision on the CPU: forward to the mean
// cross-entropy and the analytic gradient of every parameter. It is the oracle of the GPU training step.
//
//   h0 = E[token];  h' = h + Mixer_l(RMSNorm_a(h));  h+ = h' + FFN(RMSNorm_b(h'));  logits = W_out . RMSNorm_f(h^L)
#ifndef SDM_MODEL_MODEL_REF_H
#define SDM_MODEL_MODEL_REF_H

#include "attention/attention_ref.h"
#include "model/model.h"
#include "core/ref_ops.h"
#include "sdm/sdm_ref.h"

// pointer to the tensor `suffix` of layer l in a flat array laid out by the parameter table (NULL if absent)
static inline double *model_ref_tensor(const ModelDesc *m, double *flat, int l, const char *suffix) {
    const ParamSpec *p = l >= 0 ? model_layer_param(m, l, suffix) : model_find(m, suffix);
    return p ? flat + p->offset : NULL;
}

static inline AttnRefGrads model_ref_attn(const ModelDesc *m, double *flat, int l) {
    AttnRefGrads a;
    a.wq = model_ref_tensor(m, flat, l, "attn.wq");
    a.wk = model_ref_tensor(m, flat, l, "attn.wk");
    a.wv = model_ref_tensor(m, flat, l, "attn.wv");
    a.wo = model_ref_tensor(m, flat, l, "attn.wo");
    a.wg = model_ref_tensor(m, flat, l, "attn.wg");
    return a;
}

// the tensors of sdm/sdm_params.h of layer l (NULL where the configuration has none)
static inline SdmRefGrads model_ref_sdm(const ModelDesc *m, double *flat, int l) {
    SdmRefGrads s;
#define MODEL_REF_SDM(name, ...) s.name = model_ref_tensor(m, flat, l, "sdm." #name);
    SDM_PARAMS(MODEL_REF_SDM)
#undef MODEL_REF_SDM
    return s;
}

// read-only views of the same pointers, as the layer forwards take them
static inline AttnRefParams model_ref_attn_params(AttnRefGrads g) {
    AttnRefParams p = {g.wq, g.wk, g.wv, g.wo, g.wg};
    return p;
}

static inline SdmRefParams model_ref_sdm_params(SdmRefGrads g) {
    SdmRefParams p;
#define MODEL_REF_SDM_PARAM(name, ...) p.name = g.name;
    SDM_PARAMS(MODEL_REF_SDM_PARAM)
#undef MODEL_REF_SDM_PARAM
    return p;
}

// y[B,T,D] = Mixer_l(x)
static inline void model_ref_mixer_forward(const ModelDesc *m, double *params, int l, int B, int T, const double *x,
                                           double *y) {
    if (m->kind[l] == LAYER_SDM) {
        SdmRefParams p = model_ref_sdm_params(model_ref_sdm(m, params, l));
        sdm_layer_forward_ref(&m->sdm, B, T, &p, x, y);
    } else {
        AttnRefParams p = model_ref_attn_params(model_ref_attn(m, params, l));
        attn_layer_forward_ref(&m->attn[l], B, T, &p, x, y);
    }
}

// dx (overwritten) and the layer's parameter gradients (+=) from dy
static inline void model_ref_mixer_backward(const ModelDesc *m, double *params, double *grads, int l, int B, int T,
                                            const double *x, const double *dy, double *dx) {
    if (m->kind[l] == LAYER_SDM) {
        SdmRefParams p = model_ref_sdm_params(model_ref_sdm(m, params, l));
        SdmRefGrads g = model_ref_sdm(m, grads, l);
        sdm_layer_backward_ref(&m->sdm, B, T, &p, x, dy, dx, &g);
    } else {
        AttnRefParams p = model_ref_attn_params(model_ref_attn(m, params, l));
        AttnRefGrads g = model_ref_attn(m, grads, l);
        attn_layer_backward_ref(&m->attn[l], B, T, &p, x, dy, dx, &g);
    }
}

// Activations of one forward pass: the residual stream entering each block (h) and after its mixer (h').
typedef struct {
    int B, T;
    double *h;     // [L+1, B*T, D]: h[l] enters block l, h[L] leaves the last block
    double *hmid;  // [L, B*T, D]
    double *final; // [B*T, D] RMSNorm_f(h[L])
    double *logits;// [B*T, V]
} ModelRefActs;

static inline const double *model_ref_lm_head(const ModelDesc *m, double *params) {
    return model_ref_tensor(m, params, -1, m->tied ? "tok_emb" : "lm_head");
}

// Forward over tokens/targets [B, T]; returns the mean cross-entropy and fills acts.
static inline double model_ref_forward(const ModelDesc *m, double *params, const int *tokens, const int *targets,
                                       int B, int T, ModelRefActs *acts) {
    int n = B * T, D = m->dim, F = m->ffn_hidden, L = m->n_layers;
    size_t nd = (size_t)n * D;
    acts->B = B;
    acts->T = T;
    acts->h = (double *)sdm_malloc(sizeof(double) * nd * (L + 1));
    acts->hmid = (double *)sdm_malloc(sizeof(double) * nd * L);
    acts->final = (double *)sdm_malloc(sizeof(double) * nd);
    acts->logits = (double *)sdm_malloc(sizeof(double) * (size_t)n * m->vocab);
    double *normed = (double *)sdm_malloc(sizeof(double) * nd), *out = (double *)sdm_malloc(sizeof(double) * nd);

    const double *emb = model_ref_tensor(m, params, -1, "tok_emb");
    for (int i = 0; i < n; i++) memcpy(acts->h + (size_t)i * D, emb + (size_t)tokens[i] * D, sizeof(double) * D);
    for (int l = 0; l < L; l++) {
        double *h = acts->h + nd * l, *hmid = acts->hmid + nd * l, *next = acts->h + nd * (l + 1);
        ref_rmsnorm_forward(h, model_ref_tensor(m, params, l, "mixer_norm"), normed, n, D, m->norm_eps);
        model_ref_mixer_forward(m, params, l, B, T, normed, out);
        for (size_t i = 0; i < nd; i++) hmid[i] = h[i] + out[i];
        ref_rmsnorm_forward(hmid, model_ref_tensor(m, params, l, "ffn_norm"), normed, n, D, m->norm_eps);
        ref_swiglu_forward(normed, model_ref_tensor(m, params, l, "ffn.w1"), model_ref_tensor(m, params, l, "ffn.w3"),
                           model_ref_tensor(m, params, l, "ffn.w2"), out, n, D, F);
        for (size_t i = 0; i < nd; i++) next[i] = hmid[i] + out[i];
    }
    ref_rmsnorm_forward(acts->h + nd * L, model_ref_tensor(m, params, -1, "norm"), acts->final, n, D, m->norm_eps);
    ref_linear_forward(acts->final, model_ref_lm_head(m, params), NULL, acts->logits, n, D, m->vocab);
    free(normed);
    free(out);
    return ref_cross_entropy(acts->logits, targets, NULL, n, m->vocab);
}

static inline void model_ref_acts_free(ModelRefActs *a) {
    free(a->h);
    free(a->hmid);
    free(a->final);
    free(a->logits);
}

// Loss and the gradient of every parameter (grads: the flat layout [m->storage], overwritten).
static inline double model_ref_backward(const ModelDesc *m, double *params, const int *tokens, const int *targets,
                                        int B, int T, double *grads) {
    int n = B * T, D = m->dim, F = m->ffn_hidden, L = m->n_layers;
    size_t nd = (size_t)n * D;
    ModelRefActs acts;
    double loss = model_ref_forward(m, params, tokens, targets, B, T, &acts);
    memset(grads, 0, sizeof(double) * m->storage);
    double *dlogits = (double *)sdm_calloc((size_t)n * m->vocab, sizeof(double));
    double *dh = (double *)sdm_calloc(nd, sizeof(double));     // gradient of the residual stream
    double *dfinal = (double *)sdm_calloc(nd, sizeof(double));
    double *normed = (double *)sdm_malloc(sizeof(double) * nd), *dnormed = (double *)sdm_malloc(sizeof(double) * nd);

    ref_cross_entropy(acts.logits, targets, dlogits, n, m->vocab);
    double *dhead = model_ref_tensor(m, grads, -1, m->tied ? "tok_emb" : "lm_head");
    ref_linear_backward(acts.final, model_ref_lm_head(m, params), dlogits, dfinal, dhead, NULL, n, D, m->vocab);
    ref_rmsnorm_backward(acts.h + nd * L, model_ref_tensor(m, params, -1, "norm"), dfinal, dh,
                         model_ref_tensor(m, grads, -1, "norm"), n, D, m->norm_eps);
    for (int l = L - 1; l >= 0; l--) {
        const double *h = acts.h + nd * l, *hmid = acts.hmid + nd * l;
        // FFN branch: dh holds d(h+), which is also the residual part of d(h')
        const double *wn = model_ref_tensor(m, params, l, "ffn_norm");
        ref_rmsnorm_forward(hmid, wn, normed, n, D, m->norm_eps);
        memset(dnormed, 0, sizeof(double) * nd);
        ref_swiglu_backward(normed, model_ref_tensor(m, params, l, "ffn.w1"), model_ref_tensor(m, params, l, "ffn.w3"),
                            model_ref_tensor(m, params, l, "ffn.w2"), dh, dnormed,
                            model_ref_tensor(m, grads, l, "ffn.w1"), model_ref_tensor(m, grads, l, "ffn.w3"),
                            model_ref_tensor(m, grads, l, "ffn.w2"), n, D, F);
        ref_rmsnorm_backward(hmid, wn, dnormed, dh, model_ref_tensor(m, grads, l, "ffn_norm"), n, D, m->norm_eps);
        // mixer branch: dh now holds d(h'), also the residual part of d(h)
        const double *wm = model_ref_tensor(m, params, l, "mixer_norm");
        ref_rmsnorm_forward(h, wm, normed, n, D, m->norm_eps);
        model_ref_mixer_backward(m, params, grads, l, B, T, normed, dh, dnormed);
        ref_rmsnorm_backward(h, wm, dnormed, dh, model_ref_tensor(m, grads, l, "mixer_norm"), n, D, m->norm_eps);
    }
    double *demb = model_ref_tensor(m, grads, -1, "tok_emb");
    for (int i = 0; i < n; i++)
        for (int k = 0; k < D; k++) demb[(size_t)tokens[i] * D + k] += dh[(size_t)i * D + k];

    model_ref_acts_free(&acts);
    free(dlogits);
    free(dh);
    free(dfinal);
    free(normed);
    free(dnormed);
    return loss;
}

// Initialise a flat double parameter array with the model's init rules (docs/MODEL.md#initialisation).
static inline void model_ref_init(const ModelDesc *m, unsigned long long seed, double *params) {
    memset(params, 0, sizeof(double) * m->storage); // the alignment gaps
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        float *v = (float *)sdm_malloc(sizeof(float) * p->numel);
        model_init_tensor(m, i, seed, v);
        for (long long k = 0; k < p->numel; k++) params[p->offset + k] = v[k];
        free(v);
    }
}

#endif
