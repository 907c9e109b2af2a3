// sdm/sdm_ref.h: the double-precision CPU reference of the SDM layer, the ground truth of sdm.c.
// Part 1, the memory op: the exact per-token recurrence of docs/SDM.md#the-recurrence and its reverse-mode backward.
// Part 2, the rest of the layer (docs/SDM.md#layer-overview): gates, product-key top-k, weight activations, readout,
// and the whole layer forward/backward with its intermediate stages exposed for stage-by-stage comparison.
//
// Layout (shared with the GPU): tokens [B, T], heads H; per-token per-head arrays are token-major:
//   wslot, kappa, gamma [B,T,H,W]  (slot index in 0..N-1 of head h, sorted ascending per (b,t,h))
//   beta [B,T,H];  v, out [B,T,H,d];  rslot, rho [B,T,H,R];  bank [B,H,N,d] (stream bh = b*H+h owns rows bh*N..)
#ifndef SDM_SDM_REF_H
#define SDM_SDM_REF_H

#include <math.h>

#include "core/common.h"
#include "core/rng.h"
#include "core/ref_ops.h"
#include "sdm/sdm_dims.h"
#include "sdm/sdm_params.h"

// Offset of the (b, t, h) entry of a token-major [B,T,H,width] array.
static inline size_t sdm_tok_off(int T, int H, int b, int t, int h, int width) {
    return ((size_t)((size_t)b * T + t) * H + h) * (size_t)width;
}

// y += a * x over n entries
static inline void sdm_axpy(double *y, double a, const double *x, int n) {
    for (int k = 0; k < n; k++) y[k] += a * x[k];
}

// One token of one (b,h) stream, steps (1)-(4) of docs/SDM.md#the-recurrence: decay the W touched rows, retrieve r from
// the decayed rows, delta = beta (v - r), write kappa_i delta into each row. M: the stream's bank [N, d]; r, delta: [d]
// outputs.
static inline void sdm_token_write(int d, int W, const int *slot, const double *kappa, const double *gamma,
                                   double beta, const double *v, double *M, double *r, double *delta) {
    for (int k = 0; k < d; k++) r[k] = 0.0;
    for (int w = 0; w < W; w++) {
        double *row = M + (size_t)slot[w] * d;
        double a = exp(gamma[w]);
        for (int k = 0; k < d; k++) row[k] *= a;          // (1) decay only the touched slots
        sdm_axpy(r, kappa[w], row, d);                     // (2) retrieval after the decay
    }
    for (int k = 0; k < d; k++) delta[k] = beta * (v[k] - r[k]); // (3) delta rule
    for (int w = 0; w < W; w++) sdm_axpy(M + (size_t)slot[w] * d, kappa[w], delta, d); // (4) write
}

// Step (5) of docs/SDM.md#the-recurrence: o = sum_j rho_j M[j], read after the token's write.
static inline void sdm_token_read(int d, int R, const int *slot, const double *rho, const double *M, double *o) {
    for (int k = 0; k < d; k++) o[k] = 0.0;
    for (int j = 0; j < R; j++) sdm_axpy(o, rho[j], M + (size_t)slot[j] * d, d);
}

// The memory op, forward (docs/SDM.md#the-recurrence). bank: in the initial bank [B,H,N,d], out the final bank. out:
// [B,T,H,d].
static inline void sdm_op_forward_ref(int B, int T, int H, int N, int d, int W, int R,
                                      const int *wslot, const double *kappa, const double *gamma,
                                      const double *beta, const double *v, const int *rslot, const double *rho,
                                      double *bank, double *out) {
    double *r = (double *)sdm_malloc(sizeof(double) * d), *delta = (double *)sdm_malloc(sizeof(double) * d);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            double *M = bank + (size_t)(b * H + h) * N * d;
            for (int t = 0; t < T; t++) {
                size_t ow = sdm_tok_off(T, H, b, t, h, W), orr = sdm_tok_off(T, H, b, t, h, R);
                size_t od = sdm_tok_off(T, H, b, t, h, d), ob = sdm_tok_off(T, H, b, t, h, 1);
                sdm_token_write(d, W, wslot + ow, kappa + ow, gamma + ow, beta[ob], v + od, M, r, delta);
                sdm_token_read(d, R, rslot + orr, rho + orr, M, out + od);
            }
        }
    free(r);
    free(delta);
}

// The memory op, backward: reverse mode through the exact per-token loop.
// The forward is recomputed per stream, saving the W rows each token is about to modify (its "snapshot");
// the reverse walk then restores the bank one token at a time. G [N,d] is dLoss/dM of the current bank state.
// dbank_final: the gradient on the final bank [B,H,N,d] or NULL (zeros). All d* outputs are overwritten.
static inline void sdm_op_backward_ref(int B, int T, int H, int N, int d, int W, int R,
                                       const int *wslot, const double *kappa, const double *gamma,
                                       const double *beta, const double *v, const int *rslot, const double *rho,
                                       const double *bank_init, const double *dout, const double *dbank_final,
                                       double *dkappa, double *dgamma, double *dbeta, double *dv, double *drho,
                                       double *dbank_init) {
    size_t nd = (size_t)N * d;
    double *M = (double *)sdm_malloc(sizeof(double) * nd);
    double *snap = (double *)sdm_malloc(sizeof(double) * (size_t)T * W * d); // [T, W, d] rows before token t
    double *decayed = (double *)sdm_malloc(sizeof(double) * (size_t)W * d);  // [W, d] rows after step (1)
    double *dDec = (double *)sdm_malloc(sizeof(double) * (size_t)W * d);     // dLoss/d decayed rows
    double *r = (double *)sdm_malloc(sizeof(double) * d), *delta = (double *)sdm_malloc(sizeof(double) * d);
    double *ddelta = (double *)sdm_malloc(sizeof(double) * d), *dr = (double *)sdm_malloc(sizeof(double) * d);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            size_t bh = (size_t)(b * H + h);
            double *G = dbank_init + bh * nd;
            memcpy(M, bank_init + bh * nd, sizeof(double) * nd);
            for (int t = 0; t < T; t++) { // forward recompute, snapshotting the rows token t modifies
                size_t ow = sdm_tok_off(T, H, b, t, h, W), od = sdm_tok_off(T, H, b, t, h, d);
                for (int w = 0; w < W; w++)
                    memcpy(snap + ((size_t)t * W + w) * d, M + (size_t)wslot[ow + w] * d, sizeof(double) * d);
                sdm_token_write(d, W, wslot + ow, kappa + ow, gamma + ow, beta[sdm_tok_off(T, H, b, t, h, 1)],
                                v + od, M, r, delta);
            }
            if (dbank_final) memcpy(G, dbank_final + bh * nd, sizeof(double) * nd);
            else memset(G, 0, sizeof(double) * nd);
            for (int t = T - 1; t >= 0; t--) {
                size_t ow = sdm_tok_off(T, H, b, t, h, W), orr = sdm_tok_off(T, H, b, t, h, R);
                size_t od = sdm_tok_off(T, H, b, t, h, d), ob = sdm_tok_off(T, H, b, t, h, 1);
                const int *ks = wslot + ow, *qs = rslot + orr;
                const double *kap = kappa + ow, *gam = gamma + ow, *dO = dout + od;
                // (5) o = sum_j rho_j M[j] with M the state after token t
                for (int j = 0; j < R; j++) {
                    drho[orr + j] = ref_dot(dO, M + (size_t)qs[j] * d, d);
                    sdm_axpy(G + (size_t)qs[j] * d, rho[orr + j], dO, d);
                }
                // recompute token t's forward quantities from its snapshot
                for (int k = 0; k < d; k++) r[k] = 0.0;
                for (int w = 0; w < W; w++) {
                    double a = exp(gam[w]);
                    for (int k = 0; k < d; k++) decayed[(size_t)w * d + k] = a * snap[((size_t)t * W + w) * d + k];
                    sdm_axpy(r, kap[w], decayed + (size_t)w * d, d);
                }
                for (int k = 0; k < d; k++) delta[k] = beta[ob] * (v[od + k] - r[k]);
                // (4) M[i] = decayed_i + kappa_i delta
                for (int k = 0; k < d; k++) ddelta[k] = 0.0;
                for (int w = 0; w < W; w++) {
                    const double *Gi = G + (size_t)ks[w] * d;
                    dkappa[ow + w] = ref_dot(Gi, delta, d);
                    sdm_axpy(ddelta, kap[w], Gi, d);
                    memcpy(dDec + (size_t)w * d, Gi, sizeof(double) * d);
                }
                // (3) delta = beta (v - r)
                dbeta[ob] = 0.0;
                for (int k = 0; k < d; k++) {
                    dbeta[ob] += ddelta[k] * (v[od + k] - r[k]);
                    dv[od + k] = beta[ob] * ddelta[k];
                    dr[k] = -beta[ob] * ddelta[k];
                }
                // (2) r = sum_i kappa_i decayed_i
                for (int w = 0; w < W; w++) {
                    dkappa[ow + w] += ref_dot(dr, decayed + (size_t)w * d, d);
                    sdm_axpy(dDec + (size_t)w * d, kap[w], dr, d);
                }
                // (1) decayed_i = exp(gamma_i) M_prev[i]; restore M[i] = M_prev[i]
                for (int w = 0; w < W; w++) {
                    double a = exp(gam[w]);
                    double *Gi = G + (size_t)ks[w] * d;
                    dgamma[ow + w] = ref_dot(dDec + (size_t)w * d, decayed + (size_t)w * d, d);
                    for (int k = 0; k < d; k++) Gi[k] = a * dDec[(size_t)w * d + k];
                    memcpy(M + (size_t)ks[w] * d, snap + ((size_t)t * W + w) * d, sizeof(double) * d);
                }
            }
        }
    free(M); free(snap); free(decayed); free(dDec); free(r); free(delta); free(ddelta); free(dr);
}

// =================================================================================================================
// Part 2: the rest of the layer.

// ---- scalar functions --------------------------------------------------------------------------------------------

// ---- gates (docs/SDM.md#gates) -----------------------------------------------------------------------------------

// g = -exp(A_log) softplus(a + dt_bias) <= 0, the head's log-decay of one token
static inline double sdm_gate_decay(double a, double A_log, double dt_bias) {
    return -exp(A_log) * ref_softplus(a + dt_bias);
}

// Gradients of g for upstream dg: dA_log += dg g, and the returned da (= d dt_bias).
static inline double sdm_gate_decay_backward(double a, double A_log, double dt_bias, double dg, double *dA_log) {
    *dA_log += dg * sdm_gate_decay(a, A_log, dt_bias);
    return -dg * exp(A_log) * ref_sigmoid(a + dt_bias);
}

// ---- product-key top-k (docs/SDM.md#tie-rule) --------------------------------------------------------------------
// Selection order (a total order on slots): larger float32 score first, score formed in float32 left to right
// ((float)s_1 + (float)s_2) + (float)s_3 ...; among equal float32 scores the larger sum of sub-key indices, then the
// larger slot index (= the larger first-factor index, then the larger second-factor index, ...: the slot index is the
// mixed-radix number with the first factor most significant, so comparing it compares the digits in that order).
// Algorithm: per factor, sort its sub-keys by that order (score, then index) and keep the first min(k, n_f) plus every
// further entry whose float32 score equals the last kept one's (docs/SDM.md#tie-rule); then merge factors left to
// right, forming every sum of a kept partial tuple and a kept sub-key, and keep the best k after each merge. This
// equals the brute-force top-k over all N slots except when float32 rounding makes the sums of distinct sub-key scores
// equal (then a dropped candidate may win the index tie-break); a GPU kernel that follows this algorithm matches it in
// every case.

typedef struct {
    float score;   // float32 partial slot score over the factors merged so far
    int digit_sum; // sum of the sub-key indices so far
    int index;     // mixed-radix partial slot index so far
} SdmPkCand;

// 1 when a ranks strictly before b in the selection order
static inline int sdm_pk_before(const SdmPkCand *a, const SdmPkCand *b) {
    if (a->score != b->score) return a->score > b->score;
    if (a->digit_sum != b->digit_sum) return a->digit_sum > b->digit_sum;
    return a->index > b->index;
}

static inline int sdm_pk_cmp(const void *pa, const void *pb) {
    const SdmPkCand *a = (const SdmPkCand *)pa, *b = (const SdmPkCand *)pb;
    return sdm_pk_before(a, b) ? -1 : sdm_pk_before(b, a) ? 1 : 0;
}

// Factor f's kept sub-keys: scores s[n], sorted by the selection order; returns their count (>= min(k, n)).
static inline int sdm_pk_factor_list(const double *s, int n, int k, SdmPkCand *out /*[n]*/) {
    for (int i = 0; i < n; i++) {
        out[i].score = (float)s[i];
        out[i].digit_sum = i;
        out[i].index = i;
    }
    qsort(out, (size_t)n, sizeof(SdmPkCand), sdm_pk_cmp);
    int m = SDM_MIN(k, n);
    while (m < n && out[m].score == out[m - 1].score) m++; // keep every entry tied with the last kept one
    return m;
}

// The decomposition of a slot into its F sub-key indices (first factor most significant).
static inline void sdm_pk_digits(int F, const int *dims, int slot, int *digit) {
    for (int f = F - 1; f >= 0; f--) {
        digit[f] = slot % dims[f];
        slot /= dims[f];
    }
}

static inline int sdm_int_cmp(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

// Top-k slots of one token and head. scores: [sum n_f], factor f's block after factor f-1's. Output: slot[k] in
// ascending order and score[k] = sum_f s_f[i_f] in double (left to right), the raw scores the activation uses.
static inline void sdm_pk_topk_ref(int F, const int *dims, int k, const double *scores, int *slot, double *score) {
    int max_n = 1, N = 1;
    for (int f = 0; f < F; f++) { max_n = SDM_MAX(max_n, dims[f]); N *= dims[f]; }
    if (F < 1 || F > SDM_MAX_FACTORS || k < 1 || k > N) sdm_die("product-key top-k: F = %d, k = %d, N = %d", F, k, N);
    SdmPkCand *fac = (SdmPkCand *)sdm_malloc(sizeof(SdmPkCand) * max_n);
    SdmPkCand *cur = (SdmPkCand *)sdm_malloc(sizeof(SdmPkCand) * max_n);
    int ncur = sdm_pk_factor_list(scores, dims[0], k, cur), off = dims[0];
    for (int f = 1; f < F; off += dims[f], f++) {
        int nf = sdm_pk_factor_list(scores + off, dims[f], k, fac);
        SdmPkCand *next = (SdmPkCand *)sdm_malloc(sizeof(SdmPkCand) * (size_t)ncur * nf);
        for (int p = 0; p < ncur; p++)
            for (int q = 0; q < nf; q++) {
                SdmPkCand *c = next + (size_t)p * nf + q;
                c->score = cur[p].score + fac[q].score; // float32 addition, left to right over factors
                c->digit_sum = cur[p].digit_sum + fac[q].index;
                c->index = cur[p].index * dims[f] + fac[q].index;
            }
        qsort(next, (size_t)ncur * nf, sizeof(SdmPkCand), sdm_pk_cmp);
        free(cur);
        cur = next;
        ncur = SDM_MIN(k, ncur * nf);
    }
    for (int j = 0; j < k; j++) slot[j] = cur[j].index; // cur is in selection order
    qsort(slot, (size_t)k, sizeof(int), sdm_int_cmp);
    int digit[SDM_MAX_FACTORS];
    for (int j = 0; j < k; j++) {
        sdm_pk_digits(F, dims, slot[j], digit);
        double e = 0.0;
        for (int f = 0, o = 0; f < F; o += dims[f], f++) e += scores[o + digit[f]];
        score[j] = e;
    }
    free(fac);
    free(cur);
}

// Gradient routing (docs/SDM.md#product-key-addressing): dscores[sum n_f] += the gradient of each selected score at its
// F sub-key entries.
static inline void sdm_pk_topk_backward_ref(int F, const int *dims, int k, const int *slot, const double *dscore,
                                            double *dscores) {
    int digit[SDM_MAX_FACTORS];
    for (int j = 0; j < k; j++) {
        sdm_pk_digits(F, dims, slot[j], digit);
        for (int f = 0, o = 0; f < F; o += dims[f], f++) dscores[o + digit[f]] += dscore[j];
    }
}

// ---- weight activations (docs/SDM.md#weight-activations) ---------------------------------------------------------

#define SDM_L2_EPS 1e-12

// w[k] = act(e[k]) over the k selected scores of one token and head; scale is the softmax temperature multiplier.
static inline void sdm_act_forward_ref(SdmAct act, double scale, int k, const double *e, double *w) {
    if (act == SDM_ACT_SOFTMAX) {
        double mx = e[0], sum = 0.0;
        for (int i = 1; i < k; i++) mx = SDM_MAX(mx, e[i]);
        for (int i = 0; i < k; i++) sum += (w[i] = exp(scale * (e[i] - mx)));
        for (int i = 0; i < k; i++) w[i] /= sum;
    } else if (act == SDM_ACT_L2_NORMALIZE) {
        double den = sqrt(ref_dot(e, e, k)) + SDM_L2_EPS;
        for (int i = 0; i < k; i++) w[i] = e[i] / den;
    } else if (act == SDM_ACT_IDENTITY) {
        for (int i = 0; i < k; i++) w[i] = e[i];
    } else {
        for (int i = 0; i < k; i++) w[i] = ref_sigmoid(e[i]);
    }
}

// de[k] = the gradient of the scores e given w = act(e) and the weight gradient dw (overwrites de).
static inline void sdm_act_backward_ref(SdmAct act, double scale, int k, const double *e, const double *w,
                                        const double *dw, double *de) {
    if (act == SDM_ACT_SOFTMAX) {
        double wdw = ref_dot(w, dw, k);
        for (int i = 0; i < k; i++) de[i] = scale * w[i] * (dw[i] - wdw);
    } else if (act == SDM_ACT_L2_NORMALIZE) {
        double norm = sqrt(ref_dot(e, e, k)), den = norm + SDM_L2_EPS;
        double proj = norm > 0.0 ? ref_dot(e, dw, k) / (den * den * norm) : 0.0;
        for (int i = 0; i < k; i++) de[i] = dw[i] / den - e[i] * proj;
    } else if (act == SDM_ACT_IDENTITY) {
        for (int i = 0; i < k; i++) de[i] = dw[i];
    } else {
        for (int i = 0; i < k; i++) de[i] = dw[i] * w[i] * (1.0 - w[i]);
    }
}

// ---- affine maps and the readings LayerNorm ----------------------------------------------------------------------

// y[d] = (x - mean) rstd w + b with rstd = 1/sqrt(var + eps) (biased variance); returns mean and rstd.
static inline void sdm_layernorm_ref(int d, double eps, const double *x, const double *w, const double *b, double *y,
                                     double *mean, double *rstd) {
    double mu = 0.0, var = 0.0;
    for (int k = 0; k < d; k++) mu += x[k];
    mu /= d;
    for (int k = 0; k < d; k++) var += (x[k] - mu) * (x[k] - mu);
    double rs = 1.0 / sqrt(var / d + eps);
    for (int k = 0; k < d; k++) y[k] = (x[k] - mu) * rs * w[k] + b[k];
    *mean = mu;
    *rstd = rs;
}

// dx[d] = the input gradient (overwritten); dw[d], db[d] accumulate.
static inline void sdm_layernorm_backward_ref(int d, const double *x, const double *w, double mean, double rstd,
                                              const double *dy, double *dx, double *dw, double *db) {
    double mean_g = 0.0, mean_gx = 0.0;
    for (int k = 0; k < d; k++) {
        double xhat = (x[k] - mean) * rstd, g = dy[k] * w[k];
        mean_g += g;
        mean_gx += g * xhat;
        dw[k] += dy[k] * xhat;
        db[k] += dy[k];
    }
    mean_g /= d;
    mean_gx /= d;
    for (int k = 0; k < d; k++) dx[k] = rstd * (dy[k] * w[k] - mean_g - (x[k] - mean) * rstd * mean_gx);
}

// ---- the layer (docs/SDM.md#layer-overview) ----------------------------------------------------------------------

#define SDM_REF_PARAM(name, ...) const double *name;
#define SDM_REF_GRAD(name, ...) double *name;
typedef struct { SDM_PARAMS(SDM_REF_PARAM) } SdmRefParams;
typedef struct { SDM_PARAMS(SDM_REF_GRAD) } SdmRefGrads; // accumulated with +=
#undef SDM_REF_PARAM
#undef SDM_REF_GRAD
// The tensors of sdm/sdm_params.h: wk, wq [H*K, D]; bk, bq [H*K]; wv [D, D]; bv [D]; wa, wb [H, D]; ba, bb [H];
// wg [D, D], bg [D] (NULL unless output_gate); A_log, dt_bias [H]; ln_w, ln_b [d] (NULL unless normalize_readings);
// wo [D, D]; bo [D]; bank [H*N, d] (NULL unless learned_bank). (out, in) row-major: zK[b,t,:] = wk . x[b,t,:] + bk.

// Structs from an array of SDM_P_COUNT tensors in list order (absent ones NULL).
static inline SdmRefParams sdm_ref_params_from(double *const *t) {
    SdmRefParams p;
#define SDM_REF_FROM(name, ...) p.name = t[SDM_P_##name];
    SDM_PARAMS(SDM_REF_FROM)
    return p;
}

static inline SdmRefGrads sdm_ref_grads_from(double *const *t) {
    SdmRefGrads p;
    SDM_PARAMS(SDM_REF_FROM)
#undef SDM_REF_FROM
    return p;
}

// Every intermediate of one layer forward, for the backward and for stage-by-stage comparison with the GPU.
// Token-major like the op; "n" below is B*T tokens.
typedef struct {
    int B, T;
    double *zK, *zQ;                   // [n, H*K] write / read sub-key scores
    double *v;                         // [n, D] = [n, H, d]
    double *a, *c;                     // [n, H] decay and write-strength pre-activations
    double *zG;                        // [n, D] output-gate pre-activation (output_gate only, else NULL)
    double *g, *beta;                  // [n, H] log-decay g <= 0 and write strength
    int *wslot;                        // [n, H, W] selected write slots, ascending
    double *wscore, *kappa, *gamma;    // [n, H, W] raw scores, write weights, per-entry log-decays
    int *rslot;                        // [n, H, R]
    double *rscore, *rho;              // [n, H, R]
    double *bank_init, *bank_final;    // [B, H, N, d]
    double *o;                         // [n, H, d] readings of the memory op
    double *ln_mean, *ln_rstd;         // [n, H] (normalize_readings only, else NULL)
    double *rn;                        // [n, D] readings after the optional LayerNorm
    double *r;                         // [n, D] input of Wo (after the optional gate)
    double *y;                         // [n, D] layer output
} SdmRefTrace;

static inline double *sdm_ref_zeros(size_t n) { return (double *)sdm_calloc(n, sizeof(double)); }

static inline SdmRefTrace sdm_ref_trace_alloc(const SdmDims *s, int B, int T) {
    size_t n = (size_t)B * T, H = (size_t)s->heads, D = (size_t)s->dim, nb = (size_t)B * H * s->slots * s->head_dim;
    SdmRefTrace tr;
    tr.B = B; tr.T = T;
    tr.zK = sdm_ref_zeros(n * H * s->key_dim); tr.zQ = sdm_ref_zeros(n * H * s->key_dim);
    tr.v = sdm_ref_zeros(n * D);
    tr.a = sdm_ref_zeros(n * H); tr.c = sdm_ref_zeros(n * H);
    tr.zG = s->output_gate ? sdm_ref_zeros(n * D) : NULL;
    tr.g = sdm_ref_zeros(n * H); tr.beta = sdm_ref_zeros(n * H);
    tr.wslot = (int *)sdm_calloc(n * H * s->writes, sizeof(int));
    tr.wscore = sdm_ref_zeros(n * H * s->writes); tr.kappa = sdm_ref_zeros(n * H * s->writes);
    tr.gamma = sdm_ref_zeros(n * H * s->writes);
    tr.rslot = (int *)sdm_calloc(n * H * s->reads, sizeof(int));
    tr.rscore = sdm_ref_zeros(n * H * s->reads); tr.rho = sdm_ref_zeros(n * H * s->reads);
    tr.bank_init = sdm_ref_zeros(nb); tr.bank_final = sdm_ref_zeros(nb);
    tr.o = sdm_ref_zeros(n * D);
    tr.ln_mean = s->normalize_readings ? sdm_ref_zeros(n * H) : NULL;
    tr.ln_rstd = s->normalize_readings ? sdm_ref_zeros(n * H) : NULL;
    tr.rn = sdm_ref_zeros(n * D); tr.r = sdm_ref_zeros(n * D); tr.y = sdm_ref_zeros(n * D);
    return tr;
}

static inline void sdm_ref_trace_free(SdmRefTrace *tr) {
    free(tr->zK); free(tr->zQ); free(tr->v); free(tr->a); free(tr->c); free(tr->zG); free(tr->g); free(tr->beta);
    free(tr->wslot); free(tr->wscore); free(tr->kappa); free(tr->gamma); free(tr->rslot); free(tr->rscore);
    free(tr->rho); free(tr->bank_init); free(tr->bank_final); free(tr->o); free(tr->ln_mean); free(tr->ln_rstd);
    free(tr->rn); free(tr->r); free(tr->y);
}

// Die unless the layer's dimensions are consistent: D = H d, N = prod n_f, K = sum n_f, 1 <= W, R <= N.
static inline void sdm_ref_check_dims(const SdmDims *s) {
    if (s->n_factors < 1 || s->n_factors > SDM_MAX_FACTORS) sdm_die("sdm layer: %d product-key factors", s->n_factors);
    long prod = 1, sum = 0;
    for (int f = 0; f < s->n_factors; f++) { prod *= s->factor_dims[f]; sum += s->factor_dims[f]; }
    if (s->heads < 1 || s->heads * s->head_dim != s->dim)
        sdm_die("sdm layer: dim %d != heads %d x head_dim %d", s->dim, s->heads, s->head_dim);
    if (prod != s->slots || sum != s->key_dim)
        sdm_die("sdm layer: factor dims do not give N = %d, K = %d", s->slots, s->key_dim);
    if (s->writes < 1 || s->writes > s->slots || s->reads < 1 || s->reads > s->slots)
        sdm_die("sdm layer: writes %d / reads %d outside [1, N = %d]", s->writes, s->reads, s->slots);
}

// Addressing of one kind (writes or reads) for all tokens and heads: top-k of the head's score block, then the
// weight activation. z [n, H*K] -> slot, score, weight [n, H, k].
static inline void sdm_ref_address(const SdmDims *s, size_t n, int k, SdmAct act, double scale, const double *z,
                                   int *slot, double *score, double *weight) {
    for (size_t i = 0; i < n * s->heads; i++) {
        sdm_pk_topk_ref(s->n_factors, s->factor_dims, k, z + i * s->key_dim, slot + i * k, score + i * k);
        sdm_act_forward_ref(act, scale, k, score + i * k, weight + i * k);
    }
}

// The layer forward, keeping every intermediate in tr (allocated by sdm_ref_trace_alloc for the same B, T).
static inline void sdm_layer_forward_trace_ref(const SdmDims *s, int B, int T, const SdmRefParams *p,
                                               const double *x /*[B,T,D]*/, SdmRefTrace *tr) {
    int D = s->dim, H = s->heads, d = s->head_dim, N = s->slots, W = s->writes, R = s->reads;
    int n = B * T, HK = H * s->key_dim;
    sdm_ref_check_dims(s);
    if (tr->B != B || tr->T != T) sdm_die("sdm_layer_forward_trace_ref: trace allocated for another B, T");
    // projections (docs/SDM.md#projections)
    ref_linear_forward(x, p->wk, p->bk, tr->zK, n, D, HK);
    ref_linear_forward(x, p->wq, p->bq, tr->zQ, n, D, HK);
    ref_linear_forward(x, p->wv, p->bv, tr->v, n, D, D);
    ref_linear_forward(x, p->wa, p->ba, tr->a, n, D, H);
    ref_linear_forward(x, p->wb, p->bb, tr->c, n, D, H);
    if (s->output_gate) ref_linear_forward(x, p->wg, p->bg, tr->zG, n, D, D);
    // gates (docs/SDM.md#gates)
    for (int i = 0; i < n * H; i++) {
        int h = i % H;
        tr->g[i] = sdm_gate_decay(tr->a[i], p->A_log[h], p->dt_bias[h]);
        tr->beta[i] = ref_sigmoid(tr->c[i]);
    }
    // addressing and weights (docs/SDM.md#product-key-addressing, docs/SDM.md#weight-activations)
    sdm_ref_address(s, (size_t)n, W, s->write_act, s->write_scale, tr->zK, tr->wslot, tr->wscore, tr->kappa);
    sdm_ref_address(s, (size_t)n, R, s->read_act, s->read_scale, tr->zQ, tr->rslot, tr->rscore, tr->rho);
    // per-entry log-decays (docs/SDM.md#key-weighted-decay)
    for (int i = 0; i < n * H; i++)
        for (int w = 0; w < W; w++)
            tr->gamma[(size_t)i * W + w] = s->key_weighted_decay ? tr->g[i] * tr->kappa[(size_t)i * W + w] : tr->g[i];
    // the bank (docs/SDM.md#the-bank): every sequence starts from its own copy of M0 (or zeros), then the recurrence
    size_t bank_seq = (size_t)H * N * d;
    for (int b = 0; b < B; b++) {
        if (s->learned_bank) memcpy(tr->bank_init + b * bank_seq, p->bank, sizeof(double) * bank_seq);
        else memset(tr->bank_init + b * bank_seq, 0, sizeof(double) * bank_seq);
    }
    memcpy(tr->bank_final, tr->bank_init, sizeof(double) * bank_seq * B);
    sdm_op_forward_ref(B, T, H, N, d, W, R, tr->wslot, tr->kappa, tr->gamma, tr->beta, tr->v, tr->rslot, tr->rho,
                       tr->bank_final, tr->o);
    // readout (docs/SDM.md#readout)
    for (int i = 0; i < n * H; i++) {
        const double *oi = tr->o + (size_t)i * d;
        double *rni = tr->rn + (size_t)i * d;
        if (s->normalize_readings)
            sdm_layernorm_ref(d, s->norm_eps, oi, p->ln_w, p->ln_b, rni, tr->ln_mean + i, tr->ln_rstd + i);
        else memcpy(rni, oi, sizeof(double) * d);
    }
    for (size_t i = 0; i < (size_t)n * D; i++)
        tr->r[i] = s->output_gate ? ref_sigmoid(tr->zG[i]) * tr->rn[i] : tr->rn[i];
    ref_linear_forward(tr->r, p->wo, p->bo, tr->y, n, D, D);
}

static inline void sdm_layer_forward_ref(const SdmDims *s, int B, int T, const SdmRefParams *p,
                                         const double *x /*[B,T,D]*/, double *y /*[B,T,D]*/) {
    SdmRefTrace tr = sdm_ref_trace_alloc(s, B, T);
    sdm_layer_forward_trace_ref(s, B, T, p, x, &tr);
    memcpy(y, tr.y, sizeof(double) * B * T * s->dim);
    sdm_ref_trace_free(&tr);
}

// Every intermediate gradient of one layer backward, for stage-by-stage comparison with the GPU ("n" = B*T tokens).
typedef struct {
    double *dout;                       // [n, H, d] gradient of the op readings
    double *dkappa_op, *dgamma;         // [n, H, W] the op's gradients of kappa and gamma
    double *dbeta;                      // [n, H]
    double *dv;                         // [n, D]
    double *drho;                       // [n, H, R]
    double *dbank_init;                 // [B, H, N, d] gradient of each sequence's initial bank
    double *dkappa;                     // [n, H, W] total kappa gradient (with the key-weighted decay path)
    double *dg;                         // [n, H] gradient of the log-decay g
    double *dwscore, *drscore;          // [n, H, W], [n, H, R] gradients of the raw selected scores
    double *dzK, *dzQ;                  // [n, H*K] gradients of the sub-key scores
    double *da, *dc;                    // [n, H] gradients of the gate pre-activations
    double *dzG;                        // [n, D] output-gate pre-activation gradient (output_gate only, else NULL)
} SdmRefGradTrace;

static inline SdmRefGradTrace sdm_ref_grad_trace_alloc(const SdmDims *s, int B, int T) {
    size_t n = (size_t)B * T, H = (size_t)s->heads, D = (size_t)s->dim, nW = n * H * s->writes, nR = n * H * s->reads;
    SdmRefGradTrace o;
    o.dout = sdm_ref_zeros(n * D);
    o.dkappa_op = sdm_ref_zeros(nW); o.dgamma = sdm_ref_zeros(nW);
    o.dbeta = sdm_ref_zeros(n * H); o.dv = sdm_ref_zeros(n * D); o.drho = sdm_ref_zeros(nR);
    o.dbank_init = sdm_ref_zeros((size_t)B * H * s->slots * s->head_dim);
    o.dkappa = sdm_ref_zeros(nW); o.dg = sdm_ref_zeros(n * H);
    o.dwscore = sdm_ref_zeros(nW); o.drscore = sdm_ref_zeros(nR);
    o.dzK = sdm_ref_zeros(n * H * s->key_dim); o.dzQ = sdm_ref_zeros(n * H * s->key_dim);
    o.da = sdm_ref_zeros(n * H); o.dc = sdm_ref_zeros(n * H);
    o.dzG = s->output_gate ? sdm_ref_zeros(n * D) : NULL;
    return o;
}

static inline void sdm_ref_grad_trace_free(SdmRefGradTrace *o) {
    free(o->dout); free(o->dkappa_op); free(o->dgamma); free(o->dbeta); free(o->dv); free(o->drho);
    free(o->dbank_init); free(o->dkappa); free(o->dg); free(o->dwscore); free(o->drscore); free(o->dzK);
    free(o->dzQ); free(o->da); free(o->dc); free(o->dzG);
}

// Readout backward (docs/SDM.md#readout): from dy to the gradient of the op readings gt->dout [n, H, d] (and gt->dzG);
// accumulates dwo, dbo, dwg, dbg, dln_w, dln_b, and dx from the Wg branch.
static inline void sdm_ref_readout_backward(const SdmDims *s, int n, const SdmRefParams *p, const double *x,
                                            const SdmRefTrace *tr, const double *dy, double *dx, SdmRefGrads *g,
                                            SdmRefGradTrace *gt) {
    int D = s->dim, H = s->heads, d = s->head_dim;
    double *dr = sdm_ref_zeros((size_t)n * D);
    double *drn = sdm_ref_zeros((size_t)n * D);
    ref_linear_backward(tr->r, p->wo, dy, dr, g->wo, g->bo, n, D, D);
    if (s->output_gate) {
        for (size_t i = 0; i < (size_t)n * D; i++) {
            double sg = ref_sigmoid(tr->zG[i]);
            drn[i] = sg * dr[i];
            gt->dzG[i] = dr[i] * tr->rn[i] * sg * (1.0 - sg);
        }
        ref_linear_backward(x, p->wg, gt->dzG, dx, g->wg, g->bg, n, D, D);
    } else {
        memcpy(drn, dr, sizeof(double) * n * D);
    }
    for (int i = 0; i < n * H; i++) {
        size_t o = (size_t)i * d;
        if (s->normalize_readings)
            sdm_layernorm_backward_ref(d, tr->o + o, p->ln_w, tr->ln_mean[i], tr->ln_rstd[i], drn + o, gt->dout + o,
                                       g->ln_w, g->ln_b);
        else memcpy(gt->dout + o, drn + o, sizeof(double) * d);
    }
    free(dr);
    free(drn);
}

// The layer backward with every intermediate gradient kept in gt (allocated by sdm_ref_grad_trace_alloc).
// dx [B,T,D] is overwritten; parameter gradients accumulate into g.
static inline void sdm_layer_backward_trace_ref(const SdmDims *s, int B, int T, const SdmRefParams *p,
                                                const double *x, const double *dy, const SdmRefTrace *tr,
                                                double *dx, SdmRefGrads *g, SdmRefGradTrace *gt) {
    int D = s->dim, H = s->heads, d = s->head_dim, N = s->slots, W = s->writes, R = s->reads, K = s->key_dim;
    int n = B * T;
    memset(dx, 0, sizeof(double) * n * D);
    sdm_ref_readout_backward(s, n, p, x, tr, dy, dx, g, gt);
    // the memory op (docs/SDM.md#the-recurrence; no gradient on the final bank)
    sdm_op_backward_ref(B, T, H, N, d, W, R, tr->wslot, tr->kappa, tr->gamma, tr->beta, tr->v, tr->rslot, tr->rho,
                        tr->bank_init, gt->dout, NULL, gt->dkappa_op, gt->dgamma, gt->dbeta, gt->dv, gt->drho,
                        gt->dbank_init);
    if (s->learned_bank) { // dM0 = sum over the per-sequence copies (docs/SDM.md#the-bank)
        size_t bank_seq = (size_t)H * N * d;
        for (int b = 0; b < B; b++) sdm_axpy(g->bank, 1.0, gt->dbank_init + b * bank_seq, (int)bank_seq);
    }
    for (int i = 0; i < n * H; i++) {
        int h = i % H;
        size_t ow = (size_t)i * W, orr = (size_t)i * R;
        // key-weighted decay (docs/SDM.md#key-weighted-decay): gamma = g kappa, else gamma = g
        gt->dg[i] = 0.0;
        for (int w = 0; w < W; w++) {
            gt->dkappa[ow + w] = gt->dkappa_op[ow + w];
            if (s->key_weighted_decay) {
                gt->dg[i] += tr->kappa[ow + w] * gt->dgamma[ow + w];
                gt->dkappa[ow + w] += tr->g[i] * gt->dgamma[ow + w];
            } else {
                gt->dg[i] += gt->dgamma[ow + w];
            }
        }
        // activations, routing to the sub-key scores (docs/SDM.md#layer-chain-rule)
        sdm_act_backward_ref(s->write_act, s->write_scale, W, tr->wscore + ow, tr->kappa + ow, gt->dkappa + ow,
                             gt->dwscore + ow);
        sdm_pk_topk_backward_ref(s->n_factors, s->factor_dims, W, tr->wslot + ow, gt->dwscore + ow,
                                 gt->dzK + (size_t)i * K);
        sdm_act_backward_ref(s->read_act, s->read_scale, R, tr->rscore + orr, tr->rho + orr, gt->drho + orr,
                             gt->drscore + orr);
        sdm_pk_topk_backward_ref(s->n_factors, s->factor_dims, R, tr->rslot + orr, gt->drscore + orr,
                                 gt->dzQ + (size_t)i * K);
        // gates (docs/SDM.md#gates)
        gt->da[i] = sdm_gate_decay_backward(tr->a[i], p->A_log[h], p->dt_bias[h], gt->dg[i], &g->A_log[h]);
        g->dt_bias[h] += gt->da[i];
        gt->dc[i] = gt->dbeta[i] * tr->beta[i] * (1.0 - tr->beta[i]);
    }
    // projections (docs/SDM.md#projections)
    ref_linear_backward(x, p->wk, gt->dzK, dx, g->wk, g->bk, n, D, H * K);
    ref_linear_backward(x, p->wq, gt->dzQ, dx, g->wq, g->bq, n, D, H * K);
    ref_linear_backward(x, p->wv, gt->dv, dx, g->wv, g->bv, n, D, D);
    ref_linear_backward(x, p->wa, gt->da, dx, g->wa, g->ba, n, D, H);
    ref_linear_backward(x, p->wb, gt->dc, dx, g->wb, g->bb, n, D, H);
}

static inline void sdm_layer_backward_ref(const SdmDims *s, int B, int T, const SdmRefParams *p, const double *x,
                                          const double *dy, double *dx /*overwritten*/, SdmRefGrads *g) {
    SdmRefTrace tr = sdm_ref_trace_alloc(s, B, T);
    SdmRefGradTrace gt = sdm_ref_grad_trace_alloc(s, B, T);
    sdm_layer_forward_trace_ref(s, B, T, p, x, &tr);
    sdm_layer_backward_trace_ref(s, B, T, p, x, dy, &tr, dx, g, &gt);
    sdm_ref_grad_trace_free(&gt);
    sdm_ref_trace_free(&tr);
}

#endif
