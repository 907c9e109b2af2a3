// tests/test_attention_ref.c: the CPU attention reference against central finite differences, and brute-force
// checks of the mask rule, GQA head mapping and RoPE.
#include "attention/attention_ref.h"
#include "core/rng.h"
#include "tests/test.h"

static void fill_normal(Rng *r, double *x, size_t n, double std) {
    for (size_t i = 0; i < n; i++) x[i] = std * rng_normal(r);
}

static AttnDims make_dims(int D, int nh, int nkv, int dh, int window, int gated, double theta) {
    AttnDims a;
    a.dim = D; a.n_heads = nh; a.n_kv_heads = nkv; a.head_dim = dh; a.window = window; a.gated = gated;
    a.rope_theta = theta;
    return a;
}

// The layer's parameters and their gradients in one allocation each, so finite differences can walk every entry.
typedef struct {
    size_t n_wq, n_wk, n_wo, total;
    double *w, *grad;
    AttnRefParams p;
    AttnRefGrads g;
} LayerParams;

static LayerParams layer_params(const AttnDims *a, Rng *r) {
    LayerParams L;
    L.n_wq = (size_t)a->n_heads * a->head_dim * a->dim;
    L.n_wk = (size_t)a->n_kv_heads * a->head_dim * a->dim;
    L.n_wo = L.n_wq;
    L.total = L.n_wq + 2 * L.n_wk + L.n_wo + (a->gated ? L.n_wq : 0);
    L.w = (double *)sdm_malloc(L.total * sizeof(double));
    L.grad = (double *)sdm_calloc(L.total, sizeof(double));
    fill_normal(r, L.w, L.total, 1.0 / sqrt((double)a->dim));
    size_t off[5] = {0, L.n_wq, L.n_wq + L.n_wk, L.n_wq + 2 * L.n_wk, L.n_wq + 2 * L.n_wk + L.n_wo};
    L.p.wq = L.w + off[0]; L.p.wk = L.w + off[1]; L.p.wv = L.w + off[2]; L.p.wo = L.w + off[3];
    L.p.wg = a->gated ? L.w + off[4] : NULL;
    L.g.wq = L.grad + off[0]; L.g.wk = L.grad + off[1]; L.g.wv = L.grad + off[2]; L.g.wo = L.grad + off[3];
    L.g.wg = a->gated ? L.grad + off[4] : NULL;
    return L;
}

// loss = sum(y * r)
static double layer_loss(const AttnDims *a, int B, int T, const AttnRefParams *p, const double *x, const double *r,
                         double *y) {
    attn_layer_forward_ref(a, B, T, p, x, y);
    return ref_dot(y, r, B * T * a->dim);
}

// Central differences of the loss with respect to every entry of v[0..n), which the forward reads through p or x.
static void finite_diff(const AttnDims *a, int B, int T, const AttnRefParams *p, const double *x, const double *r,
                        double *y, double *v, size_t n, double *num) {
    const double h = 1e-5;
    for (size_t i = 0; i < n; i++) {
        double keep = v[i];
        v[i] = keep + h;
        double lp = layer_loss(a, B, T, p, x, r, y);
        v[i] = keep - h;
        double lm = layer_loss(a, B, T, p, x, r, y);
        v[i] = keep;
        num[i] = (lp - lm) / (2 * h);
    }
}

static void check_layer_gradients(const char *name, const AttnDims *a, int B, int T, uint64_t seed) {
    Rng rng = rng_make(seed);
    size_t nx = (size_t)B * T * a->dim;
    LayerParams L = layer_params(a, &rng);
    double *x = (double *)sdm_malloc(nx * sizeof(double)), *r = (double *)sdm_malloc(nx * sizeof(double));
    double *y = (double *)sdm_malloc(nx * sizeof(double)), *dx = (double *)sdm_malloc(nx * sizeof(double));
    double *num = (double *)sdm_malloc((L.total > nx ? L.total : nx) * sizeof(double));
    fill_normal(&rng, x, nx, 1.0);
    fill_normal(&rng, r, nx, 1.0);

    attn_layer_backward_ref(a, B, T, &L.p, x, r, dx, &L.g);

    const double tol = 1e-6;
    char what[128];
    finite_diff(a, B, T, &L.p, x, r, y, x, nx, num);
    snprintf(what, sizeof what, "%s: dx", name);
    check_close(what, dx, num, nx, tol);

    finite_diff(a, B, T, &L.p, x, r, y, L.w, L.total, num);
    const char *names[5] = {"dwq", "dwk", "dwv", "dwo", "dwg"};
    size_t sizes[5] = {L.n_wq, L.n_wk, L.n_wk, L.n_wo, a->gated ? L.n_wq : 0}, off = 0;
    for (int i = 0; i < 5; i++) {
        if (!sizes[i]) continue;
        snprintf(what, sizeof what, "%s: %s", name, names[i]);
        check_close(what, L.grad + off, num + off, sizes[i], tol);
        off += sizes[i];
    }
    free(x); free(r); free(y); free(dx); free(num); free(L.w); free(L.grad);
}

// Random q, k, v for the core: q [B,T,n_h,d_h], k, v [B,T,n_kv,d_h].
typedef struct { double *q, *k, *v, *o, *lse; size_t nq, nk; } CoreInputs;

static CoreInputs core_inputs(const AttnDims *a, int B, int T, Rng *r) {
    CoreInputs c;
    c.nq = (size_t)B * T * a->n_heads * a->head_dim;
    c.nk = (size_t)B * T * a->n_kv_heads * a->head_dim;
    c.q = (double *)sdm_malloc(c.nq * sizeof(double));
    c.k = (double *)sdm_malloc(c.nk * sizeof(double));
    c.v = (double *)sdm_malloc(c.nk * sizeof(double));
    c.o = (double *)sdm_malloc(c.nq * sizeof(double));
    c.lse = (double *)sdm_malloc((size_t)B * a->n_heads * T * sizeof(double));
    fill_normal(r, c.q, c.nq, 1.0);
    fill_normal(r, c.k, c.nk, 1.0);
    fill_normal(r, c.v, c.nk, 1.0);
    return c;
}

static void core_free(CoreInputs *c) { free(c->q); free(c->k); free(c->v); free(c->o); free(c->lse); }

// Brute force over every (query p, key s) pair: perturbing key/value s of the query's kv head changes output row p
// iff 0 <= p - s < w, and leaves it bitwise unchanged otherwise.
static void check_mask_rule(int window) {
    const int B = 1, T = 9;
    AttnDims a = make_dims(0, 4, 2, 4, window, 0, 10000.0);
    Rng rng = rng_make(100 + window);
    CoreInputs c = core_inputs(&a, B, T, &rng);
    double *o2 = (double *)sdm_malloc(c.nq * sizeof(double));
    attn_core_forward_ref(&a, B, T, c.q, c.k, c.v, c.o, NULL);
    int wrong = 0;
    for (int s = 0; s < T; s++)
        for (int g = 0; g < a.n_kv_heads; g++) {
            double *kr = c.k + ((size_t)s * a.n_kv_heads + g) * a.head_dim;
            double *vr = c.v + ((size_t)s * a.n_kv_heads + g) * a.head_dim;
            double keep_k = kr[0], keep_v = vr[1];
            kr[0] += 3.0; vr[1] += 3.0;
            attn_core_forward_ref(&a, B, T, c.q, c.k, c.v, o2, NULL);
            kr[0] = keep_k; vr[1] = keep_v;
            for (int p = 0; p < T; p++)
                for (int j = 0; j < a.n_heads; j++) {
                    size_t row = ((size_t)p * a.n_heads + j) * a.head_dim;
                    int changed = memcmp(c.o + row, o2 + row, a.head_dim * sizeof(double)) != 0;
                    int rule = window == 0 ? s <= p : (0 <= p - s && p - s < window); // docs/MODEL.md#attention
                    wrong += changed != (j / 2 == g && rule);                          // n_h / n_kv = 2
                }
        }
    CHECK(wrong == 0, "mask rule, window %d: %d (query, key, head) triples disagree", window, wrong);
    free(o2);
    core_free(&c);
}

// A window w >= T is full causal, bit for bit; w = 1 returns each query's own value row of its kv head, exactly.
static void check_window_extremes(void) {
    const int B = 2, T = 7;
    AttnDims a = make_dims(0, 4, 2, 6, 0, 0, 10000.0);
    Rng rng = rng_make(7);
    CoreInputs c = core_inputs(&a, B, T, &rng);
    double *o2 = (double *)sdm_malloc(c.nq * sizeof(double));
    attn_core_forward_ref(&a, B, T, c.q, c.k, c.v, c.o, NULL);
    for (int w = T; w <= T + 2; w += 2) {
        a.window = w;
        attn_core_forward_ref(&a, B, T, c.q, c.k, c.v, o2, NULL);
        CHECK(memcmp(c.o, o2, c.nq * sizeof(double)) == 0, "window %d >= T differs from full causal", w);
    }
    a.window = 1;
    attn_core_forward_ref(&a, B, T, c.q, c.k, c.v, o2, NULL);
    int wrong = 0;
    for (int bt = 0; bt < B * T; bt++)
        for (int j = 0; j < a.n_heads; j++)
            wrong += memcmp(o2 + ((size_t)bt * a.n_heads + j) * a.head_dim,
                            c.v + ((size_t)bt * a.n_kv_heads + j / 2) * a.head_dim, a.head_dim * sizeof(double)) != 0;
    CHECK(wrong == 0, "window 1: %d rows differ from their own value row", wrong);
    free(o2);
    core_free(&c);
}

// lse[b,j,t] = log sum over visible s of exp(q.k_s / sqrt(d_h)), written out directly.
static void check_lse(int window) {
    const int B = 2, T = 6;
    AttnDims a = make_dims(0, 2, 1, 4, window, 0, 10000.0);
    Rng rng = rng_make(11);
    CoreInputs c = core_inputs(&a, B, T, &rng);
    attn_core_forward_ref(&a, B, T, c.q, c.k, c.v, c.o, c.lse);
    double worst = 0.0;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < a.n_heads; j++)
            for (int t = 0; t < T; t++) {
                double sum = 0.0;
                for (int s = 0; s < T; s++)
                    if (attn_visible(t, s, window))
                        sum += exp(ref_dot(c.q + (((size_t)b * T + t) * 2 + j) * 4, c.k + ((size_t)b * T + s) * 4, 4) /
                                   2.0);
                worst = fmax(worst, fabs(log(sum) - c.lse[((size_t)b * 2 + j) * T + t]));
            }
    CHECK(worst < 1e-13, "lse, window %d: max abs error %.3e", window, worst);
    core_free(&c);
}

// RoPE: pair 0 turns by exactly pos radians (theta^0 = 1); the backward undoes the forward; norms are kept.
static void check_rope(void) {
    const int T = 40, n = 3, dh = 8;
    double e[2] = {1.0, 0.0};
    double *x = (double *)sdm_malloc((size_t)T * n * dh * sizeof(double));
    double *x0 = (double *)sdm_malloc((size_t)T * n * dh * sizeof(double));
    Rng rng = rng_make(3);
    fill_normal(&rng, x, (size_t)T * n * dh, 1.0);
    memcpy(x0, x, (size_t)T * n * dh * sizeof(double));
    attn_rope_ref(x, 1, T, n, dh, 10000.0, 1);
    double norm_err = 0.0;
    for (int r = 0; r < T * n; r++)
        norm_err = fmax(norm_err, fabs(sqrt(ref_dot(x + r * dh, x + r * dh, dh)) -
                                       sqrt(ref_dot(x0 + r * dh, x0 + r * dh, dh))));
    CHECK(norm_err < 1e-12, "rope changes a norm by %.3e", norm_err);
    attn_rope_ref(x, 1, T, n, dh, 10000.0, -1);
    check_close("rope backward(forward(x)) = x", x, x0, (size_t)T * n * dh, 1e-14);
    // position 5, pair 0 of a 2-dim head: (1, 0) -> (cos 5, sin 5)
    double *p5 = (double *)sdm_calloc(6 * 2, sizeof(double));
    for (int t = 0; t < 6; t++) p5[2 * t] = e[0], p5[2 * t + 1] = e[1];
    attn_rope_ref(p5, 1, 6, 1, 2, 10000.0, 1);
    CHECK(p5[10] == cos(5.0) && p5[11] == sin(5.0), "rope pair 0 at pos 5: (%g, %g)", p5[10], p5[11]);
    double want = pow(10000.0, -2.0 / 8.0);
    CHECK(fabs(attn_rope_inv_freq(1, 8, 10000.0) - want) < 1e-7 * want, "rope inverse frequency of pair 1");
    free(x); free(x0); free(p5);
}

int main(void) {
    // name, D, n_h, n_kv, d_h, window, gated, theta; B, T
    struct { const char *name; int D, nh, nkv, dh, w, gated; double theta; int B, T; } cases[] = {
        {"full causal, MHA", 6, 2, 2, 4, 0, 0, 10000.0, 2, 5},
        {"full causal, GQA 2, gated", 5, 4, 2, 4, 0, 1, 100000.0, 1, 6},
        {"window 2, GQA 2, gated", 6, 4, 2, 4, 2, 1, 10000.0, 2, 5},
        {"window 3, MHA, d_h 6", 7, 2, 2, 6, 3, 0, 10000.0, 1, 7},
        {"window 1, gated", 6, 2, 1, 4, 1, 1, 10000.0, 2, 4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        AttnDims a = make_dims(cases[i].D, cases[i].nh, cases[i].nkv, cases[i].dh, cases[i].w, cases[i].gated,
                               cases[i].theta);
        check_layer_gradients(cases[i].name, &a, cases[i].B, cases[i].T, 1000 + i);
    }
    int windows[4] = {0, 1, 3, 20};
    for (int i = 0; i < 4; i++) check_mask_rule(windows[i]);
    check_window_extremes();
    check_lse(0);
    check_lse(2);
    check_rope();
    return test_summary();
}
