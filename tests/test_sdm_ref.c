// tests/test_sdm_ref.c: the double-precision SDM reference checked against itself:
// central finite differences against every analytic gradient (op and layer), product-key top-k against a
// brute-force top-k, and SDM facts (untouched slots, full wipe, no decay, shared slots).
#include "model/model.h"
#include "sdm/sdm_ref.h"
#include "core/rng.h"
#include "tests/test.h"
#include "tests/sdm_op_case.h"

#define FD_EPS 3e-4
#define FD_TOL 1e-6

// ---------------------------------------------------------------------------------------------------------------
// finite differences

typedef double (*LossFn)(void *ctx);

static double loss_at(LossFn loss, void *ctx, double *xi, double value) {
    *xi = value;
    return loss(ctx);
}

// Fourth-order central differences of loss(ctx) with respect to each entry of x[n] (perturbed in place, restored):
// truncation error O(eps^4), so eps can be large enough to keep rounding noise far below the tolerance.
static void numeric_grad(LossFn loss, void *ctx, double *x, size_t n, double *num) {
    for (size_t i = 0; i < n; i++) {
        double x0 = x[i], h = FD_EPS;
        double d1 = loss_at(loss, ctx, x + i, x0 + h) - loss_at(loss, ctx, x + i, x0 - h);
        double d2 = loss_at(loss, ctx, x + i, x0 + 2 * h) - loss_at(loss, ctx, x + i, x0 - 2 * h);
        x[i] = x0;
        num[i] = (8.0 * d1 - d2) / (12.0 * h);
    }
}

static void check_grad(const char *what, LossFn loss, void *ctx, double *x, size_t n, const double *analytic) {
    double *num = (double *)sdm_malloc(sizeof(double) * n);
    numeric_grad(loss, ctx, x, n, num);
    check_close(what, analytic, num, n, FD_TOL);
    free(num);
}

// ---------------------------------------------------------------------------------------------------------------
// the memory op

// gamma_lo: log-decays drawn in [gamma_lo, 0] (0: no decay)
static void test_op_gradients(int B, int T, int H, int N, int d, int W, int R, double gamma_lo, uint64_t seed) {
    Rng rng = rng_make(seed);
    OpCase c = op_case_make(&rng, B, T, H, N, d, W, R, gamma_lo);
    int shared, own;
    count_collisions(B, T, H, W, R, T, c.wslot, c.rslot, &shared, &own);
    CHECK(shared > 0 && own > 0, "op case B%d T%d H%d N%d: collisions %d, reads of own writes %d", B, T, H, N, shared,
          own);
    double *dkappa = (double *)sdm_malloc(sizeof(double) * op_n(&c, W));
    double *dgamma = (double *)sdm_malloc(sizeof(double) * op_n(&c, W));
    double *dbeta = (double *)sdm_malloc(sizeof(double) * op_n(&c, 1));
    double *dv = (double *)sdm_malloc(sizeof(double) * op_n(&c, d));
    double *drho = (double *)sdm_malloc(sizeof(double) * op_n(&c, R));
    double *dbank0 = (double *)sdm_malloc(sizeof(double) * op_nbank(&c));
    sdm_op_backward_ref(B, T, H, N, d, W, R, c.wslot, c.kappa, c.gamma, c.beta, c.v, c.rslot, c.rho, c.bank0, c.dout,
                        c.dbank, dkappa, dgamma, dbeta, dv, drho, dbank0);
    char what[96];
    snprintf(what, sizeof what, "op B%d T%d H%d N%d d%d W%d R%d gamma>=%g", B, T, H, N, d, W, R, gamma_lo);
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

// Under a full wipe every written row becomes kappa_i beta v_t, whatever it held: the expected final bank rows
// [B,H,N,d] and readings [B,T,H,d], computed without the delta rule.
static void wipe_expectation(const OpCase *c, double *rows, double *expect) {
    int d = c->d;
    memcpy(rows, c->bank0, sizeof(double) * op_nbank(c));
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->H; h++) {
            double *M = rows + (size_t)(b * c->H + h) * c->N * d;
            for (int t = 0; t < c->T; t++) {
                size_t ow = sdm_tok_off(c->T, c->H, b, t, h, c->W), orr = sdm_tok_off(c->T, c->H, b, t, h, c->R);
                size_t od = sdm_tok_off(c->T, c->H, b, t, h, d), ob = sdm_tok_off(c->T, c->H, b, t, h, 1);
                for (int w = 0; w < c->W; w++) {
                    double *row = M + (size_t)c->wslot[ow + w] * d;
                    for (int k = 0; k < d; k++) row[k] = c->kappa[ow + w] * c->beta[ob] * c->v[od + k];
                }
                for (int k = 0; k < d; k++) {
                    expect[od + k] = 0.0;
                    for (int j = 0; j < c->R; j++)
                        expect[od + k] += c->rho[orr + j] * M[(size_t)c->rslot[orr + j] * d + k];
                }
            }
        }
}

// Untouched rows keep their value bit for bit; a full wipe (alpha = 0) makes each written row kappa_i beta v_t exactly.
static void test_op_facts(void) {
    Rng rng = rng_make(11);
    OpCase c = op_case_make(&rng, 2, 4, 2, 12, 3, 2, 3, -2.0);
    op_case_forward(&c);
    int untouched = 0, untouched_equal = 0;
    for (int b = 0; b < c.B; b++)
        for (int h = 0; h < c.H; h++)
            for (int i = 0; i < c.N; i++) {
                int written = 0;
                for (int t = 0; t < c.T; t++)
                    for (int w = 0; w < c.W; w++) written |= c.wslot[sdm_tok_off(c.T, c.H, b, t, h, c.W) + w] == i;
                if (written) continue;
                size_t row = ((size_t)(b * c.H + h) * c.N + i) * c.d;
                untouched++;
                untouched_equal += memcmp(c.bank + row, c.bank0 + row, sizeof(double) * c.d) == 0;
            }
    CHECK(untouched > 0 && untouched_equal == untouched, "untouched rows: %d of %d bitwise equal", untouched_equal,
          untouched);

    // full wipe: exp(gamma) underflows to 0, so a written row forgets everything before the write
    for (size_t i = 0; i < op_n(&c, c.W); i++) c.gamma[i] = -1e4;
    op_case_forward(&c);
    double *rows = (double *)sdm_malloc(sizeof(double) * op_nbank(&c));
    double *expect = (double *)sdm_malloc(sizeof(double) * op_n(&c, c.d));
    wipe_expectation(&c, rows, expect);
    check_close("full wipe: readings", c.out, expect, op_n(&c, c.d), 1e-14);
    check_close("full wipe: final bank", c.bank, rows, op_nbank(&c), 1e-14);
    free(rows);
    free(expect);
    op_case_free(&c);
}

// ---------------------------------------------------------------------------------------------------------------
// product-key top-k

// The tie rule of docs/SDM.md#tie-rule written independently of sdm_pk_before: larger float32 score first, then the
// larger sum of sub-key indices, then the larger first-factor index, then the larger second-factor index, and so on.
typedef struct { float score; int sum; int digit[SDM_MAX_FACTORS]; int slot; } BruteSlot; // unused digits 0
static int brute_cmp(const void *pa, const void *pb) {
    const BruteSlot *a = (const BruteSlot *)pa, *b = (const BruteSlot *)pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    if (a->sum != b->sum) return a->sum > b->sum ? -1 : 1;
    for (int f = 0; f < SDM_MAX_FACTORS; f++)
        if (a->digit[f] != b->digit[f]) return a->digit[f] > b->digit[f] ? -1 : 1;
    return 0;
}

// All N slots with their float32 scores summed left to right, sorted best first (by brute_cmp).
static BruteSlot *brute_rank(int F, const int *dims, const double *scores, int *N_out) {
    int N = 1;
    for (int f = 0; f < F; f++) N *= dims[f];
    BruteSlot *all = (BruteSlot *)sdm_malloc(sizeof(BruteSlot) * N);
    for (int i = 0; i < N; i++) {
        BruteSlot *x = all + i;
        memset(x->digit, 0, sizeof x->digit);
        for (int f = F - 1, r = i; f >= 0; r /= dims[f], f--) x->digit[f] = r % dims[f];
        x->score = (float)scores[x->digit[0]];
        x->sum = x->digit[0];
        for (int f = 1, o = dims[0]; f < F; o += dims[f], f++) {
            x->score = x->score + (float)scores[o + x->digit[f]];
            x->sum += x->digit[f];
        }
        x->slot = i;
    }
    qsort(all, (size_t)N, sizeof(BruteSlot), brute_cmp);
    *N_out = N;
    return all;
}

// Random trials for one factorisation. quantized: scores on a grid of 1/4 in [-1, 1] (exact float sums, many ties).
// Counts trials where the k-th and (k+1)-th slots tie in float score (the tie rule decides the selection).
static void test_topk_dims(int F, const int *dims, int quantized, int trials, Rng *rng, int *boundary_ties) {
    int N = 1, K = 0;
    for (int f = 0; f < F; f++) { N *= dims[f]; K += dims[f]; }
    double *s = (double *)sdm_malloc(sizeof(double) * K), *score = (double *)sdm_malloc(sizeof(double) * N);
    int *slot = (int *)sdm_malloc(sizeof(int) * N), *ref = (int *)sdm_malloc(sizeof(int) * N);
    int mismatches = 0, bad_scores = 0;
    for (int trial = 0; trial < trials; trial++) {
        int k = 1 + (int)rng_below(rng, (uint32_t)N);
        for (int i = 0; i < K; i++) s[i] = quantized ? 0.25 * ((int)rng_below(rng, 9) - 4) : rng_range(rng, -2.0, 2.0);
        sdm_pk_topk_ref(F, dims, k, s, slot, score);
        int n_all;
        BruteSlot *all = brute_rank(F, dims, s, &n_all);
        for (int j = 0; j < k; j++) ref[j] = all[j].slot;
        qsort(ref, (size_t)k, sizeof(int), ascending_int_cmp);
        mismatches += memcmp(slot, ref, sizeof(int) * k) != 0;
        if (k < N) *boundary_ties += all[k - 1].score == all[k].score; // the tie rule decides the boundary
        int digit[SDM_MAX_FACTORS];
        for (int j = 0; j < k; j++) {
            sdm_pk_digits(F, dims, slot[j], digit);
            double e = 0.0;
            for (int f = 0, o = 0; f < F; o += dims[f], f++) e += s[o + digit[f]];
            bad_scores += e != score[j] || (j > 0 && slot[j] <= slot[j - 1]);
        }
        free(all);
    }
    CHECK(mismatches == 0, "top-k F=%d n1=%d quantized=%d: %d of %d trials differ from brute force", F, dims[0],
          quantized, mismatches, trials);
    CHECK(bad_scores == 0, "top-k F=%d: %d selected scores not the double sum or slots not ascending", F, bad_scores);
    free(s); free(score); free(slot); free(ref);
}

static void test_topk(void) {
    static const int d1[] = {7}, d2a[] = {3, 5}, d2b[] = {4, 4}, d3a[] = {2, 3, 4}, d3b[] = {3, 3, 3};
    static const int d4[] = {2, 3, 2, 2};
    const int *dims[] = {d1, d2a, d2b, d3a, d3b, d4};
    const int F[] = {1, 2, 2, 3, 3, 4};
    Rng rng = rng_make(5);
    int ties = 0;
    for (int c = 0; c < 6; c++)
        for (int q = 0; q < 2; q++) test_topk_dims(F[c], dims[c], q, 150, &rng, &ties);
    printf("top-k: %d trials with a float32 tie at the k-th / (k+1)-th boundary\n", ties);
    CHECK(ties > 100, "top-k tie inputs: only %d boundary ties exercised", ties);
}

// ---------------------------------------------------------------------------------------------------------------
// the layer

typedef struct {
    SdmDims s;
    int B, T;
    double *t[SDM_P_COUNT];     // parameters (NULL when absent)
    double *x, *dy, *y;         // input [B,T,D], loss weights on y, scratch output
    int *wslot0, *rslot0;       // selection of the unperturbed forward
    int selection_changes;      // forwards (during finite differences) whose selection differed
} LayerCase;

static SdmDims layer_dims(int H, int d, int F, const int *dims, int W, int R) {
    SdmDims s;
    memset(&s, 0, sizeof s);
    s.heads = H; s.head_dim = d; s.dim = H * d; s.n_factors = F; s.slots = 1;
    for (int f = 0; f < F; f++) { s.factor_dims[f] = dims[f]; s.slots *= dims[f]; s.key_dim += dims[f]; }
    s.writes = W; s.reads = R; s.chunk = 4;
    s.write_act = s.read_act = SDM_ACT_SOFTMAX;
    s.write_scale = s.read_scale = 1.0f;
    s.norm_eps = 1e-6f;
    return s;
}

// Random parameters (gates by their init formulas) and input. The sub-key weights are larger than the others so
// that score gaps are wide enough for finite differences never to change the selection.
static LayerCase layer_case_make(const SdmDims *s, int B, int T, uint64_t seed) {
    LayerCase c;
    c.s = *s; c.B = B; c.T = T; c.selection_changes = 0;
    Rng rng = rng_make(seed);
    for (int i = 0; i < SDM_P_COUNT; i++) {
        size_t n = sdm_param_numel(s, i);
        double scale = (i == SDM_P_wk || i == SDM_P_wq) ? 1.5 : 0.6;
        c.t[i] = n ? rand_array(&rng, n, -scale, scale) : NULL;
    }
    for (int h = 0; h < s->heads; h++) {
        c.t[SDM_P_A_log][h] = model_init_A_log(&rng, 0.0, 16.0);
        c.t[SDM_P_dt_bias][h] = model_init_dt_bias(&rng);
    }
    size_t n = (size_t)B * T * s->dim;
    c.x = rand_array(&rng, n, -1.0, 1.0);
    c.dy = rand_array(&rng, n, -1.0, 1.0);
    c.y = (double *)sdm_malloc(sizeof(double) * n);
    size_t nh = (size_t)B * T * s->heads;
    c.wslot0 = (int *)sdm_malloc(sizeof(int) * nh * s->writes);
    c.rslot0 = (int *)sdm_malloc(sizeof(int) * nh * s->reads);
    return c;
}

static void layer_case_free(LayerCase *c) {
    for (int i = 0; i < SDM_P_COUNT; i++) free(c->t[i]);
    free(c->x); free(c->dy); free(c->y); free(c->wslot0); free(c->rslot0);
}

static double layer_loss(void *ctx) {
    LayerCase *c = (LayerCase *)ctx;
    SdmRefParams p = sdm_ref_params_from(c->t);
    SdmRefTrace tr = sdm_ref_trace_alloc(&c->s, c->B, c->T);
    sdm_layer_forward_trace_ref(&c->s, c->B, c->T, &p, c->x, &tr);
    size_t nh = (size_t)c->B * c->T * c->s.heads;
    c->selection_changes += memcmp(tr.wslot, c->wslot0, sizeof(int) * nh * c->s.writes) != 0 ||
                            memcmp(tr.rslot, c->rslot0, sizeof(int) * nh * c->s.reads) != 0;
    double l = dot_all(c->dy, tr.y, (size_t)c->B * c->T * c->s.dim);
    sdm_ref_trace_free(&tr);
    return l;
}

// Finite differences of the whole layer against sdm_layer_backward_ref for x and every parameter tensor.
static void test_layer_gradients(const char *name, const SdmDims *s, int B, int T, uint64_t seed) {
    LayerCase c = layer_case_make(s, B, T, seed);
    SdmRefParams p = sdm_ref_params_from(c.t);
    SdmRefTrace tr = sdm_ref_trace_alloc(s, B, T);
    sdm_layer_forward_trace_ref(s, B, T, &p, c.x, &tr);
    size_t nh = (size_t)B * T * s->heads, nx = (size_t)B * T * s->dim;
    memcpy(c.wslot0, tr.wslot, sizeof(int) * nh * s->writes);
    memcpy(c.rslot0, tr.rslot, sizeof(int) * nh * s->reads);
    int shared, own;
    count_collisions(B, T, s->heads, s->writes, s->reads, T, tr.wslot, tr.rslot, &shared, &own);
    CHECK(shared > 0, "%s: no tokens share a write slot", name);
    // y equals the plain wrapper's output
    sdm_layer_forward_ref(s, B, T, &p, c.x, c.y);
    CHECK(memcmp(c.y, tr.y, sizeof(double) * nx) == 0, "%s: sdm_layer_forward_ref differs from the traced forward",
          name);
    double *grad[SDM_P_COUNT];
    for (int i = 0; i < SDM_P_COUNT; i++) {
        size_t n = sdm_param_numel(s, i);
        grad[i] = n ? (double *)sdm_calloc(n, sizeof(double)) : NULL;
    }
    SdmRefGrads g = sdm_ref_grads_from(grad);
    double *dx = (double *)sdm_malloc(sizeof(double) * nx);
    sdm_layer_backward_ref(s, B, T, &p, c.x, c.dy, dx, &g);
    int finite = 1;
    for (size_t i = 0; i < nx; i++) finite &= isfinite(dx[i]) && isfinite(tr.y[i]);
    CHECK(finite, "%s: non-finite output or dx", name);
    printf("%s: %d shared writes, %d reads of own writes\n", name, shared, own);
    char what[160];
    snprintf(what, sizeof what, "%s: dx", name);
    check_grad(what, layer_loss, &c, c.x, nx, dx);
    for (int i = 0; i < SDM_P_COUNT; i++) {
        size_t n = sdm_param_numel(s, i);
        if (!n) continue;
        snprintf(what, sizeof what, "%s: d%s", name, sdm_param_name(i));
        check_grad(what, layer_loss, &c, c.t[i], n, grad[i]);
    }
    CHECK(c.selection_changes == 0, "%s: %d perturbed forwards changed the selection", name, c.selection_changes);
    for (int i = 0; i < SDM_P_COUNT; i++) free(grad[i]);
    free(dx);
    sdm_ref_trace_free(&tr);
    layer_case_free(&c);
}

// Gates at their extremes through the whole layer: A_log large (g -> -inf, alpha = 0: full wipe) and A_log very
// negative (g = -0, alpha = 1: no decay). Outputs and gradients stay finite and the per-entry decays are as expected.
static void test_layer_gate_extremes(void) {
    static const int dims[] = {2, 3};
    SdmDims s = layer_dims(2, 2, 2, dims, 2, 2);
    s.learned_bank = 1;
    const double A_log[2] = {60.0, -800.0};
    for (int e = 0; e < 2; e++) {
        LayerCase c = layer_case_make(&s, 2, 5, 21);
        for (int h = 0; h < s.heads; h++) c.t[SDM_P_A_log][h] = A_log[e];
        SdmRefParams p = sdm_ref_params_from(c.t);
        SdmRefTrace tr = sdm_ref_trace_alloc(&s, c.B, c.T);
        sdm_layer_forward_trace_ref(&s, c.B, c.T, &p, c.x, &tr);
        size_t ng = (size_t)c.B * c.T * s.heads * s.writes;
        int alpha_ok = 1;
        for (size_t i = 0; i < ng; i++) alpha_ok &= exp(tr.gamma[i]) == (e == 0 ? 0.0 : 1.0);
        CHECK(alpha_ok, "A_log %g: alpha not %s", A_log[e], e == 0 ? "0" : "1");
        double *grad[SDM_P_COUNT];
        for (int i = 0; i < SDM_P_COUNT; i++) {
            size_t n = sdm_param_numel(&s, i);
            grad[i] = n ? (double *)sdm_calloc(n, sizeof(double)) : NULL;
        }
        SdmRefGrads g = sdm_ref_grads_from(grad);
        size_t nx = (size_t)c.B * c.T * s.dim;
        double *dx = (double *)sdm_malloc(sizeof(double) * nx);
        sdm_layer_backward_ref(&s, c.B, c.T, &p, c.x, c.dy, dx, &g);
        int finite = 1;
        for (size_t i = 0; i < nx; i++) finite &= isfinite(tr.y[i]) && isfinite(dx[i]);
        for (int i = 0; i < SDM_P_COUNT; i++)
            for (size_t j = 0; j < sdm_param_numel(&s, i); j++) finite &= isfinite(grad[i][j]);
        CHECK(finite, "A_log %g: non-finite output or gradient", A_log[e]);
        for (int i = 0; i < SDM_P_COUNT; i++) free(grad[i]);
        free(dx);
        sdm_ref_trace_free(&tr);
        layer_case_free(&c);
    }
}

int main(void) {
    test_op_gradients(1, 6, 1, 5, 3, 2, 2, -1.5, 1);
    test_op_gradients(2, 7, 2, 6, 4, 3, 2, -1.5, 2);
    test_op_gradients(1, 5, 2, 4, 2, 4, 3, -1.5, 3); // W = N: every token touches every slot
    test_op_gradients(2, 6, 1, 5, 3, 2, 3, 0.0, 4);  // no decay (alpha = 1)
    test_op_facts();
    test_topk();

    static const int f2a[] = {2, 3}, f2b[] = {3, 2}, f3a[] = {2, 2, 2}, f3b[] = {2, 3, 2};
    SdmDims s = layer_dims(1, 3, 2, f2a, 2, 2); // H = 1, zero bank, plain readout
    test_layer_gradients("layer H1 F2 zero bank", &s, 2, 5, 31);
    s = layer_dims(2, 3, 2, f2b, 3, 2); // H = 2, learned bank, gate, readings norm
    s.learned_bank = s.output_gate = s.normalize_readings = 1;
    test_layer_gradients("layer H2 F2 bank+gate+norm", &s, 2, 5, 32);
    s = layer_dims(2, 2, 3, f3a, 2, 3); // 3 factors, key-weighted decay, softmax scales
    s.learned_bank = s.output_gate = s.key_weighted_decay = 1;
    s.write_scale = 1.7f; s.read_scale = 0.6f;
    test_layer_gradients("layer H2 F3 kwd+bank+gate", &s, 2, 4, 33);
    s = layer_dims(1, 3, 3, f3b, 3, 2); // other activations, readings norm without the gate
    s.write_act = SDM_ACT_SIGMOID; s.read_act = SDM_ACT_L2_NORMALIZE; s.normalize_readings = s.key_weighted_decay = 1;
    test_layer_gradients("layer H1 F3 sigmoid/l2 kwd+norm", &s, 1, 6, 34);
    s = layer_dims(2, 2, 2, f2a, 2, 2);
    s.write_act = SDM_ACT_IDENTITY; s.read_act = SDM_ACT_SIGMOID; s.learned_bank = 1;
    test_layer_gradients("layer H2 F2 identity/sigmoid bank", &s, 1, 5, 35);
    test_layer_gate_extremes();
    return test_summary();
}
