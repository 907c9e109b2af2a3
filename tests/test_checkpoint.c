// tests/test_checkpoint.c: checkpoint round trips, refusal of every corruption with a message (never a crash, never
// a silent wrong load), atomic replacement and keep-last-N.
#include "model/checkpoint.h"
#include "tests/test.h"

static ModelDesc g_model, g_loaded;
static const char *RUN = "build/test_ckpt_run";

typedef struct { uint64_t a, b; } LoaderRecord; // stands in for the dataloader's state record

static void build_model(Config *c) {
    char err[CFG_ERR];
    const char *text = "model.dim = 16\nmodel.n_layers = 2\nmodel.n_heads = 2\nmodel.vocab_size = 11\n"
                       "model.multiple_of = 16\nmodel.attn_at = 0\nmodel.sdm_at = 1\nsdm.slots_per_head = 16\n"
                       "sdm.num_writes = 2\nsdm.num_reads = 2\nsdm.output_gate = true\noptim.lr = 0.00123\n";
    cfg_defaults(c);
    if (!cfg_parse_text(c, text, "test", err) || !cfg_validate(c, err)) sdm_die("%s", err);
    model_build(&g_model, c);
}

static float *random_floats(size_t n, Rng *r) {
    float *v = (float *)sdm_malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) v[i] = (float)rng_normal(r);
    return v;
}

static int file_bytes(const char *path, uint8_t **data, size_t *n) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return 0;
    fseek(fp, 0, SEEK_END);
    *n = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    *data = (uint8_t *)sdm_malloc(*n);
    size_t got = fread(*data, 1, *n, fp);
    fclose(fp);
    return got == *n;
}

static void write_bytes(const char *path, const uint8_t *data, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp) sdm_die("cannot write %s", path);
    fwrite(data, 1, n, fp);
    fclose(fp);
}

static void test_round_trip(void) {
    Config c, c2;
    build_model(&c);
    Rng r = rng_make(3);
    size_t n = (size_t)g_model.storage;
    float *params = random_floats(n, &r), *m = random_floats(n, &r), *v = random_floats(n, &r);
    LoaderRecord rec = {123456789, 42};
    CkptTrainState s = {17, 0xABCDEFull, m, v, &rec, sizeof rec};
    char err[CKPT_ERR];
    CHECK(ckpt_save(RUN, &g_model, &c, params, &s, 2, err), "save: %s", err);

    char path[1024];
    float *loaded = NULL;
    uint64_t step = 0, rng = 0;
    snprintf(path, sizeof path, "%s/step_00000017/model.bin", RUN);
    CHECK(ckpt_load_model(path, &c2, &g_loaded, &loaded, &step, err), "load model: %s", err);
    CHECK(step == 17 && loaded && memcmp(loaded, params, 4 * n) == 0, "parameters differ after the round trip");
    CHECK(memcmp(&c, &c2, sizeof c) == 0, "config differs after the round trip");
    CHECK(g_loaded.storage == g_model.storage && g_loaded.n_params == g_model.n_params, "model description differs");
    float *m2 = (float *)sdm_malloc(4 * n), *v2 = (float *)sdm_malloc(4 * n);
    LoaderRecord rec2;
    snprintf(path, sizeof path, "%s/step_00000017/state.bin", RUN);
    CHECK(ckpt_load_state(path, n, m2, v2, &rec2, sizeof rec2, &step, &rng, err), "load state: %s", err);
    CHECK(!memcmp(m, m2, 4 * n) && !memcmp(v, v2, 4 * n) && !memcmp(&rec, &rec2, sizeof rec) && rng == 0xABCDEF,
          "optimizer or loader state differs after the round trip");
    free(loaded);
    free(params);
    free(m);
    free(v);
    free(m2);
    free(v2);
}

// Flip, overwrite and truncate bytes of real files: every variant is refused with a message naming the file.
static void test_corruption(void) {
    char path[1024], bad[1024], err[CKPT_ERR];
    snprintf(path, sizeof path, "%s/step_00000017/model.bin", RUN);
    snprintf(bad, sizeof bad, "%s/corrupt.bin", RUN);
    uint8_t *data;
    size_t n;
    if (!file_bytes(path, &data, &n)) { CHECK(0, "cannot read %s", path); return; }
    Rng r = rng_make(9);
    int refused = 0, trials = 600;
    for (int t = 0; t < trials; t++) {
        uint8_t *copy = (uint8_t *)sdm_malloc(n);
        memcpy(copy, data, n);
        size_t len = n;
        switch (t % 3) {
        case 0: copy[rng_below(&r, (uint32_t)n)] ^= (uint8_t)(1u << rng_below(&r, 8)); break;   // one bit
        case 1: copy[rng_below(&r, sizeof(CkptHeader))] = (uint8_t)rng_below(&r, 256) ^ 0x5A; break; // header byte
        default: len = rng_below(&r, (uint32_t)n); break;                                    // truncation
        }
        if (t % 3 == 1 && !memcmp(copy, data, n)) { free(copy); refused++; continue; } // byte unchanged by chance
        write_bytes(bad, copy, len);
        Config c;
        float *p = NULL;
        uint64_t step;
        err[0] = 0;
        int ok = ckpt_load_model(bad, &c, &g_loaded, &p, &step, err);
        if (!ok && strstr(err, bad) != NULL) refused++;
        else if (ok) printf("corruption %d (kind %d) was loaded\n", t, t % 3);
        free(p);
        free(copy);
    }
    free(data);
    CHECK(refused == trials, "%d of %d corrupted model files refused with a message", refused, trials);
    // a state file with another parameter count or corrupt payload
    snprintf(path, sizeof path, "%s/step_00000017/state.bin", RUN);
    if (file_bytes(path, &data, &n)) {
        float *m = (float *)sdm_malloc(4 * g_model.storage), *v = (float *)sdm_malloc(4 * g_model.storage);
        LoaderRecord rec;
        uint64_t step, rng;
        CHECK(!ckpt_load_state(path, g_model.storage + 1, m, v, &rec, sizeof rec, &step, &rng, err) &&
                  strstr(err, "optimizer state for"), "state of another model size accepted (%s)", err);
        data[n - 3] ^= 4;
        write_bytes(bad, data, n);
        CHECK(!ckpt_load_state(bad, g_model.storage, m, v, &rec, sizeof rec, &step, &rng, err) &&
                  strstr(err, "checksum mismatch"), "corrupt state accepted (%s)", err);
        free(m);
        free(v);
        free(data);
    }
    remove(bad);
}

// A crashed save (a .tmp folder) is ignored; the newest `keep` complete checkpoints survive.
static void test_atomic_and_keep(void) {
    Config c;
    build_model(&c);
    Rng r = rng_make(5);
    size_t n = (size_t)g_model.storage;
    float *params = random_floats(n, &r), *m = random_floats(n, &r), *v = random_floats(n, &r);
    LoaderRecord rec = {1, 2};
    char err[CKPT_ERR], path[1024];
    for (uint64_t step = 20; step <= 50; step += 10) {
        CkptTrainState s = {step, 7, m, v, &rec, sizeof rec};
        CHECK(ckpt_save(RUN, &g_model, &c, params, &s, 2, err), "save %llu: %s", (unsigned long long)step, err);
    }
    snprintf(path, sizeof path, "%s/step_00000060.tmp", RUN); // a save that died half way
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/step_00000070", RUN); // a folder without DONE
    mkdir(path, 0755);
    uint64_t steps[16];
    int count = ckpt_list(RUN, steps, 16);
    CHECK(count == 2 && steps[0] == 50 && steps[1] == 40, "kept %d checkpoints, newest %llu", count,
          count ? (unsigned long long)steps[0] : 0ull);
    ckpt_remove_dir(path);
    snprintf(path, sizeof path, "%s/step_00000060.tmp", RUN);
    ckpt_remove_dir(path);
    free(params);
    free(m);
    free(v);
}

static void cleanup(void) {
    uint64_t steps[64];
    char dir[1024];
    int n = ckpt_list(RUN, steps, 64);
    for (int i = 0; i < n; i++) {
        ckpt_step_dir(dir, sizeof dir, RUN, steps[i], "");
        ckpt_remove_dir(dir);
    }
    rmdir(RUN);
}

int main(void) {
    cleanup();
    test_round_trip();
    test_corruption();
    test_atomic_and_keep();
    cleanup();
    return test_summary();
}
