// tests/test_model_ref.c: the whole-model CPU oracle (model/model_ref.h) against central finite differences of its
// own loss, for every parameter tensor of tiny hybrid models that together cover: SDM H = 1 and 2, W, R >= 2,
// learned bank on and off, output gate, readings norm, key_weighted_decay, 2 and 3 product-key factors, a window
// smaller than T (and w = 1), GQA, gated attention, tied and untied LM heads.
#include "model/model_ref.h"
#include "tests/test.h"

#define FD_EPS 1e-5
#define FD_TOL 1e-6    // relative error of the analytic gradient against central differences
#define SAMPLES 6      // elements checked per tensor (all of them when the tensor is smaller)

static ModelDesc g_model;

typedef struct {
    const char *name;
    const char *lines; // config lines, '\n' separated
    int B, T;
} Case;

static const Case CASES[] = {
    {"untied, SDM H=1 2 factors, learned bank, gate, readings norm; full attn + SWA w=3 GQA",
     "model.dim = 8\nmodel.n_layers = 3\nmodel.n_heads = 2\nmodel.vocab_size = 11\nmodel.multiple_of = 8\n"
     "model.attn_at = 0\nmodel.swa_at = 1\nmodel.sdm_at = 2\nmodel.swa_window = 3\nmodel.swa_n_heads = 2\n"
     "model.swa_n_kv_heads = 1\nmodel.swa_head_dim = 4\nsdm.num_heads = 1\nsdm.slots_per_head = 16\n"
     "sdm.num_writes = 3\nsdm.num_reads = 2\nsdm.backprop_on_memory = true\nsdm.output_gate = true\n"
     "sdm.normalize_readings = true\nsdm.A_init_range = 0.5,4\n",
     2, 6},
    {"tied, SDM H=2 3 factors, key-weighted decay, zero bank; gated full attn GQA 4:2",
     "model.dim = 8\nmodel.n_layers = 2\nmodel.n_heads = 4\nmodel.n_kv_heads = 2\nmodel.vocab_size = 9\n"
     "model.multiple_of = 4\nmodel.weight_tying = true\nmodel.attn_gate = true\nmodel.attn_at = 1\nmodel.sdm_at = 0\n"
     "sdm.num_heads = 2\nsdm.slots_per_head = 12\nsdm.product_key_factor_dims = 2,2,3\nsdm.num_writes = 2\n"
     "sdm.num_reads = 3\nsdm.key_weighted_decay = true\nsdm.backprop_on_memory = false\nsdm.write_act_scale = 1.5\n"
     "sdm.A_init_range = 0.5,4\n",
     2, 5},
    {"untied, SDM H=2 2 factors, learned bank, gate, norm, key-weighted decay; SWA w=1 gated",
     "model.dim = 8\nmodel.n_layers = 2\nmodel.n_heads = 2\nmodel.vocab_size = 7\nmodel.multiple_of = 8\n"
     "model.attn_gate = true\nmodel.swa_at = 0\nmodel.sdm_at = 1\nmodel.swa_window = 1\nsdm.num_heads = 2\n"
     "sdm.slots_per_head = 9\nsdm.num_writes = 4\nsdm.num_reads = 2\nsdm.backprop_on_memory = true\n"
     "sdm.output_gate = true\nsdm.normalize_readings = true\nsdm.key_weighted_decay = true\nsdm.A_init_range = 0.5,4\n",
     1, 7},
};

static int build_case(const Case *c, Config *cfg) {
    char err[CFG_ERR];
    cfg_defaults(cfg);
    if (!cfg_parse_text(cfg, c->lines, "case", err) || !cfg_validate(cfg, err)) {
        CHECK(0, "%s: %s", c->name, err);
        return 0;
    }
    model_build(&g_model, cfg);
    return 1;
}

static double loss_at(double *params, const int *tokens, const int *targets, int B, int T) {
    ModelRefActs acts;
    double loss = model_ref_forward(&g_model, params, tokens, targets, B, T, &acts);
    model_ref_acts_free(&acts);
    return loss;
}

// Perturb params in-place a few ways so that biases, norms and gates are not at their symmetric init values.
static void jitter(double *params, long long n, Rng *r) {
    for (long long i = 0; i < n; i++) params[i] += 0.1 * rng_normal(r);
}

static void check_case(const Case *c) {
    Config cfg;
    if (!build_case(c, &cfg)) return;
    const ModelDesc *m = &g_model;
    int n = c->B * c->T;
    Rng r = rng_make(12345);
    double *params = (double *)sdm_malloc(sizeof(double) * m->storage);
    double *grads = (double *)sdm_malloc(sizeof(double) * m->storage);
    int *tokens = (int *)sdm_malloc(sizeof(int) * n), *targets = (int *)sdm_malloc(sizeof(int) * n);
    model_ref_init(m, 777, params);
    jitter(params, m->storage, &r);
    for (int i = 0; i < n; i++) {
        tokens[i] = (int)rng_below(&r, (uint32_t)m->vocab);
        targets[i] = (int)rng_below(&r, (uint32_t)m->vocab);
    }
    double loss = model_ref_backward(m, params, tokens, targets, c->B, c->T, grads);
    CHECK(isfinite(loss) && loss > 0, "%s: loss %g", c->name, loss);
    CHECK(fabs(loss - loss_at(params, tokens, targets, c->B, c->T)) == 0, "%s: backward's loss differs", c->name);

    for (int t = 0; t < m->n_params; t++) {
        const ParamSpec *p = &m->params[t];
        int count = p->numel < SAMPLES ? (int)p->numel : SAMPLES;
        double fd[SAMPLES], an[SAMPLES];
        for (int s = 0; s < count; s++) {
            long long k = p->numel <= SAMPLES ? s : (long long)rng_below(&r, (uint32_t)p->numel);
            if (p->is_embedding && !strcmp(p->name, "tok_emb")) // rows of tokens that occur, so gradients are non-zero
                k = (long long)tokens[rng_below(&r, (uint32_t)n)] * m->dim + rng_below(&r, (uint32_t)m->dim);
            for (int tries = 0; p->is_bank && grads[p->offset + k] == 0 && tries < 100; tries++) // a touched slot
                k = (long long)rng_below(&r, (uint32_t)p->numel);
            double *x = &params[p->offset + k], keep = *x;
            *x = keep + FD_EPS;
            double up = loss_at(params, tokens, targets, c->B, c->T);
            *x = keep - FD_EPS;
            double down = loss_at(params, tokens, targets, c->B, c->T);
            *x = keep;
            fd[s] = (up - down) / (2 * FD_EPS);
            an[s] = grads[p->offset + k];
        }
        double norm = 0;
        for (int s = 0; s < count; s++) norm += an[s] * an[s];
        char what[160];
        snprintf(what, sizeof what, "%s: d loss / d %s", c->name, p->name);
        check_close(what, an, fd, (size_t)count, FD_TOL);
        // with a window of 1 every query sees only itself: softmax is constant, so dq = dk = 0 exactly
        int zero_by_design = p->layer >= 0 && m->kind[p->layer] == LAYER_SWA && m->attn[p->layer].window == 1 &&
                             (strstr(p->name, "attn.wq") || strstr(p->name, "attn.wk"));
        CHECK(zero_by_design ? norm == 0 : norm > 0, "%s: gradient %s on the sampled entries", what,
              zero_by_design ? "should be zero" : "is identically zero");
    }
    free(params);
    free(grads);
    free(tokens);
    free(targets);
}

// Tied and untied heads differ exactly by the lm_head tensor.
static void check_tying(void) {
    Config cfg;
    if (!build_case(&CASES[0], &cfg)) return;
    long long untied = g_model.total;
    CHECK(model_find(&g_model, "lm_head") != NULL, "untied model has no lm_head");
    cfg.weight_tying = 1;
    model_build(&g_model, &cfg);
    CHECK(model_find(&g_model, "lm_head") == NULL && untied - g_model.total == (long long)cfg.vocab_size * cfg.dim,
          "tying must remove exactly the [V, D] head");
}

int main(void) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) check_case(&CASES[i]);
    check_tying();
    return test_summary();
}
