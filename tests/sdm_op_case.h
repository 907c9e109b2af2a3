// tests/sdm_op_case.h: random inputs of the SDM memory op for the CPU tests (test_sdm_ref, test_sdm_chunked):
// sorted distinct slot lists over small banks (so tokens share slots), positive weights, log-decays <= 0.
#ifndef SDM_TESTS_SDM_OP_CASE_H
#define SDM_TESTS_SDM_OP_CASE_H

#include "core/rng.h"
#include "tests/rand_slots.h"
#include "sdm/sdm_ref.h"

static inline double *rand_array(Rng *rng, size_t n, double lo, double hi) {
    double *a = (double *)sdm_malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) a[i] = rng_range(rng, lo, hi);
    return a;
}

static inline double dot_all(const double *a, const double *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

// ---------------------------------------------------------------------------------------------------------------
// the memory op

typedef struct {
    int B, T, H, N, d, W, R;
    int *wslot, *rslot;
    double *kappa, *gamma, *beta, *v, *rho, *bank0; // inputs
    double *dout, *dbank;                           // loss = <dout, out> + <dbank, final bank>
    double *bank, *out;                             // scratch
} OpCase;

static inline size_t op_n(const OpCase *c, int width) { return (size_t)c->B * c->T * c->H * width; }
static inline size_t op_nbank(const OpCase *c) { return (size_t)c->B * c->H * c->N * c->d; }

// Random op inputs; gamma_scale scales the log-decays (0 = no decay), beta in (0,1), softmax-like positive weights.
static inline OpCase op_case_make(Rng *rng, int B, int T, int H, int N, int d, int W, int R, double gamma_lo) {
    OpCase c;
    c.B = B; c.T = T; c.H = H; c.N = N; c.d = d; c.W = W; c.R = R;
    c.wslot = (int *)sdm_malloc(sizeof(int) * op_n(&c, W));
    c.rslot = (int *)sdm_malloc(sizeof(int) * op_n(&c, R));
    for (size_t i = 0; i < op_n(&c, 1); i++) {
        rand_slots(rng, N, W, c.wslot + i * W);
        rand_slots(rng, N, R, c.rslot + i * R);
    }
    c.kappa = rand_array(rng, op_n(&c, W), 0.05, 0.6);
    c.gamma = rand_array(rng, op_n(&c, W), gamma_lo, 0.0);
    c.beta = rand_array(rng, op_n(&c, 1), 0.1, 0.9);
    c.v = rand_array(rng, op_n(&c, d), -1.0, 1.0);
    c.rho = rand_array(rng, op_n(&c, R), 0.05, 0.6);
    c.bank0 = rand_array(rng, op_nbank(&c), -1.0, 1.0);
    c.dout = rand_array(rng, op_n(&c, d), -1.0, 1.0);
    c.dbank = rand_array(rng, op_nbank(&c), -1.0, 1.0);
    c.bank = (double *)sdm_malloc(sizeof(double) * op_nbank(&c));
    c.out = (double *)sdm_malloc(sizeof(double) * op_n(&c, d));
    return c;
}

static inline void op_case_free(OpCase *c) {
    free(c->wslot); free(c->rslot); free(c->kappa); free(c->gamma); free(c->beta); free(c->v); free(c->rho);
    free(c->bank0); free(c->dout); free(c->dbank); free(c->bank); free(c->out);
}

static inline void op_case_forward(OpCase *c) {
    memcpy(c->bank, c->bank0, sizeof(double) * op_nbank(c));
    sdm_op_forward_ref(c->B, c->T, c->H, c->N, c->d, c->W, c->R, c->wslot, c->kappa, c->gamma, c->beta, c->v,
                       c->rslot, c->rho, c->bank, c->out);
}

static inline double op_loss(void *ctx) {
    OpCase *c = (OpCase *)ctx;
    op_case_forward(c);
    return dot_all(c->dout, c->out, op_n(c, c->d)) + dot_all(c->dbank, c->bank, op_nbank(c));
}

// Pairs of tokens of one stream and one chunk of C tokens that write a common slot (C = T: the whole stream), and
// tokens that read a slot they wrote themselves.
static inline void count_collisions(int B, int T, int H, int W, int R, int C, const int *wslot, const int *rslot,
                                    int *shared_writes, int *read_own_write) {
    *shared_writes = *read_own_write = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const int *kt = wslot + sdm_tok_off(T, H, b, t, h, W), *qt = rslot + sdm_tok_off(T, H, b, t, h, R);
                for (int w = 0; w < W; w++) {
                    for (int j = 0; j < R; j++) *read_own_write += qt[j] == kt[w];
                    for (int u = t - t % C; u < t; u++) {
                        const int *ku = wslot + sdm_tok_off(T, H, b, u, h, W);
                        for (int x = 0; x < W; x++) *shared_writes += ku[x] == kt[w];
                    }
                }
            }
}

#endif
