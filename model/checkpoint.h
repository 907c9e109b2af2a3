// model/checkpoint.h: checkpoints in a flat binary format, written atomically and verified on load.
//
// A checkpoint is a folder <run_dir>/step_<8 digits>/ holding
//   model.bin  header | resolved config text | tensor table | fp32 parameters in table order
//   state.bin  header | AdamW m | AdamW v (fp32, global table order: resumable on any number of GPUs) | loader state
//   DONE       written last: a folder without it is incomplete and ignored
// Every file carries a 64-bit checksum of all its bytes (body first, then the header with the checksum zeroed). A checkpoint is written into
// step_<n>.tmp/ (each file fsync'ed), then renamed into place, so a crash never leaves a half-written checkpoint
// under a valid name and never touches the last good one; older checkpoints are deleted only afterwards.
// infer_sdm needs model.bin alone: its config text rebuilds the model description.
#ifndef SDM_CORE_CHECKPOINT_H
#define SDM_CORE_CHECKPOINT_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/common.h"
#include "core/config.h"
#include "model/model.h"

#define CKPT_MODEL_MAGIC "SDMMODEL"
#define CKPT_STATE_MAGIC "SDMSTATE"
#define CKPT_VERSION 1
#define CKPT_ERR 768

// 128 bytes at the start of model.bin and state.bin
typedef struct {
    char magic[8];
    uint32_t version, header_bytes;
    uint64_t step;
    uint64_t checksum;      // of every byte after the header, then of this header with checksum = 0
    uint64_t body_bytes;    // bytes after the header
    uint64_t config_bytes;  // model.bin: resolved config text
    uint64_t n_tensors;     // model.bin: tensor table entries
    uint64_t n_params;      // fp32 values per parameter-sized array
    uint64_t rng_state;     // state.bin: the training RNG
    uint64_t loader_bytes;  // state.bin: size of the dataloader state record
    uint8_t reserved[48];
} CkptHeader;

typedef struct {
    char name[64];
    uint64_t shape[2];
    uint64_t offset, numel; // in fp32 values
} CkptTensor;

// 64-bit checksum over bytes, streaming: h = ckpt_hash(h, chunk) chunk after chunk (8-byte words, then the tail).
static inline uint64_t ckpt_hash(uint64_t h, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x100000001B3ull;
        h ^= h >> 29;
    }
    for (; n; n--, p++) h = (h ^ *p) * 0x100000001B3ull;
    return h;
}
#define CKPT_HASH_SEED 0xCBF29CE484222325ull

// The file checksum: the body's running hash continued over the header with its checksum field zeroed.
static inline uint64_t ckpt_file_checksum(uint64_t body_hash, const CkptHeader *h) {
    CkptHeader copy = *h;
    copy.checksum = 0;
    return ckpt_hash(body_hash, &copy, sizeof copy);
}

// ---- writing ----------------------------------------------------------------------------------------------------

typedef struct { FILE *fp; uint64_t hash, bytes; int failed; } CkptWriter;

static inline void ckpt_put(CkptWriter *w, const void *data, size_t n) {
    if (w->failed) return;
    if (fwrite(data, 1, n, w->fp) != n) { w->failed = 1; return; }
    w->hash = ckpt_hash(w->hash, data, n);
    w->bytes += n;
}

// Open path for writing with room for the header, which ckpt_finish writes once the body's checksum is known.
static inline int ckpt_begin(CkptWriter *w, const char *path, char *err) {
    memset(w, 0, sizeof *w);
    w->hash = CKPT_HASH_SEED;
    w->fp = fopen(path, "wb");
    CkptHeader blank;
    memset(&blank, 0, sizeof blank);
    if (!w->fp || fwrite(&blank, sizeof blank, 1, w->fp) != 1) {
        snprintf(err, CKPT_ERR, "%.300s: cannot write: %s", path, strerror(errno));
        if (w->fp) fclose(w->fp);
        return 0;
    }
    return 1;
}

static inline int ckpt_finish(CkptWriter *w, CkptHeader *h, const char *path, char *err) {
    h->version = CKPT_VERSION;
    h->header_bytes = sizeof(CkptHeader);
    h->body_bytes = w->bytes;
    h->checksum = ckpt_file_checksum(w->hash, h);
    int ok = !w->failed && fseek(w->fp, 0, SEEK_SET) == 0 && fwrite(h, sizeof *h, 1, w->fp) == 1 &&
             fflush(w->fp) == 0 && fsync(fileno(w->fp)) == 0;
    ok &= fclose(w->fp) == 0;
    if (!ok) snprintf(err, CKPT_ERR, "%.300s: write failed: %s", path, strerror(errno));
    return ok;
}

static inline int ckpt_write_model(const char *path, const ModelDesc *m, const Config *c, const float *params,
                                   uint64_t step, char *err) {
    CkptWriter w;
    if (!ckpt_begin(&w, path, err)) return 0;
    char *text = NULL;
    size_t text_len = 0;
    FILE *mem = open_memstream(&text, &text_len);
    if (!mem) sdm_die("out of memory for the config text");
    cfg_dump(c, mem);
    fclose(mem);
    ckpt_put(&w, text, text_len);
    for (int i = 0; i < m->n_params; i++) {
        CkptTensor t;
        memset(&t, 0, sizeof t);
        snprintf(t.name, sizeof t.name, "%s", m->params[i].name);
        t.shape[0] = (uint64_t)m->params[i].shape[0];
        t.shape[1] = (uint64_t)m->params[i].shape[1];
        t.offset = (uint64_t)m->params[i].offset;
        t.numel = (uint64_t)m->params[i].numel;
        ckpt_put(&w, &t, sizeof t);
    }
    ckpt_put(&w, params, sizeof(float) * (size_t)m->storage);
    CkptHeader h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, CKPT_MODEL_MAGIC, 8);
    h.step = step;
    h.config_bytes = text_len;
    h.n_tensors = (uint64_t)m->n_params;
    h.n_params = (uint64_t)m->storage;
    free(text);
    return ckpt_finish(&w, &h, path, err);
}

typedef struct {
    uint64_t step, rng_state;
    const float *adam_m, *adam_v; // [n_params] each, global order
    const void *loader;           // the dataloader's state record
    uint64_t loader_bytes;
} CkptTrainState;

static inline int ckpt_write_state(const char *path, uint64_t n_params, const CkptTrainState *s, char *err) {
    CkptWriter w;
    if (!ckpt_begin(&w, path, err)) return 0;
    ckpt_put(&w, s->adam_m, sizeof(float) * n_params);
    ckpt_put(&w, s->adam_v, sizeof(float) * n_params);
    ckpt_put(&w, s->loader, s->loader_bytes);
    CkptHeader h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, CKPT_STATE_MAGIC, 8);
    h.step = s->step;
    h.n_params = n_params;
    h.rng_state = s->rng_state;
    h.loader_bytes = s->loader_bytes;
    return ckpt_finish(&w, &h, path, err);
}

static inline int ckpt_fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY);
    if (fd < 0) return 0;
    int ok = fsync(fd) == 0;
    close(fd);
    return ok;
}

static inline void ckpt_step_dir(char *out, size_t size, const char *run_dir, uint64_t step, const char *suffix) {
    snprintf(out, size, "%s/step_%08llu%s", run_dir, (unsigned long long)step, suffix);
}

// Remove a checkpoint folder and the files this module writes into it.
static inline void ckpt_remove_dir(const char *dir) {
    const char *files[] = {"model.bin", "state.bin", "DONE"};
    char path[1024];
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%.900s/%s", dir, files[i]);
        remove(path);
    }
    rmdir(dir);
}

// Complete checkpoints in run_dir, newest first: steps[0..return) (at most max).
static inline int ckpt_list(const char *run_dir, uint64_t *steps, int max) {
    DIR *d = opendir(run_dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        unsigned long long step;
        char rest[8], done[1024];
        if (sscanf(e->d_name, "step_%8llu%7s", &step, rest) != 1 || strlen(e->d_name) != 13) continue;
        snprintf(done, sizeof done, "%.700s/%.32s/DONE", run_dir, e->d_name);
        if (access(done, F_OK) != 0 || n == max) continue;
        int i = n++;
        for (; i > 0 && steps[i - 1] < step; i--) steps[i] = steps[i - 1];
        steps[i] = step;
    }
    closedir(d);
    return n;
}

// Write step's checkpoint atomically, then keep only the newest `keep` complete checkpoints.
static inline int ckpt_save(const char *run_dir, const ModelDesc *m, const Config *c, const float *params,
                            const CkptTrainState *s, int keep, char *err) {
    char tmp[900], final_dir[900], path[1024];
    if (strlen(run_dir) > 800) { snprintf(err, CKPT_ERR, "run folder name longer than 800 characters"); return 0; }
    mkdir(run_dir, 0755);
    ckpt_step_dir(tmp, sizeof tmp, run_dir, s->step, ".tmp");
    ckpt_step_dir(final_dir, sizeof final_dir, run_dir, s->step, "");
    ckpt_remove_dir(tmp); // leftovers of a crashed earlier attempt
    if (mkdir(tmp, 0755) != 0) { snprintf(err, CKPT_ERR, "%.300s: cannot create: %s", tmp, strerror(errno)); return 0; }
    snprintf(path, sizeof path, "%s/model.bin", tmp);
    if (!ckpt_write_model(path, m, c, params, s->step, err)) return 0;
    snprintf(path, sizeof path, "%s/state.bin", tmp);
    if (!ckpt_write_state(path, (uint64_t)m->storage, s, err)) return 0;
    snprintf(path, sizeof path, "%s/DONE", tmp);
    FILE *fp = fopen(path, "w");
    if (!fp || fprintf(fp, "step %llu\n", (unsigned long long)s->step) < 0 || fflush(fp) != 0 || fsync(fileno(fp)) != 0) {
        snprintf(err, CKPT_ERR, "%.300s: cannot write", path);
        if (fp) fclose(fp);
        return 0;
    }
    fclose(fp);
    ckpt_fsync_dir(tmp);
    ckpt_remove_dir(final_dir); // a checkpoint of this very step (a re-run): replaced only now that its successor is whole
    if (rename(tmp, final_dir) != 0) {
        snprintf(err, CKPT_ERR, "%.300s: cannot rename to %.300s: %s", tmp, final_dir, strerror(errno));
        return 0;
    }
    ckpt_fsync_dir(run_dir);
    uint64_t steps[1024];
    int n = ckpt_list(run_dir, steps, 1024);
    for (int i = keep; i < n; i++) {
        ckpt_step_dir(final_dir, sizeof final_dir, run_dir, steps[i], "");
        ckpt_remove_dir(final_dir);
    }
    return 1;
}

// ---- reading ----------------------------------------------------------------------------------------------------

// Read and check a file's header against its size and magic; leaves fp positioned after the header.
static inline FILE *ckpt_open(const char *path, const char *magic, CkptHeader *h, char *err) {
    FILE *fp = fopen(path, "rb");
    if (!fp) { snprintf(err, CKPT_ERR, "%.300s: cannot open: %s", path, strerror(errno)); return NULL; }
    struct stat st;
    const char *why = NULL;
    if (fstat(fileno(fp), &st) != 0 || (uint64_t)st.st_size < sizeof *h || fread(h, sizeof *h, 1, fp) != 1)
        why = "shorter than its 128-byte header";
    else if (memcmp(h->magic, magic, 8) != 0) why = "wrong magic at offset 0 (not a checkpoint file of this kind)";
    else if (h->version != CKPT_VERSION) why = "unsupported version at offset 8";
    else if (h->header_bytes != sizeof *h) why = "wrong header size at offset 12";
    else if ((uint64_t)st.st_size != sizeof *h + h->body_bytes) why = "file size does not match its header (truncated?)";
    if (why) {
        snprintf(err, CKPT_ERR, "%.300s: %s", path, why);
        fclose(fp);
        return NULL;
    }
    return fp;
}

// Read n bytes at the current position, hashing them; names the offset when the file ends early.
static inline int ckpt_get(FILE *fp, void *dst, size_t n, uint64_t *hash, const char *path, char *err) {
    long off = ftell(fp);
    if (fread(dst, 1, n, fp) != n) {
        snprintf(err, CKPT_ERR, "%.300s: unexpected end of file reading %zu bytes at offset %ld", path, n, off);
        return 0;
    }
    *hash = ckpt_hash(*hash, dst, n);
    return 1;
}

// The config text and tensor table of a model.bin: rebuild the model description from the text (into c and m)
// and check that the table describes exactly that model.
static inline int ckpt_check_model(const char *path, char *text, const CkptTensor *table, uint64_t n_tensors,
                                   Config *c, ModelDesc *m, char *err) {
    char name[CKPT_ERR], msg[CFG_ERR];
    cfg_defaults(c);
    snprintf(name, sizeof name, "%.600s (config text)", path);
    if (!cfg_parse_text(c, text, name, msg)) { snprintf(err, CKPT_ERR, "%s", msg); return 0; }
    if (!cfg_validate(c, msg)) { snprintf(err, CKPT_ERR, "%.400s: stored config: %.300s", path, msg); return 0; }
    model_build(m, c);
    if ((uint64_t)m->n_params != n_tensors) {
        snprintf(err, CKPT_ERR, "%.300s: %llu tensors in the table, its config describes %d", path,
                 (unsigned long long)n_tensors, m->n_params);
        return 0;
    }
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        const CkptTensor *t = &table[i];
        if (strncmp(t->name, p->name, sizeof t->name) || t->shape[0] != (uint64_t)p->shape[0] ||
            t->shape[1] != (uint64_t)p->shape[1] || t->offset != (uint64_t)p->offset || t->numel != (uint64_t)p->numel) {
            snprintf(err, CKPT_ERR, "%.300s: tensor %d ('%.64s') does not match the model its config describes ('%s')",
                     path, i, t->name, p->name);
            return 0;
        }
    }
    return 1;
}

// Load model.bin: its config (into c), the model description rebuilt from it (into m, checked against the tensor
// table), and the parameters (*params, malloc'ed fp32 [m->storage]). Returns 0 with err naming the file and problem.
static inline int ckpt_load_model(const char *path, Config *c, ModelDesc *m, float **params, uint64_t *step,
                                  char *err) {
    CkptHeader h;
    FILE *fp = ckpt_open(path, CKPT_MODEL_MAGIC, &h, err);
    if (!fp) return 0;
    uint64_t hash = CKPT_HASH_SEED, body = h.body_bytes;
    *params = NULL;
    int ok = h.config_bytes <= body && h.n_tensors <= MODEL_MAX_PARAMS && h.n_params <= body / 4 &&
             h.config_bytes + sizeof(CkptTensor) * h.n_tensors + 4 * h.n_params == body;
    if (!ok) snprintf(err, CKPT_ERR, "%.300s: header sizes are inconsistent with the file", path);
    char *text = ok ? (char *)sdm_malloc(h.config_bytes + 1) : NULL;
    CkptTensor *table = ok ? (CkptTensor *)sdm_malloc(sizeof(CkptTensor) * (h.n_tensors + 1)) : NULL;
    ok = ok && ckpt_get(fp, text, h.config_bytes, &hash, path, err) &&
         ckpt_get(fp, table, sizeof(CkptTensor) * h.n_tensors, &hash, path, err);
    if (ok) {
        text[h.config_bytes] = 0;
        ok = ckpt_check_model(path, text, table, h.n_tensors, c, m, err);
    }
    if (ok && (uint64_t)m->storage != h.n_params) {
        snprintf(err, CKPT_ERR, "%.300s: %llu parameter values, its config describes %lld", path,
                 (unsigned long long)h.n_params, m->storage);
        ok = 0;
    }
    if (ok) {
        *params = (float *)sdm_malloc(sizeof(float) * (size_t)m->storage);
        ok = ckpt_get(fp, *params, sizeof(float) * (size_t)m->storage, &hash, path, err);
    }
    if (ok && ckpt_file_checksum(hash, &h) != h.checksum) {
        snprintf(err, CKPT_ERR, "%.300s: checksum mismatch (corrupt file)", path);
        ok = 0;
    }
    if (ok) *step = h.step;
    fclose(fp);
    free(text);
    free(table);
    if (!ok) { free(*params); *params = NULL; }
    return ok;
}

// Load state.bin for a model of n_params values: m and v (caller-allocated [n_params]) and the loader record
// (caller buffer of loader_bytes, which must equal the stored size).
static inline int ckpt_load_state(const char *path, uint64_t n_params, float *adam_m, float *adam_v, void *loader,
                                  uint64_t loader_bytes, uint64_t *step, uint64_t *rng_state, char *err) {
    CkptHeader h;
    FILE *fp = ckpt_open(path, CKPT_STATE_MAGIC, &h, err);
    if (!fp) return 0;
    uint64_t hash = CKPT_HASH_SEED;
    int ok = 0;
    if (h.n_params != n_params) {
        snprintf(err, CKPT_ERR, "%.300s: optimizer state for %llu values, the model has %llu", path,
                 (unsigned long long)h.n_params, (unsigned long long)n_params);
    } else if (h.loader_bytes != loader_bytes || h.body_bytes != 8 * n_params + loader_bytes) {
        snprintf(err, CKPT_ERR, "%.300s: dataloader record of %llu bytes, expected %llu", path,
                 (unsigned long long)h.loader_bytes, (unsigned long long)loader_bytes);
    } else if (ckpt_get(fp, adam_m, 4 * n_params, &hash, path, err) &&
               ckpt_get(fp, adam_v, 4 * n_params, &hash, path, err) &&
               ckpt_get(fp, loader, loader_bytes, &hash, path, err)) {
        if (ckpt_file_checksum(hash, &h) != h.checksum) snprintf(err, CKPT_ERR, "%.300s: checksum mismatch (corrupt file)", path);
        else ok = 1;
    }
    fclose(fp);
    *step = h.step;
    *rng_state = h.rng_state;
    return ok;
}

#endif
