// tests/test_checkpoint.c: checkpoint round trips; a fuzzer (random flips, overwrites, truncations, extensions of
// real model.bin and state.bin files must be refused with a message naming the file and an offset, never a crash
// under ASan, never a silent wrong load); atomic replacement and keep-last-N; the newest of many checkpoints; strict
// folder names; stale .tmp folders; refusal of non-finite values, of a full disk's half-written save, of a FIFO, of
// another architecture on resume; a resume over 3 loopback ranks that all receive rank 0's checkpoint.
//
//   build/test_checkpoint            the make-test budget (1200 fuzz cases)
//   build/test_checkpoint --fuzz N   N fuzz cases, for a long run by hand
//   build/test_checkpoint --save DIR only write a valid checkpoint of the test model into run folder DIR (for the
//                                    scripts that run the programs on it: tests/test_infer_args.sh)
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include "core/loopback.h"
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

// AdamW's v: |normal| (a second moment is never negative; ckpt_save refuses one that is)
static float *random_moments(size_t n, Rng *r) {
    float *v = (float *)sdm_malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) v[i] = (float)fabs(rng_normal(r));
    return v;
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
    float *params = random_floats(n, &r), *m = random_floats(n, &r), *v = random_moments(n, &r);
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
    CHECK(!ckpt_load_state(path, n + 1, m2, v2, &rec2, sizeof rec2, &step, &rng, err) &&
              strstr(err, "optimizer state for"), "state of another model size accepted (%s)", err);
    free(loaded);
    free(params);
    free(m);
    free(v);
    free(m2);
    free(v2);
}

// One random corruption of data [*n] in place (cap bytes of room): a bit flip, a random header byte, a run of random
// bytes, a truncation or an extension.
static void corrupt(Rng *r, uint8_t *data, size_t *n, size_t cap) {
    uint32_t kind = *n ? rng_below(r, 5) : 4, burst = 1 + rng_below(r, 16), extra = 1 + rng_below(r, 64);
    switch (kind) {
    case 0: data[rng_below(r, (uint32_t)*n)] ^= (uint8_t)(1u << rng_below(r, 8)); break;
    case 1: data[rng_below(r, sizeof(CkptHeader))] ^= (uint8_t)(1 + rng_below(r, 255)); break;
    case 2: {
        size_t at = rng_below(r, (uint32_t)*n), len = SDM_MIN(*n - at, (size_t)burst);
        for (size_t i = 0; i < len; i++) data[at + i] ^= (uint8_t)(1 + rng_below(r, 255));
        break;
    }
    case 3: *n = rng_below(r, (uint32_t)*n); break;
    default: {
        size_t room = SDM_MIN(cap - *n, (size_t)extra);
        for (size_t i = 0; i < room; i++) data[*n + i] = (uint8_t)rng_below(r, 256);
        *n += room;
    }
    }
}

// Fuzz model.bin and state.bin of step 17: every corrupted copy must be refused with the file's name and an offset.
static void test_fuzz(int cases) {
    const char *names[2] = {"model.bin", "state.bin"};
    char path[1024], bad[1024], err[CKPT_ERR];
    snprintf(bad, sizeof bad, "%s/corrupt.bin", RUN);
    Rng r = rng_make(9);
    int loaded = 0, unclear = 0, tried = 0;
    for (int k = 0; k < 2; k++) {
        uint8_t *data;
        size_t n;
        snprintf(path, sizeof path, "%s/step_00000017/%s", RUN, names[k]);
        if (!file_bytes(path, &data, &n)) { CHECK(0, "cannot read %s", path); return; }
        size_t cap = n + 64, storage = (size_t)g_model.storage;
        uint8_t *copy = (uint8_t *)sdm_malloc(cap);
        float *m = (float *)sdm_malloc(4 * storage), *v = (float *)sdm_malloc(4 * storage);
        for (int t = 0; t < cases / 2; t++) {
            size_t len = n;
            memcpy(copy, data, n);
            for (int rounds = 1 + (int)rng_below(&r, 3); rounds > 0; rounds--) corrupt(&r, copy, &len, cap);
            if (len == n && !memcmp(copy, data, n)) continue; // corruptions that cancelled out
            write_bytes(bad, copy, len);
            tried++;
            Config c;
            float *p = NULL;
            uint64_t step, rng;
            LoaderRecord rec;
            err[0] = 0;
            int ok = k == 0 ? ckpt_load_model(bad, &c, &g_loaded, &p, &step, err)
                            : ckpt_load_state(bad, storage, m, v, &rec, sizeof rec, &step, &rng, err);
            if (ok) printf("fuzz case %d of %s was loaded\n", t, names[k]);
            else if (!strstr(err, bad) || !strstr(err, "offset")) printf("fuzz case %d: unclear '%s'\n", t, err);
            loaded += ok;
            unclear += !ok && (!strstr(err, bad) || !strstr(err, "offset"));
            free(p);
        }
        free(copy);
        free(data);
        free(m);
        free(v);
    }
    printf("fuzz: %d corrupted files, %d loaded, %d refused without the file and an offset\n", tried, loaded, unclear);
    CHECK(tried > cases * 9 / 10 && loaded == 0 && unclear == 0, "fuzz: %d of %d loaded, %d unclear", loaded, tried,
          unclear);
    remove(bad);
}

// A crashed save (a .tmp folder) is ignored; the newest `keep` complete checkpoints survive.
// Found by tests/fuzz/fuzz_checkpoint.c's promise check: a file edited after it was written, its checksum recomputed
// (by hand, a tool or an attacker: the checksum catches corruption, not edits), loaded NaN parameters and moments
// and a negative AdamW v, which a resumed run would train on silently, and a config text with a NUL byte, whose rest
// the parser ignored. Each must be refused with the file and the offset (and a value's index); a finite edit still
// loads (the refusal is of the value, not of the edit).
static void edit_bytes_and_load(int state, size_t at, const void *bytes, size_t len, const char *want) {
    const char *names[2] = {"model.bin", "state.bin"};
    char path[1024], bad[1024], err[CKPT_ERR] = "";
    snprintf(path, sizeof path, "%s/step_00000017/%s", RUN, names[state]);
    snprintf(bad, sizeof bad, "%s/edited.bin", RUN);
    uint8_t *data;
    size_t n;
    if (!file_bytes(path, &data, &n)) { CHECK(0, "cannot read %s", path); return; }
    memcpy(data + at, bytes, len);
    CkptHeader h;
    memcpy(&h, data, sizeof h);
    h.checksum = ckpt_checksum_of(data, n);
    memcpy(data, &h, sizeof h);
    write_bytes(bad, data, n);
    free(data);
    size_t storage = (size_t)g_model.storage;
    float *p = NULL, *m = (float *)sdm_malloc(4 * storage), *v = (float *)sdm_malloc(4 * storage);
    uint64_t step, rng;
    LoaderRecord rec;
    Config c;
    int ok = state ? ckpt_load_state(bad, storage, m, v, &rec, sizeof rec, &step, &rng, err)
                   : ckpt_load_model(bad, &c, &g_loaded, &p, &step, err);
    char offset[64];
    snprintf(offset, sizeof offset, "at offset %zu", at);
    if (want) CHECK(!ok && strstr(err, bad) && strstr(err, offset) && strstr(err, want), "%s edited at %zu: %s",
                    names[state], at, ok ? "loaded" : err);
    else CHECK(ok, "%s edited at %zu: %s", names[state], at, err);
    free(p);
    free(m);
    free(v);
    remove(bad);
}

static void edit_and_load(int state, size_t at, float value, const char *want) {
    edit_bytes_and_load(state, at, &value, 4, want);
}

// ckpt_checksum_of, the format's checksum recomputed from a whole file by docs/FORMATS.md's parts, gives the checksum
// the writer stored (config text lengths that are not a multiple of 8 make the parts matter).
static void test_checksum_of(void) {
    const char *names[2] = {"model.bin", "state.bin"};
    for (int k = 0; k < 2; k++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/step_00000017/%s", RUN, names[k]);
        uint8_t *data;
        size_t n;
        if (!file_bytes(path, &data, &n)) { CHECK(0, "cannot read %s", path); continue; }
        CkptHeader h;
        memcpy(&h, data, sizeof h);
        CHECK(ckpt_checksum_of(data, n) == h.checksum, "%s: ckpt_checksum_of differs from the stored checksum", path);
        data[n - 1] ^= 1;
        CHECK(ckpt_checksum_of(data, n) != h.checksum, "%s: ckpt_checksum_of blind to the last byte", path);
        free(data);
    }
}

static void test_edited_values(void) {
    size_t n = (size_t)g_model.storage, params_at = 0;
    char path[1024];
    snprintf(path, sizeof path, "%s/step_00000017/model.bin", RUN);
    uint8_t *data;
    size_t bytes;
    if (!file_bytes(path, &data, &bytes)) { CHECK(0, "cannot read %s", path); return; }
    params_at = bytes - 4 * n; // the parameters end the file
    free(data);
    edit_and_load(0, params_at, NAN, "parameter 0 ");
    edit_and_load(0, bytes - 4, INFINITY, "non-finite");
    edit_and_load(0, params_at + 40, 1.5f, NULL);
    // a NUL in the config text: the parser stopped there and ignored the rest, here its last line's '\n'
    CkptHeader h;
    snprintf(path, sizeof path, "%s/step_00000017/model.bin", RUN);
    FILE *fp = fopen(path, "rb");
    CHECK(fp && fread(&h, sizeof h, 1, fp) == 1, "cannot read the header of %s", path);
    if (fp) fclose(fp);
    edit_bytes_and_load(0, sizeof h + h.config_bytes - 1, "", 1, "NUL byte in the config text");
    edit_bytes_and_load(0, sizeof h + 3, "", 1, "NUL byte in the config text");
    size_t m_at = sizeof(CkptHeader), v_at = m_at + 4 * n;
    edit_and_load(1, m_at + 12, NAN, "AdamW m 3 ");
    edit_and_load(1, v_at + 20, -1.0f, "negative second moment");
    edit_and_load(1, v_at + 24, -INFINITY, "AdamW v 6 ");
    edit_and_load(1, m_at + 8, -2.0f, NULL);  // m may be negative
    edit_and_load(1, v_at + 8, -0.0f, NULL);  // and v zero, of either sign
}

static void test_atomic_and_keep(void) {
    Config c;
    build_model(&c);
    Rng r = rng_make(5);
    size_t n = (size_t)g_model.storage;
    float *params = random_floats(n, &r), *m = random_floats(n, &r), *v = random_moments(n, &r);
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

// A folder with the three files of a checkpoint (empty: enough for listing).
static void make_fake_checkpoint(const char *run, const char *name, int with_model) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", run, name);
    mkdir(path, 0755);
    for (int i = 0; i < 3; i++) {
        if (!with_model && !strcmp(CKPT_FILES[i], "model.bin")) continue;
        snprintf(path, sizeof path, "%s/%s/%s", run, name, CKPT_FILES[i]);
        write_bytes(path, (const uint8_t *)"", 0);
    }
}

static void remove_tree(const char *dir) {
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) sdm_die("cannot remove %s", dir);
}

// 40 checkpoints created in random order: the newest is found, and ckpt_list's newest few are the right ones, for
// any max below the count (ckpt_list once kept the first max in directory order).
static void test_newest_of_many(void) {
    const char *run = "build/test_ckpt_many";
    remove_tree(run);
    mkdir(run, 0755);
    uint64_t order[40], steps[5];
    for (int i = 0; i < 40; i++) order[i] = 100 * (uint64_t)(i + 1);
    Rng r = rng_make(11);
    for (int i = 39; i > 0; i--) {
        int j = (int)rng_below(&r, (uint32_t)i + 1);
        uint64_t t = order[i];
        order[i] = order[j], order[j] = t;
    }
    char name[64];
    for (int i = 0; i < 40; i++) {
        snprintf(name, sizeof name, "step_%08llu", (unsigned long long)order[i]);
        make_fake_checkpoint(run, name, 1);
    }
    uint64_t newest = 0;
    CHECK(ckpt_newest(run, &newest) && newest == 4000, "newest of 40: %llu, want 4000", (unsigned long long)newest);
    int count = ckpt_list(run, steps, 5);
    int sorted = count == 40;
    for (int i = 0; i < 5; i++) sorted &= steps[i] == 4000 - 100 * (uint64_t)i;
    CHECK(sorted, "ckpt_list(max 5) of 40: count %d, steps %llu %llu ... (want 40; 4000 3900 ...)", count,
          (unsigned long long)steps[0], (unsigned long long)steps[1]);
    remove_tree(run);
}

// Only step_ + exactly 8 digits with DONE, model.bin and state.bin is a checkpoint: no sign, space, 7 or 9 digits,
// suffix; and not a folder whose model.bin is gone (a kill while an older pruning removed files before DONE).
static void test_strict_names(void) {
    const char *run = "build/test_ckpt_names";
    const char *fake[] = {"step_-0000001", "step_+0000100", "step_ 0000100", "step_0000100", "step_000000100",
                          "step_00000100x", "step_0000010a"};
    remove_tree(run);
    mkdir(run, 0755);
    for (size_t i = 0; i < sizeof fake / sizeof fake[0]; i++) make_fake_checkpoint(run, fake[i], 1);
    make_fake_checkpoint(run, "step_00000200", 0); // DONE and state.bin, no model.bin
    make_fake_checkpoint(run, "step_00000005", 1);
    uint64_t steps[8];
    int count = ckpt_list(run, steps, 8);
    CHECK(count == 1 && steps[0] == 5, "%d checkpoints listed, newest %llu (want only step 5)", count,
          count ? (unsigned long long)steps[0] : 0ull);
    remove_tree(run);
}

// ckpt_prepare_run_dir makes missing parents, removes only our stale step_<8 digits>.tmp folders, and refuses a run
// folder that is a file or lies under one, naming it.
static void test_run_dir(void) {
    const char *base = "build/test_ckpt_dir", *run = "build/test_ckpt_dir/a/b";
    char err[CKPT_ERR], path[1024];
    remove_tree(base);
    CHECK(ckpt_prepare_run_dir(run, err), "nested run folder not made: %s", err);
    make_fake_checkpoint(run, "step_00000060.tmp", 1);
    const char *not_ours[] = {"step_0000060.tmp", "step_00000060.tmpx", "step_-0000060.tmp", "other.tmp"};
    for (int i = 0; i < 4; i++) make_fake_checkpoint(run, not_ours[i], 1);
    CHECK(ckpt_prepare_run_dir(run, err), "existing run folder refused: %s", err);
    snprintf(path, sizeof path, "%s/step_00000060.tmp", run);
    CHECK(access(path, F_OK) != 0, "stale %s not removed", path);
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s/DONE", run, not_ours[i]);
        CHECK(access(path, F_OK) == 0, "%s removed: not ours", path);
    }
    snprintf(path, sizeof path, "%s/file", base);
    write_bytes(path, (const uint8_t *)"x", 1);
    CHECK(!ckpt_prepare_run_dir(path, err) && strstr(err, path) && strstr(err, "not a folder"),
          "a file as run folder: '%s'", err);
    snprintf(path, sizeof path, "%s/file/run", base);
    CHECK(!ckpt_prepare_run_dir(path, err) && strstr(err, "cannot create"), "a run folder under a file: '%s'", err);
    remove_tree(base);
}

// ckpt_save refuses NaN or inf in the parameters or moments, naming the step, tensor and index; nothing is written.
static void test_nonfinite(void) {
    const char *run = "build/test_ckpt_nan";
    remove_tree(run);
    Config c;
    build_model(&c);
    size_t n = (size_t)g_model.storage;
    float *p = (float *)sdm_calloc(n, 4), *m = (float *)sdm_calloc(n, 4), *v = (float *)sdm_calloc(n, 4);
    LoaderRecord rec = {1, 2};
    CkptTrainState s = {9, 0, m, v, &rec, sizeof rec};
    char err[CKPT_ERR], want[128];
    const ParamSpec *t = &g_model.params[1];
    p[t->offset + 3] = NAN;
    snprintf(want, sizeof want, "parameter %s[3] is nan", t->name);
    CHECK(!ckpt_save(run, &g_model, &c, p, &s, 2, err) && strstr(err, want) && strstr(err, "step 9"),
          "NaN parameter: '%s' (want '%s')", err, want);
    p[t->offset + 3] = 0;
    v[n - 1] = INFINITY;
    CHECK(!ckpt_save(run, &g_model, &c, p, &s, 2, err) && strstr(err, "AdamW v of") && strstr(err, "inf"),
          "infinite moment: '%s'", err);
    v[n - 1] = -1e-3f; // a load refuses a negative v (test_edited_values), so a save must never write one
    CHECK(!ckpt_save(run, &g_model, &c, p, &s, 2, err) && strstr(err, "AdamW v of") && strstr(err, "negative"),
          "negative second moment: '%s'", err);
    uint64_t step;
    CHECK(!ckpt_newest(run, &step) && access("build/test_ckpt_nan/step_00000009.tmp", F_OK) != 0,
          "a refused save left a checkpoint or a .tmp folder");
    remove_tree(run);
    free(p);
    free(m);
    free(v);
}

// A save that runs out of room (a file size limit stands in for a full disk) fails with a message, removes its
// .tmp folder and leaves the previous checkpoint complete.
static void test_disk_full(void) {
    const char *run = "build/test_ckpt_full";
    remove_tree(run);
    Config c;
    build_model(&c);
    size_t n = (size_t)g_model.storage;
    float *zero = (float *)sdm_calloc(n, 4);
    LoaderRecord rec = {1, 2};
    CkptTrainState s = {1, 0, zero, zero, &rec, sizeof rec};
    char err[CKPT_ERR];
    CHECK(ckpt_save(run, &g_model, &c, zero, &s, 2, err), "save: %s", err);
    struct rlimit old, small;
    getrlimit(RLIMIT_FSIZE, &old);
    small = old;
    small.rlim_cur = 4096;
    signal(SIGXFSZ, SIG_IGN); // a write past the limit then fails with EFBIG instead of killing the process
    setrlimit(RLIMIT_FSIZE, &small);
    s.step = 2;
    int ok = ckpt_save(run, &g_model, &c, zero, &s, 2, err);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, SIG_DFL);
    uint64_t steps[4];
    CHECK(!ok && strstr(err, "step_00000002.tmp/model.bin"), "a save past the size limit: ok %d, '%s'", ok, err);
    CHECK(access("build/test_ckpt_full/step_00000002.tmp", F_OK) != 0, "the failed save left its .tmp folder");
    CHECK(ckpt_list(run, steps, 4) == 1 && steps[0] == 1, "the previous checkpoint is not intact");
    remove_tree(run);
    free(zero);
}

// A FIFO or a folder given as a checkpoint file is refused at once (opening a FIFO for reading used to block).
static void test_not_regular(void) {
    const char *fifo = "build/test_ckpt_fifo";
    char err[CKPT_ERR];
    remove(fifo);
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s: %s", fifo, strerror(errno));
    alarm(20); // the old code blocks forever in open(): fail by SIGALRM instead of hanging make test
    Config c;
    float *p = NULL;
    uint64_t step;
    CHECK(!ckpt_load_model(fifo, &c, &g_loaded, &p, &step, err) && strstr(err, fifo) && strstr(err, "not a regular"),
          "FIFO as model.bin: '%s'", err);
    CHECK(!ckpt_load_model("build", &c, &g_loaded, &p, &step, err) && strstr(err, "not a regular"),
          "folder as model.bin: '%s'", err);
    alarm(0);
    remove(fifo);
}

// Resuming under another architecture is refused, naming each differing key with both values; changes of other
// keys (learning rate, chunk size, precision) are accepted and the state comes back.
static void test_architecture(void) {
    const char *run = "build/test_ckpt_arch";
    remove_tree(run);
    Config c;
    build_model(&c);
    size_t n = (size_t)g_model.storage;
    Rng r = rng_make(4);
    float *p = random_floats(n, &r), *m = random_floats(n, &r), *v = random_moments(n, &r);
    LoaderRecord rec = {5, 6}, back;
    CkptTrainState s = {30, 77, m, v, &rec, sizeof rec};
    char err[CKPT_ERR], dir[256];
    CHECK(ckpt_save(run, &g_model, &c, p, &s, 2, err), "save: %s", err);
    snprintf(dir, sizeof dir, "%s/step_00000030", run);
    struct { const char *lines[3], *want; } cases[] = {
        {{"model.attn_at = 1", "model.sdm_at = 0", NULL}, "model.attn_at: saved 0 vs requested 1"},
        {{"model.n_heads = 1", NULL, NULL}, "model.n_heads: saved 2 vs requested 1"},
        {{"model.rope_theta = 500000", NULL, NULL}, "model.rope_theta: saved 10000 vs requested 500000"},
        {{"sdm.num_writes = 3", NULL, NULL}, "sdm.num_writes: saved 2 vs requested 3"},
        {{"optim.lr = 1", "sdm.chunk_size = 16", "distributed.model_dtype = fp32"}, NULL},
    };
    ModelDesc *wm = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        Config want = c;
        for (int i = 0; i < 3 && cases[k].lines[i]; i++)
            if (!cfg_apply_line(&want, cases[k].lines[i], "test", err)) sdm_die("%s", err);
        if (!cfg_validate(&want, err)) sdm_die("case %zu: %s", k, err);
        model_build(wm, &want);
        CkptResume res;
        memset(&res, 0, sizeof res);
        int ok = ckpt_load_resume(dir, &want, wm, &back, sizeof back, &res, err);
        if (cases[k].want)
            CHECK(!ok && strstr(err, cases[k].want) && strstr(err, "model.bin"), "%s: '%s' (want '%s')",
                  cases[k].lines[0], err, cases[k].want);
        else
            CHECK(ok && !memcmp(res.params, p, 4 * n) && !memcmp(res.adam_v, v, 4 * n) && res.rng_state == 77 &&
                      !memcmp(&back, &rec, sizeof rec), "resume with other non-architecture keys: %s", ok ? "" : err);
        ckpt_resume_free(&res);
    }
    free(wm);
    remove_tree(run);
    free(p);
    free(m);
    free(v);
}

// ---- resume over ranks: 3 loopback ranks (threads), each with its own run folder ---------------------------------

#define RANKS 3
static const char *RANK_BASE = "build/test_ckpt_ranks";

typedef struct {
    LoopComm comm;
    const Config *cfg; // of g_model, built before the threads start
    char run[256], err[CKPT_ERR];
    int ok;
    CkptResume res;
    LoaderRecord rec;
    size_t piece_bytes; // the resume's broadcast pieces (0: CKPT_PIECE_BYTES)
    float *whole;       // [storage]: the parameters as the sink received them, piece by piece
    long long next;     // where the next piece must start (the sink checks the pieces are consecutive)
    int pieces, bad_pieces;
} RankRun;

// The sink of a resume: the whole parameters, piece by piece, in order.
static void take_params(void *ctx, long long lo, long long hi, const float *x) {
    RankRun *rr = (RankRun *)ctx;
    rr->pieces++;
    rr->bad_pieces += lo != rr->next || hi <= lo || hi > g_model.storage;
    if (lo == rr->next && hi > lo && hi <= g_model.storage) memcpy(rr->whole + lo, x, 4 * (size_t)(hi - lo));
    rr->next = hi;
}

static void loop_broadcast0(void *ctx, void *buf, size_t bytes) { loop_broadcast((LoopComm *)ctx, buf, bytes, 0); }
static void loop_sum_floats(void *ctx, float *x, size_t n) { loop_all_reduce_sum((LoopComm *)ctx, x, n); }

static void *rank_resume(void *arg) {
    RankRun *rr = (RankRun *)arg;
    CkptComm comm = {rr->comm.rank, rr->comm.world, &rr->comm, loop_broadcast0, loop_sum_floats, rr->piece_bytes};
    CkptSink sink = {rr, take_params};
    free(rr->whole);
    rr->whole = (float *)sdm_calloc((size_t)g_model.storage, 4);
    rr->next = 0;
    rr->pieces = rr->bad_pieces = 0;
    rr->ok = ckpt_resume_all_ranks(rr->run, rr->cfg, &g_model, &rr->rec, sizeof rr->rec, &comm, &sink, &rr->res,
                                   rr->err);
    return NULL;
}

// Every rank resumes from its folder with the test model's config; rank 1 with `rank1` instead when not NULL.
static void resume_ranks(RankRun *rr, int world, const Config *rank1) {
    Config c;
    build_model(&c);
    LoopGroup group;
    loop_group_init(&group, world);
    pthread_t th[RANKS];
    for (int q = 0; q < world; q++) {
        rr[q].comm = loop_comm(&group, q, 1);
        rr[q].cfg = q == 1 && rank1 ? rank1 : &c;
        rr[q].err[0] = 0;
        pthread_create(&th[q], NULL, rank_resume, &rr[q]);
    }
    for (int q = 0; q < world; q++) pthread_join(th[q], NULL);
    loop_group_destroy(&group);
}

// Save step's checkpoint with parameters filled with x into rank q's run folder.
static void save_rank(RankRun *rr, int q, uint64_t step, float x) {
    Config c;
    build_model(&c);
    size_t n = (size_t)g_model.storage;
    float *p = (float *)sdm_malloc(4 * n);
    for (size_t i = 0; i < n; i++) p[i] = x;
    LoaderRecord rec = {step, 3};
    CkptTrainState s = {step, 1, p, p, &rec, sizeof rec};
    char err[CKPT_ERR];
    if (!ckpt_save(rr[q].run, &g_model, &c, p, &s, 5, err)) sdm_die("%s", err);
    free(p);
}

// Rank 0 saves distinct random parameters and moments; a resume over `world` ranks in pieces of piece_bytes leaves
// each rank exactly its shard of the parameters and moments (core/shard.h shard_range), shard-sized arrays and no
// more host memory than its shards and one piece (rank 0: the whole arrays it loads), and every rank the whole
// parameters through the sink, in consecutive pieces.
static void check_resume_shards(RankRun *rr, int world, size_t piece_bytes, const float *p, const float *m,
                                const float *v) {
    long long n = g_model.storage;
    for (int q = 0; q < world; q++) rr[q].piece_bytes = piece_bytes;
    resume_ranks(rr, world, NULL);
    size_t piece = piece_bytes ? piece_bytes : CKPT_PIECE_BYTES;
    long long want_pieces = (4 * n + (long long)piece - 1) / (long long)piece;
    for (int q = 0; q < world; q++) {
        CkptResume *res = &rr[q].res;
        long long lo, hi;
        shard_range(n, world, q, &lo, &hi);
        size_t keep = 4 * (size_t)(hi - lo);
        CHECK(rr[q].ok && res->id.step == 40 && rr[q].rec.a == 40, "world %d piece %zu rank %d: %s", world,
              piece_bytes, q, rr[q].err);
        if (!rr[q].ok) continue;
        CHECK(res->lo == lo && res->hi == hi, "world %d rank %d: keeps [%lld, %lld), its shard is [%lld, %lld)",
              world, q, res->lo, res->hi, lo, hi);
        CHECK(!memcmp(res->params, p + lo, keep) && !memcmp(res->adam_m, m + lo, keep) &&
                  !memcmp(res->adam_v, v + lo, keep) && res->rng_state == 1,
              "world %d piece %zu rank %d: its shard of the parameters or moments differs from the saved one", world,
              piece_bytes, q);
        CHECK(!memcmp(rr[q].whole, p, 4 * (size_t)n) && rr[q].pieces == want_pieces && !rr[q].bad_pieces &&
                  rr[q].next == n,
              "world %d piece %zu rank %d: the sink got %d pieces (%lld expected, %d out of order, up to %lld of "
              "%lld) or other parameters", world, piece_bytes, q, rr[q].pieces, want_pieces, rr[q].bad_pieces,
              rr[q].next, n);
        if (q == 0 || world == 1) {
            CHECK(res->host_bytes == 12 * (size_t)n, "world %d rank %d: host_bytes %zu, want %zu", world, q,
                  res->host_bytes, 12 * (size_t)n);
        } else {
            size_t want = 3 * keep + (piece < 4 * (size_t)n ? piece : 4 * (size_t)n);
            CHECK(res->host_bytes == want && want < 12 * (size_t)n,
                  "world %d rank %d: host_bytes %zu, want %zu (shards and one piece, below the whole %zu)", world, q,
                  res->host_bytes, want, 12 * (size_t)n);
        }
        if (world > 1) // the arrays it returns are shard-sized (the allocator's rounding aside)
            CHECK(malloc_usable_size(res->params) < keep + 64 && malloc_usable_size(res->adam_m) < keep + 64 &&
                      malloc_usable_size(res->adam_v) < keep + 64,
                  "world %d rank %d: arrays of %zu, %zu, %zu bytes for a shard of %zu", world, q,
                  malloc_usable_size(res->params), malloc_usable_size(res->adam_m),
                  malloc_usable_size(res->adam_v), keep);
        ckpt_resume_free(res);
    }
    for (int q = 0; q < world; q++) rr[q].piece_bytes = 0;
}

static void test_resume_shards(RankRun *rr) {
    Config c;
    build_model(&c);
    size_t n = (size_t)g_model.storage;
    Rng r = rng_make(9);
    float *p = random_floats(n, &r), *m = random_floats(n, &r), *v = random_moments(n, &r);
    LoaderRecord rec = {40, 3};
    CkptTrainState s = {40, 1, m, v, &rec, sizeof rec};
    char err[CKPT_ERR];
    if (!ckpt_save(rr[0].run, &g_model, &c, p, &s, 5, err)) sdm_die("%s", err);
    // pieces: whole (the default 256 MiB), a few values (crossing shard boundaries mid-piece), 1 value, and 4n / 3
    // rounded down to whole values (a last piece shorter than the others)
    size_t pieces[] = {0, 4 * 37, 4, 4 * n / 3 / 4 * 4, 4 * n, 4 * n + 4};
    for (int world = 1; world <= RANKS; world++)
        for (size_t k = 0; k < sizeof pieces / sizeof pieces[0]; k++) check_resume_shards(rr, world, pieces[k], p, m, v);
    free(p);
    free(m);
    free(v);
}

static void test_resume_ranks(void) {
    RankRun rr[RANKS];
    memset(rr, 0, sizeof rr);
    remove_tree(RANK_BASE);
    mkdir(RANK_BASE, 0755);
    for (int q = 0; q < RANKS; q++) snprintf(rr[q].run, sizeof rr[q].run, "%s/rank%d", RANK_BASE, q);

    // rank 0 has no checkpoint: every rank starts afresh, whatever the others hold
    save_rank(rr, 1, 10, 1.0f);
    resume_ranks(rr, RANKS, NULL);
    for (int q = 0; q < RANKS; q++)
        CHECK(rr[q].ok && !rr[q].res.id.found, "rank %d: rank 0 has none, got ok %d found %d (%s)", q, rr[q].ok,
              (int)rr[q].res.id.found, rr[q].err);

    // rank 0 holds steps 10 and 20, rank 1 another step 20, rank 2 nothing: every rank resumes from rank 0's step 20,
    // its bytes and its loader record (the other folders are never read)
    save_rank(rr, 0, 10, 1.0f);
    save_rank(rr, 0, 20, 2.0f);
    save_rank(rr, 1, 20, 3.0f);
    resume_ranks(rr, RANKS, NULL);
    for (int q = 0; q < RANKS; q++) {
        CHECK(rr[q].ok && rr[q].res.id.step == 20 && rr[q].res.params[0] == 2.0f && rr[q].res.adam_v[0] == 2.0f &&
                  rr[q].rec.a == 20,
              "rank %d: not resumed from rank 0's step 20 (ok %d, %s)", q, rr[q].ok, rr[q].err);
        ckpt_resume_free(&rr[q].res);
    }

    // rank 1 configured for another architecture (rope_theta): every rank stops, naming rank 1 and the key
    Config other;
    build_model(&other);
    other.rope_theta *= 2;
    resume_ranks(rr, RANKS, &other);
    CHECK(!rr[1].ok && strstr(rr[1].err, "rank 1 is configured for another model") && strstr(rr[1].err, "rope_theta"),
          "rank 1 with another architecture: '%s'", rr[1].err);
    for (int q = 0; q < RANKS; q += 2)
        CHECK(!rr[q].ok && strstr(rr[q].err, "rank 1 is configured for another model"), "rank %d: '%s'", q, rr[q].err);

    // rank 1 configured for another run (steps, seed: its collectives or its initial weights would differ from the
    // others'): every rank stops, naming rank 1 and the keys, before anything is sent
    build_model(&other);
    other.steps += 1;
    other.seed += 1;
    resume_ranks(rr, RANKS, &other);
    CHECK(!rr[1].ok && strstr(rr[1].err, "rank 1 is configured for another run") && strstr(rr[1].err, "steps:") &&
              strstr(rr[1].err, "seed:") && !strstr(rr[1].err, "run_dir: "),
          "rank 1 with other run settings: '%s'", rr[1].err);
    for (int q = 0; q < RANKS; q += 2)
        CHECK(!rr[q].ok && strstr(rr[q].err, "rank 1 is configured for another run"), "rank %d: '%s'", q, rr[q].err);
    // per-rank keys (run_dir, data paths, logging) may differ: every rank resumes from rank 0's step 20
    build_model(&other);
    snprintf(other.run_dir, sizeof other.run_dir, "elsewhere");
    snprintf(other.train_data, sizeof other.train_data, "/local/copy/train_*.bin");
    other.log_freq += 1;
    resume_ranks(rr, RANKS, &other);
    for (int q = 0; q < RANKS; q++) {
        CHECK(rr[q].ok && rr[q].res.id.step == 20, "rank %d with rank 1's per-rank keys changed: %s", q, rr[q].err);
        ckpt_resume_free(&rr[q].res);
    }

    // rank 0's newest checkpoint is corrupt: every rank stops, naming rank 0 and the file
    char path[600];
    snprintf(path, sizeof path, "%s/step_00000020/state.bin", rr[0].run);
    CHECK(truncate(path, 200) == 0, "truncate %s", path);
    resume_ranks(rr, RANKS, NULL);
    CHECK(!rr[0].ok && strstr(rr[0].err, "rank 0 cannot load the checkpoint") && strstr(rr[0].err, "state.bin"),
          "rank 0 with a corrupt checkpoint: '%s'", rr[0].err);
    for (int q = 1; q < RANKS; q++)
        CHECK(!rr[q].ok && strstr(rr[q].err, "rank 0 cannot load"), "rank %d: '%s'", q, rr[q].err);
    save_rank(rr, 0, 20, 2.0f);

    // one process (world 1): the same path with collectives that do nothing
    resume_ranks(rr, 1, NULL);
    CHECK(rr[0].ok && rr[0].res.id.step == 20, "world 1: %s", rr[0].err);
    ckpt_resume_free(&rr[0].res);
    test_resume_shards(rr);
    for (int q = 0; q < RANKS; q++) free(rr[q].whole);
    remove_tree(RANK_BASE);
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

// A checkpoint of the test model with the bytes tokenizer's vocabulary, at step 17, in run folder dir.
static void save_example(const char *dir) {
    Config c;
    char err[CKPT_ERR];
    build_model(&c);
    if (!cfg_apply_line(&c, "model.vocab_size = 258", "test", err)) sdm_die("%s", err);
    model_build(&g_model, &c);
    size_t n = (size_t)g_model.storage;
    Rng r = rng_make(3);
    float *p = random_floats(n, &r), *zero = (float *)sdm_calloc(n, 4);
    LoaderRecord rec = {1, 2};
    CkptTrainState s = {17, 0, zero, zero, &rec, sizeof rec};
    if (!ckpt_save(dir, &g_model, &c, p, &s, 1, err)) sdm_die("%s", err);
    free(p);
    free(zero);
}

int main(int argc, char **argv) {
    int cases = 1200;
    if (argc == 3 && !strcmp(argv[1], "--save")) { save_example(argv[2]); return 0; }
    if (argc == 3 && !strcmp(argv[1], "--fuzz")) cases = atoi(argv[2]);
    else if (argc != 1) sdm_die("usage: %s [--fuzz CASES | --save DIR]", argv[0]);
    cleanup();
    test_round_trip();
    test_fuzz(cases);
    test_checksum_of();
    test_edited_values();
    test_atomic_and_keep();
    test_newest_of_many();
    test_strict_names();
    test_run_dir();
    test_nonfinite();
    test_disk_full();
    test_not_regular();
    test_architecture();
    test_resume_ranks();
    cleanup();
    return test_summary();
}
