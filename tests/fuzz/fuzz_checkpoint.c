// tests/fuzz/fuzz_checkpoint.c: model/checkpoint.h's loaders on a file of the fuzzer's bytes. The first byte:
//   bit 0: 0 = model.bin (ckpt_load_model), 1 = state.bin (ckpt_load_state, then the loader record through
//          dataloader_set_state, as train_sdm resumes)
//   bit 1: recompute the header's checksum before writing the file (so mutations reach past the checksum, the way a
//          hand-made or maliciously edited file would)
//   bit 2: set body_bytes to the file's size - 128 first (the same, for the size check)
// Promises checked: a refusal names the file and an offset (tests/test_checkpoint.c's rule); an accepted model.bin
// holds exactly the model its config describes, a config text without NUL bytes, every parameter finite; an accepted state.bin holds finite moments,
// v >= 0.
#include <math.h>

#include "data/dataloader.h"
#include "model/checkpoint.h"
#include "tests/fuzz/fuzz.h"

#define FUZZ_MAX_PARAMS (1u << 20) // a state.bin's n_params taken as the model's when at most this

static ModelDesc g_model;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int flags = data[0];
    size_t n = size - 1;
    uint8_t *file = (uint8_t *)malloc(n ? n : 1);
    if (n) memcpy(file, data + 1, n);
    CkptHeader h;
    if (n >= sizeof h) {
        memcpy(&h, file, sizeof h);
        if (flags & 4) h.body_bytes = n - sizeof h;
        memcpy(file, &h, sizeof h);
        if (flags & 2) h.checksum = ckpt_checksum_of(file, n);
        memcpy(file, &h, sizeof h);
    }
    const char *path = fuzz_path("ckpt.bin");
    fuzz_write_file(path, file, n);
    char err[CKPT_ERR] = "";
    uint64_t step = 0;
    if (!(flags & 1)) {
        Config c;
        float *params = NULL;
        if (ckpt_load_model(path, &c, &g_model, &params, &step, err)) {
            FUZZ_ASSERT(n == sizeof h + h.body_bytes && h.n_params == (uint64_t)g_model.storage,
                        "model.bin accepted with sizes that do not match its model");
            FUZZ_ASSERT(!memchr(file + sizeof h, 0, h.config_bytes), "model.bin accepted with a NUL in its config");
            for (long long i = 0; i < g_model.storage; i++)
                FUZZ_ASSERT(isfinite(params[i]), "model.bin accepted with parameter %lld = %g", i, params[i]);
            free(params);
        } else {
            FUZZ_ASSERT(strstr(err, path) && strstr(err, "offset"), "refusal without the file and an offset: '%s'",
                        err);
            FUZZ_ASSERT(!params, "params left allocated after a refusal");
        }
    } else {
        uint64_t want = n >= sizeof h && h.n_params <= FUZZ_MAX_PARAMS ? h.n_params : 1000, rng = 0;
        float *m = (float *)malloc(4 * want + 4), *v = (float *)malloc(4 * want + 4);
        DataLoaderState rec;
        if (ckpt_load_state(path, want, m, v, &rec, sizeof rec, &step, &rng, err)) {
            for (uint64_t i = 0; i < want; i++)
                FUZZ_ASSERT(isfinite(m[i]) && isfinite(v[i]) && v[i] >= 0,
                            "state.bin accepted with AdamW m[%llu] = %g, v = %g", (unsigned long long)i, m[i], v[i]);
            DataLoader dl;
            memset(&dl, 0, sizeof dl);
            dl.T = 16;
            dl.shuffle = 1;
            dl.total_rows = 1000;
            if (dataloader_set_state(&dl, &rec, err) == 0)
                FUZZ_ASSERT(dl.position <= dl.total_rows, "loader state beyond its rows");
        } else {
            FUZZ_ASSERT(strstr(err, path) && strstr(err, "offset"), "refusal without the file and an offset: '%s'",
                        err);
        }
        free(m);
        free(v);
    }
    free(file);
    return 0;
}
