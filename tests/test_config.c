// tests/test_config.c: the config parser, its error messages, and the parameter counts of every shipped config
// against docs/MODEL.md#shipped-configs (the figures there were derived independently from the reference code).
#include <sys/stat.h>
#include <unistd.h>

#include "core/config.h"
#include "model/model.h"
#include "tests/test.h"

static ModelDesc g_model; // large: keep it off the stack

typedef struct {
    const char *file;
    long long sdm_mixer, attn_mixer, swa_mixer, ffn, nonembedding, embedding, bank, total;
} Expected;

// docs/MODEL.md#shipped-configs (0 = not applicable)
static const Expected EXPECTED[] = {
    {"configs/debug_sdm.cfg", 3413252, 4194304, 0, 8650752, 99653648, 528384, 0, 100182032},
    {"configs/debug_hybrid.cfg", 3413252, 4194304, 786432, 8650752, 92837904, 528384, 0, 93366288},
    {"configs/sdm_flagship.cfg", 16795656, 0, 16777216, 34603008, 1233336368, 1056768, 805306368, 2039699504},
    {"configs/sdm_7B.cfg", 67160080, 0, 83886080, 135266304, 6879334528, 2113536, 2147483648, 9028931712},
    {"configs/baseline_1.4B.cfg", 0, 16777216, 16777216, 34603008, 1233225728, 1056768, 0, 1234282496},
    {"configs/baseline_7B.cfg", 0, 67108864, 83886080, 135266304, 6878924800, 2113536, 0, 6881038336},
};

// parameters of the mixer (or FFN when ffn != 0) of the first layer of `kind`, excluding norms and the bank
static long long first_layer_params(const ModelDesc *m, int kind, int ffn) {
    for (int l = 0; l < m->n_layers; l++) {
        if ((int)m->kind[l] != kind) continue;
        long long n = 0;
        for (int i = 0; i < m->n_params; i++) {
            const ParamSpec *p = &m->params[i];
            if (p->layer != l || p->is_bank || strstr(p->name, "_norm")) continue;
            if ((strstr(p->name, ".ffn.") != NULL) == ffn) n += p->numel;
        }
        return n;
    }
    return 0;
}

static void test_shipped_configs(void) {
    char err[CFG_ERR];
    for (size_t k = 0; k < sizeof EXPECTED / sizeof EXPECTED[0]; k++) {
        const Expected *e = &EXPECTED[k];
        char *argv[] = {(char *)"test", (char *)"-c", (char *)e->file};
        Config c;
        int ok = cfg_from_args(&c, 3, argv, err);
        CHECK(ok, "%s does not load: %s", e->file, err);
        if (!ok) continue;
        model_build(&g_model, &c);
        const ModelDesc *m = &g_model;
        CHECK(first_layer_params(m, LAYER_SDM, 0) == e->sdm_mixer, "%s: SDM mixer %lld != %lld", e->file,
              first_layer_params(m, LAYER_SDM, 0), e->sdm_mixer);
        CHECK(first_layer_params(m, LAYER_ATTN, 0) == e->attn_mixer, "%s: attention mixer %lld != %lld", e->file,
              first_layer_params(m, LAYER_ATTN, 0), e->attn_mixer);
        CHECK(first_layer_params(m, LAYER_SWA, 0) == e->swa_mixer, "%s: SWA mixer %lld != %lld", e->file,
              first_layer_params(m, LAYER_SWA, 0), e->swa_mixer);
        CHECK(first_layer_params(m, m->kind[0], 1) == e->ffn, "%s: FFN %lld != %lld", e->file,
              first_layer_params(m, m->kind[0], 1), e->ffn);
        CHECK(m->n_nonembedding == e->nonembedding, "%s: non-embedding %lld != %lld", e->file, m->n_nonembedding,
              e->nonembedding);
        CHECK(m->n_embedding == e->embedding, "%s: embedding %lld != %lld", e->file, m->n_embedding, e->embedding);
        CHECK(m->n_bank == e->bank, "%s: bank %lld != %lld", e->file, m->n_bank, e->bank);
        CHECK(m->total == e->total, "%s: total %lld != %lld", e->file, m->total, e->total);
    }
}

// The resolved dump must load back to the same configuration.
static void test_dump_round_trip(void) {
    char err[CFG_ERR];
    char *argv[] = {(char *)"test", (char *)"-c", (char *)"configs/debug_hybrid.cfg", (char *)"optim.lr=0.125"};
    Config a, b;
    CHECK(cfg_from_args(&a, 4, argv, err), "load: %s", err);
    CHECK(a.lr == 0.125, "command-line override not applied: lr = %g", a.lr);
    const char *path = "build/test_config_dump.cfg";
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL, "cannot write %s", path);
    if (!fp) return;
    cfg_dump(&a, fp);
    fclose(fp);
    cfg_defaults(&b);
    CHECK(cfg_load_file(&b, path, err), "dump does not load: %s", err);
    CHECK(memcmp(&a, &b, sizeof a) == 0, "dump round trip differs");
    remove(path);
}

// A config text that must be refused with a message containing `needle`.
static void expect_error(const char *text, const char *needle) {
    const char *path = "build/test_config_bad.cfg";
    FILE *fp = fopen(path, "w");
    if (!fp) { CHECK(0, "cannot write %s", path); return; }
    fputs(text, fp);
    fclose(fp);
    char err[CFG_ERR] = "";
    char *argv[] = {(char *)"test", (char *)"-c", (char *)path};
    Config c;
    int ok = cfg_from_args(&c, 3, argv, err);
    CHECK(!ok, "accepted a bad config (expected error '%s'):\n%s", needle, text);
    CHECK(strstr(err, needle) != NULL, "error message '%s' lacks '%s'", err, needle);
    remove(path);
}

#define SMALL "model.dim = 64\nmodel.n_layers = 4\nmodel.n_heads = 4\nsdm.slots_per_head = 256\n"

static void test_errors(void) {
    expect_error(SMALL "model.attn_at = all\nmodel.bogus = 3\n", "test_config_bad.cfg:6: unknown key 'model.bogus'");
    expect_error(SMALL "model.attn_at = all\nmodel.n_kv_heads = 6x4\n",
                 "test_config_bad.cfg:6: key 'model.n_kv_heads': '6x4' is not an integer");
    expect_error(SMALL "model.attn_at = all\noptim.lr = -1\n", "key 'optim.lr': -1 is out of range");
    expect_error(SMALL "model.attn_at = all\nsdm.output_gate = yes\n", "not a boolean");
    expect_error(SMALL "model.attn_at = all\nsdm.write_act = relu\n", "not one of softmax|l2_normalize");
    expect_error(SMALL "model.attn_at = all\njust words\n", "test_config_bad.cfg:6: expected 'key = value'");
    expect_error(SMALL "model.attn_at = 0,1\nmodel.sdm_at = 3\n", "layer 2 is assigned no type");
    expect_error(SMALL "model.attn_at = 0,1,2\nmodel.sdm_at = 2,3\n", "layer 2 is assigned more than once");
    expect_error(SMALL "model.attn_at = 0,1,2,3,3\n", "layer 3 listed twice");
    expect_error(SMALL "model.attn_at = 0,1,2,3,7\n", "layer 7 out of range");
    expect_error(SMALL "model.attn_at = 0,1.5,2,3\n", "not an integer in [0, 256)");
    expect_error(SMALL "model.attn_at = 0,1\nmodel.swa_at = 2,3\n", "key 'model.swa_window': must be > 0");
    expect_error(SMALL "model.attn_at = 0,1\nmodel.swa_at = 2,3\nmodel.swa_window = 0\n", "must be > 0");
    expect_error(SMALL "model.sdm_at = all\nsdm.num_writes = 300\n",
                 "key 'sdm.num_writes': 300 exceeds slots_per_head 256");
    expect_error(SMALL "model.sdm_at = all\nsdm.num_reads = 257\n", "key 'sdm.num_reads': 257 exceeds");
    expect_error("model.dim = 64\nmodel.n_layers = 2\nmodel.sdm_at = all\n", "'sdm.slots_per_head': required");
    expect_error("model.dim = 64\nmodel.n_layers = 4\nmodel.sdm_at = all\nsdm.slots_per_head = 200\n",
                 "not a perfect square");
    expect_error(SMALL "model.sdm_at = all\nsdm.product_key_factor_dims = 4,8\n", "product 32 != slots_per_head 256");
    expect_error(SMALL "model.sdm_at = all\nsdm.num_heads = 3\n", "3 does not divide model.dim 64");
    expect_error(SMALL "model.attn_at = all\nmodel.n_kv_heads = 3\n", "3 does not divide n_heads 4");
    expect_error(SMALL "model.attn_at = all\ndistributed.tp_size = 2\n", "out of range");
    expect_error(SMALL "model.attn_at = all\ndistributed.matmul_allow_tf32 = true\n", "true is not supported");
    // command-line errors name the argument
    char err[CFG_ERR] = "";
    Config c;
    char *bad_arg[] = {(char *)"test", (char *)"-c", (char *)"configs/debug_sdm.cfg", (char *)"sdm.num_writes=lots"};
    CHECK(!cfg_from_args(&c, 4, bad_arg, err), "accepted a bad argument");
    CHECK(strstr(err, "argument 'sdm.num_writes=lots'") != NULL, "message '%s' does not name the argument", err);
    char *missing[] = {(char *)"test", (char *)"-c", (char *)"configs/no_such.cfg"};
    CHECK(!cfg_from_args(&c, 3, missing, err), "accepted a missing file");
    CHECK(strstr(err, "configs/no_such.cfg: cannot open") != NULL, "message '%s' does not name the file", err);
    char *flag[] = {(char *)"test", (char *)"--bogus"};
    CHECK(!cfg_from_args(&c, 2, flag, err), "accepted an unknown flag");
    CHECK(strstr(err, "'--bogus'") != NULL, "message '%s' does not name the flag", err);
}

// optim.moment_dtype: fp32 by default, bf16 on request, nothing else; bf16 only with betas whose decay bf16 keeps
// (1 - beta >= 2^-8, model/adamw.cuh), fp32 with any.
static void test_moment_dtype(void) {
    char err[CFG_ERR] = "";
    Config c;
    char *plain[] = {(char *)"test", (char *)"-c", (char *)"configs/debug_sdm.cfg"};
    CHECK(cfg_from_args(&c, 3, plain, err) && !strcmp(c.moment_dtype, "fp32"), "default moment dtype '%s' (%s)",
          c.moment_dtype, err);
    char *bf16[] = {(char *)"test", (char *)"-c", (char *)"configs/debug_sdm.cfg", (char *)"optim.moment_dtype=bf16",
                    (char *)"optim.beta2=0.99609375"};
    CHECK(cfg_from_args(&c, 5, bf16, err) && !strcmp(c.moment_dtype, "bf16"), "bf16 moments, beta2 = 1 - 2^-8: '%s' "
          "(%s)", c.moment_dtype, err);
    expect_error(SMALL "model.attn_at = all\noptim.moment_dtype = fp16\n",
                 "test_config_bad.cfg:6: key 'optim.moment_dtype': 'fp16' is not one of fp32|bf16");
    expect_error(SMALL "model.attn_at = all\noptim.moment_dtype = bf16\noptim.beta2 = 0.999\n",
                 "key 'optim.beta2': 0.999 is above 0.99609375 with optim.moment_dtype = bf16");
    expect_error(SMALL "model.attn_at = all\noptim.moment_dtype = bf16\noptim.beta1 = 0.997\n",
                 "key 'optim.beta1': 0.997 is above");
    char *fp32[] = {(char *)"test", (char *)"-c", (char *)"configs/debug_sdm.cfg", (char *)"optim.beta2=0.999"};
    CHECK(cfg_from_args(&c, 4, fp32, err), "fp32 moments refuse beta2 = 0.999: %s", err);
}

static void write_text(const char *path, const char *text, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(text, 1, n, fp) != n || fclose(fp) != 0) sdm_die("cannot write %s", path);
}

// cfg_from_args on `-c path` plus one optional key=value argument.
static int load_with(const char *path, const char *arg, Config *c, char *err) {
    char *argv[] = {(char *)"test", (char *)"-c", (char *)path, (char *)arg};
    return cfg_from_args(c, arg ? 4 : 3, argv, err);
}

// Issue 9: lines of any length, values that would overflow, strings that would break the dump, duplicate keys,
// files that are not regular files.
static void test_edge_cases(void) {
    const char *path = "build/test_config_edge.cfg";
    char err[CFG_ERR] = "", text[3 * CFG_LINE];
    Config c;
    // a comment of 4095 bytes then `steps = 7`: a 4096-byte line buffer would apply the tail as a setting
    size_t n = (size_t)snprintf(text, sizeof text, "#%0*d", CFG_LINE - 2, 0);
    n += (size_t)snprintf(text + n, sizeof text - n, "steps = 7\n" SMALL "model.attn_at = all\n");
    write_text(path, text, n);
    CHECK(load_with(path, NULL, &c, err) && c.steps == 1000, "a long comment set steps to %d (%s)", c.steps, err);
    memset(text, ' ', CFG_LINE + 10);  // a setting itself longer than CFG_LINE is refused, not split
    memcpy(text + CFG_LINE + 10, "steps = 7\n", 11);
    write_text(path, text, strlen(text));
    CHECK(!load_with(path, NULL, &c, err) && strstr(err, "test_config_edge.cfg:1: setting longer"), "long: %s", err);
    // a key twice in one file is refused with both lines; an argument still overrides the file
    expect_error(SMALL "model.attn_at = all\nmodel.dim = 32\n",
                 "test_config_bad.cfg:6: key 'model.dim' is set twice (first at build/test_config_bad.cfg:1)");
    write_text(path, SMALL "model.attn_at = all\nsteps = 5\n", strlen(SMALL) + 30);
    CHECK(load_with(path, "steps=9", &c, err) && c.steps == 9, "argument override: steps %d (%s)", c.steps, err);
    expect_error(SMALL "model.attn_at = 0,1,2,3,2147483648\n", "test_config_bad.cfg:5: key 'model.attn_at': layer "
                 "index '2.14748e+09' is not an integer in [0, 256)");
    expect_error(SMALL "model.attn_at = all\noptim.eps = 0\n",
                 "test_config_bad.cfg:6: key 'optim.eps': 0 is out of range");
    expect_error(SMALL "model.attn_at = all\noptim.eps = 1e-13\n", "key 'optim.eps': 1e-13 is out of range");
    expect_error(SMALL "model.attn_at = all\ndata.batch_size = 128\ndata.seq_len = 16777215\n", // B*T fits, B*(T+1) not
                 "B*(T+1) = 2147483648 exceeds");
    CHECK(!load_with("configs/debug_sdm.cfg", "name=a#b", &c, err) && strstr(err, "argument 'name=a#b'") &&
          strstr(err, "'#'"), "'#' in a string: %s", err);
    CHECK(!load_with("configs/debug_sdm.cfg", "run_dir=a\nsteps = 3", &c, err) && strstr(err, "key 'run_dir'"),
          "a newline in a string: %s", err);
    CHECK(load_with("configs/debug_sdm.cfg", "run_dir=runs/a b", &c, err), "a space in a string: %s", err);
    write_text(path, "steps = 5\nname = a\0b\n", 20);
    CHECK(!load_with(path, NULL, &c, err) && strstr(err, "test_config_edge.cfg:2: NUL byte"), "NUL: %s", err);
    remove(path);
    // a FIFO must be refused at once, not block until a writer appears (the alarm turns a hang into a failure)
    const char *fifo = "build/test_config_fifo.cfg";
    remove(fifo);
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
    alarm(20);
    CHECK(!load_with(fifo, NULL, &c, err) && strstr(err, "test_config_fifo.cfg: cannot open: not a regular file"),
          "FIFO: %s", err);
    alarm(0);
    remove(fifo);
}

// Factor widths, slot counts and decay flags of the SDM description.
static void test_sdm_description(void) {
    char err[CFG_ERR];
    char *argv[] = {(char *)"test", (char *)"-c", (char *)"configs/sdm_flagship.cfg"};
    Config c;
    CHECK(cfg_from_args(&c, 3, argv, err), "load: %s", err);
    model_build(&g_model, &c);
    const SdmDims *s = &g_model.sdm;
    CHECK(s->n_factors == 2 && s->factor_dims[0] == 256 && s->factor_dims[1] == 256 && s->key_dim == 512,
          "flagship factors %d: %d x %d", s->n_factors, s->factor_dims[0], s->factor_dims[1]);
    CHECK(s->head_dim == 1024 && s->heads == 2 && s->writes == 64 && s->chunk == 64, "flagship SDM dims");
    int nodecay = 0;
    for (int i = 0; i < g_model.n_params; i++) nodecay += !g_model.params[i].decay;
    CHECK(nodecay == 6 * 2, "expected A_log and dt_bias of 6 layers without weight decay, got %d tensors", nodecay);
    const ParamSpec *wk = model_find(&g_model, "layers.3.sdm.wk"), *bk = model_find(&g_model, "layers.3.sdm.bk");
    const ParamSpec *wg = model_find(&g_model, "layers.3.sdm.wg");
    CHECK(wk && bk && wg && wg->offset + wg->numel == bk->offset, "SDM input weights must be adjacent, then biases");
}

// Init statistics: truncated normal std and bound, ones, zeros, A_log and dt_bias ranges.
static void test_init(void) {
    char err[CFG_ERR];
    char *argv[] = {(char *)"test", (char *)"-c", (char *)"configs/debug_sdm.cfg"};
    Config c;
    CHECK(cfg_from_args(&c, 3, argv, err), "load: %s", err);
    model_build(&g_model, &c);
    for (int i = 0; i < g_model.n_params; i++) {
        const ParamSpec *p = &g_model.params[i];
        if (p->numel > (1 << 22)) continue;
        float *v = (float *)sdm_malloc(sizeof(float) * p->numel);
        model_init_tensor(&g_model, i, 777, v);
        double sum = 0, sq = 0, mx = 0;
        for (long long k = 0; k < p->numel; k++) {
            sum += v[k];
            sq += (double)v[k] * v[k];
            mx = fmax(mx, fabs(v[k]));
        }
        double mean = sum / p->numel, std = sqrt(sq / p->numel - mean * mean);
        if (p->init == INIT_TRUNC_NORMAL && p->numel > 10000)
            // a normal truncated at 3 sigma has std 0.9866 sigma
            CHECK(fabs(std / (0.9866 * p->std) - 1) < 0.02 && mx <= p->bound, "%s: std %g (want %g), max %g", p->name,
                  std, 0.9866 * p->std, mx);
        if (p->init == INIT_ONES) CHECK(mean == 1 && std == 0, "%s not ones", p->name);
        if (p->init == INIT_ZEROS) CHECK(mx == 0, "%s not zeros", p->name);
        if (p->init == INIT_A_LOG) CHECK(mx <= log(16.0) + 1e-6, "%s: A_log out of range", p->name);
        if (p->init == INIT_DT_BIAS)
            for (long long k = 0; k < p->numel; k++) {
                double dt = log1p(exp(v[k]));
                CHECK(dt >= 0.001 * 0.999 && dt <= 0.1 * 1.001, "%s: softplus(dt_bias) = %g outside [1e-3, 0.1]",
                      p->name, dt);
            }
        free(v);
    }
}

// The threaded init of the whole storage equals tensor-by-tensor init, bit for bit, for any thread count.
static void test_init_threads(void) {
    char err[CFG_ERR];
    char *argv[] = {(char *)"test", (char *)"-c", (char *)"configs/debug_hybrid.cfg", (char *)"model.n_layers=2",
                    (char *)"model.attn_at=1", (char *)"model.swa_at=", (char *)"model.sdm_at=0"};
    Config c;
    CHECK(cfg_from_args(&c, 7, argv, err), "load: %s", err);
    model_build(&g_model, &c);
    size_t n = (size_t)g_model.storage;
    float *one = (float *)sdm_calloc(n, sizeof(float)), *many = (float *)sdm_malloc(sizeof(float) * n);
    for (int i = 0; i < g_model.n_params; i++) model_init_tensor(&g_model, i, 5, one + g_model.params[i].offset);
    for (int threads = 1; threads <= 3; threads += 2) {
        model_init_all(&g_model, 5, many, threads);
        CHECK(memcmp(one, many, sizeof(float) * n) == 0, "init on %d threads differs from tensor-by-tensor", threads);
    }
    free(one);
    free(many);
}

int main(void) {
    test_shipped_configs();
    test_dump_round_trip();
    test_errors();
    test_moment_dtype();
    test_edge_cases();
    test_sdm_description();
    test_init();
    test_init_threads();
    return test_summary();
}
