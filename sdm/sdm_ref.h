// sdm/sdm_ref.h: the double-precision CPU reference of the SDM layer, the ground truth of sdm.c.
// Part 1, the memory op: the exact per-token recurrence of SDM_SPEC §2 and its reverse-mode backward.
//
// Layout (shared with the GPU): tokens [B, T], heads H; per-token per-head arrays are token-major:
//   wslot, kappa, gamma [B,T,H,W]  (slot index in 0..N-1 of head h, sorted ascending per (b,t,h))
//   beta [B,T,H];  v, out [B,T,H,d];  rslot, rho [B,T,H,R];  bank [B,H,N,d] (stream bh = b*H+h owns rows bh*N..)
#ifndef SDM_SDM_REF_H
#define SDM_SDM_REF_H

#include <math.h>

#include "core/common.h"

// Offset of the (b, t, h) entry of a token-major [B,T,H,width] array.
static inline size_t sdm_tok_off(int T, int H, int b, int t, int h, int width) {
    return ((size_t)((size_t)b * T + t) * H + h) * (size_t)width;
}

static inline double sdm_dot(const double *a, const double *b, int n) {
    double s = 0.0;
    for (int k = 0; k < n; k++) s += a[k] * b[k];
    return s;
}

// y += a * x over n entries
static inline void sdm_axpy(double *y, double a, const double *x, int n) {
    for (int k = 0; k < n; k++) y[k] += a * x[k];
}

// One token of one (b,h) stream, steps (1)-(4) of §2: decay the W touched rows, retrieve r from the decayed rows,
// delta = beta (v - r), write kappa_i delta into each row. M: the stream's bank [N, d]; r, delta: [d] outputs.
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

// Step (5) of §2: o = sum_j rho_j M[j], read after the token's write.
static inline void sdm_token_read(int d, int R, const int *slot, const double *rho, const double *M, double *o) {
    for (int k = 0; k < d; k++) o[k] = 0.0;
    for (int j = 0; j < R; j++) sdm_axpy(o, rho[j], M + (size_t)slot[j] * d, d);
}

// The memory op, forward (§2). bank: in the initial bank [B,H,N,d], out the final bank. out: [B,T,H,d].
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
                    drho[orr + j] = sdm_dot(dO, M + (size_t)qs[j] * d, d);
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
                    dkappa[ow + w] = sdm_dot(Gi, delta, d);
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
                    dkappa[ow + w] += sdm_dot(dr, decayed + (size_t)w * d, d);
                    sdm_axpy(dDec + (size_t)w * d, kap[w], dr, d);
                }
                // (1) decayed_i = exp(gamma_i) M_prev[i]; restore M[i] = M_prev[i]
                for (int w = 0; w < W; w++) {
                    double a = exp(gam[w]);
                    double *Gi = G + (size_t)ks[w] * d;
                    dgamma[ow + w] = sdm_dot(dDec + (size_t)w * d, decayed + (size_t)w * d, d);
                    for (int k = 0; k < d; k++) Gi[k] = a * dDec[(size_t)w * d + k];
                    memcpy(M + (size_t)ks[w] * d, snap + ((size_t)t * W + w) * d, sizeof(double) * d);
                }
            }
        }
    free(M); free(snap); free(decayed); free(dDec); free(r); free(delta); free(ddelta); free(dr);
}

#endif
