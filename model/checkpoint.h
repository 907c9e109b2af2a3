// model/checkpoint.h: checkpoints in a flat binary format, written atomically and verified on load.
//
// A checkpoint is a folder <run_dir>/step_<8 digits>/ holding
//   model.bin  header | resolved config text | tensor table | fp32 parameters in table order
//   state.bin  header | AdamW m | AdamW v (fp32, global table order: resumable on any number of GPUs) | loader state
//   DONE       written last: a folder without it is incomplete and ignored
// Every file carries a 64-bit checksum of all its bytes (body first, then the header with the checksum zeroed). A
// checkpoint is written into step_<n>.tmp/ (each file fsync'ed), then renamed into place, so a crash never leaves a
// half-written checkpoint under a valid name and never touches the last good one; older checkpoints are deleted only
// afterwards, DONE first, so a crash while deleting leaves an incomplete folder, never a complete-looking one.
// ckpt_save refuses non-finite values and a negative AdamW v; a load refuses them too (an edited file whose checksum
// was recomputed). A resume (ckpt_resume_all_ranks) loads the checkpoint rank 0 picks and sends it to every rank in
// pieces, of which each rank keeps its ZeRO shard of the parameters and moments (and hands the whole parameters on
// piece by piece), and refuses one whose architecture keys or tensor table differ from the requested model's.
// infer_sdm needs model.bin alone: its config text rebuilds the model description.
#ifndef SDM_MODEL_CHECKPOINT_H
#define SDM_MODEL_CHECKPOINT_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/common.h"
#include "core/config.h"
#include "core/shard.h"
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

// The checksum a whole file file[n] (n >= 128) in memory should carry: the body hashed by the parts of
// docs/FORMATS.md#checksum (model.bin: config text, table, parameters; state.bin: m, v, the loader record), sized
// by its header and each clipped to the bytes there, then the header. For what edits a checkpoint on purpose: the
// tests and the fuzzer that check the value checks behind a matching checksum.
static inline uint64_t ckpt_checksum_of(const uint8_t *file, size_t n) {
    CkptHeader h;
    memcpy(&h, file, sizeof h);
    const uint64_t big = UINT64_MAX / sizeof(CkptTensor), floats = h.n_params > UINT64_MAX / 4 ? UINT64_MAX : 4 * h.n_params;
    uint64_t parts[3] = {floats, floats, UINT64_MAX};
    if (!memcmp(h.magic, CKPT_MODEL_MAGIC, 8)) {
        parts[0] = h.config_bytes;
        parts[1] = h.n_tensors > big ? UINT64_MAX : sizeof(CkptTensor) * h.n_tensors;
        parts[2] = floats;
    }
    const uint8_t *p = file + sizeof h;
    size_t left = n - sizeof h;
    uint64_t hash = CKPT_HASH_SEED;
    for (int i = 0; i < 3; i++) {
        size_t k = parts[i] < left ? (size_t)parts[i] : left;
        hash = ckpt_hash(hash, p, k);
        p += k;
        left -= k;
    }
    return ckpt_file_checksum(ckpt_hash(hash, p, left), &h); // bytes beyond the parts: a part of their own
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

// A folder name of this module: "step_", exactly 8 digits, then suffix ("" or ".tmp"). Strict, because sscanf's %llu
// would also take a sign or spaces ("step_-0000001" as step 2^64 - 1).
static inline int ckpt_parse_step_name(const char *name, const char *suffix, uint64_t *step) {
    if (strncmp(name, "step_", 5) != 0) return 0;
    uint64_t v = 0;
    for (int i = 5; i < 13; i++) {
        if (name[i] < '0' || name[i] > '9') return 0;
        v = 10 * v + (uint64_t)(name[i] - '0');
    }
    if (strcmp(name + 13, suffix) != 0) return 0;
    *step = v;
    return 1;
}

static const char *const CKPT_FILES[] = {"DONE", "model.bin", "state.bin"};

// Remove a checkpoint folder and the files this module writes into it, DONE first: a removal cut short leaves a
// folder that no longer counts as complete.
static inline void ckpt_remove_dir(const char *dir) {
    char path[1024];
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%.900s/%s", dir, CKPT_FILES[i]);
        remove(path);
    }
    rmdir(dir);
}

// A folder of run_dir is a complete checkpoint iff its name parses (ckpt_parse_step_name) and it holds DONE,
// model.bin and state.bin.
static inline int ckpt_is_complete(const char *run_dir, const char *name, uint64_t *step) {
    if (!ckpt_parse_step_name(name, "", step)) return 0;
    char path[1024];
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%.800s/%.32s/%s", run_dir, name, CKPT_FILES[i]);
        if (access(path, F_OK) != 0) return 0;
    }
    return 1;
}

// The number of complete checkpoints in run_dir; the newest min(that, max) of them go to steps[], newest first.
static inline int ckpt_list(const char *run_dir, uint64_t *steps, int max) {
    DIR *d = opendir(run_dir);
    if (!d) return 0;
    int count = 0, n = 0;
    uint64_t step;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!ckpt_is_complete(run_dir, e->d_name, &step)) continue;
        count++;
        if (n == max && (max == 0 || step <= steps[max - 1])) continue; // not among the newest max
        int i = SDM_MIN(n, max - 1); // the next free slot, or the oldest's when full; then sorted in
        if (n < max) n++;
        for (; i > 0 && steps[i - 1] < step; i--) steps[i] = steps[i - 1];
        steps[i] = step;
    }
    closedir(d);
    return count;
}

// The newest complete checkpoint of run_dir: 1 with its step, 0 when there is none. train_sdm resumes from it,
// infer_sdm reads it when given a run folder.
static inline int ckpt_newest(const char *run_dir, uint64_t *step) { return ckpt_list(run_dir, step, 1) > 0; }

// Remove run_dir's folders named step_<8 digits><suffix> of a step below `below`: older checkpoints than the ones
// kept (suffix ""), or the .tmp folders of saves that died half way (suffix ".tmp"). Other names are not ours.
static inline void ckpt_remove_below(const char *run_dir, const char *suffix, uint64_t below) {
    DIR *d = opendir(run_dir);
    if (!d) return;
    uint64_t step;
    char dir[1024];
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (ckpt_parse_step_name(e->d_name, suffix, &step) && step < below) {
            snprintf(dir, sizeof dir, "%.800s/%.32s", run_dir, e->d_name);
            ckpt_remove_dir(dir);
        }
    closedir(d);
}

// mkdir -p: path and its missing parents. 0 with err when one cannot be made or path is not a writable folder.
static inline int ckpt_make_dirs(const char *path, char *err) {
    char buf[1024];
    if (!path[0] || strlen(path) > 800) {
        snprintf(err, CKPT_ERR, "run folder '%.300s': empty or longer than 800 characters", path);
        return 0;
    }
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p != 0) continue;
        char end = *p;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
            snprintf(err, CKPT_ERR, "run folder %.300s: cannot create %.300s: %s", path, buf, strerror(errno));
            return 0;
        }
        if (!(*p = end)) break;
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) {
        snprintf(err, CKPT_ERR, "run folder %.300s: exists and is not a folder", path);
        return 0;
    }
    if (access(path, W_OK | X_OK) != 0) {
        snprintf(err, CKPT_ERR, "run folder %.300s: not writable: %s", path, strerror(errno));
        return 0;
    }
    return 1;
}

// Make run_dir ready for a run: created with its parents, writable, stale .tmp folders of earlier saves removed.
static inline int ckpt_prepare_run_dir(const char *run_dir, char *err) {
    if (!ckpt_make_dirs(run_dir, err)) return 0;
    ckpt_remove_below(run_dir, ".tmp", UINT64_MAX);
    return 1;
}

// The index of the first value of x [n] that no checkpoint holds: non-finite, or negative when nonneg (AdamW's v);
// -1 when there is none.
static inline long long ckpt_first_bad(const float *x, long long n, int nonneg) {
    for (long long i = 0; i < n; i++)
        if (!isfinite(x[i]) || (nonneg && x[i] < 0)) return i;
    return -1;
}

// 1 when the fp32 array x [m->storage] is finite (and >= 0 when nonneg: AdamW's v); else 0 with err naming the
// tensor and index of the first bad value.
static inline int ckpt_check_finite(const ModelDesc *m, const float *x, int nonneg, const char *what, uint64_t step,
                                    char *err) {
    long long i = ckpt_first_bad(x, m->storage, nonneg);
    if (i < 0) return 1;
    const char *name = "alignment gap";
    long long at = i;
    for (int k = 0; k < m->n_params; k++)
        if (i >= m->params[k].offset && i < m->params[k].offset + m->params[k].numel) {
            name = m->params[k].name;
            at = i - m->params[k].offset;
        }
    snprintf(err, CKPT_ERR, "step %llu: %s %s[%lld] is %g: refusing to write a checkpoint of %s",
             (unsigned long long)step, what, name, at, x[i],
             isfinite(x[i]) ? "a negative second moment" : "non-finite values");
    return 0;
}

// model.bin, state.bin, then DONE into the folder dir, each fsync'ed, then the folder.
static inline int ckpt_write_files(const char *dir, const ModelDesc *m, const Config *c, const float *params,
                                   const CkptTrainState *s, char *err) {
    char path[1024];
    snprintf(path, sizeof path, "%s/model.bin", dir);
    if (!ckpt_write_model(path, m, c, params, s->step, err)) return 0;
    snprintf(path, sizeof path, "%s/state.bin", dir);
    if (!ckpt_write_state(path, (uint64_t)m->storage, s, err)) return 0;
    snprintf(path, sizeof path, "%s/DONE", dir);
    FILE *fp = fopen(path, "w");
    int ok = fp && fprintf(fp, "step %llu\n", (unsigned long long)s->step) > 0 && fflush(fp) == 0 &&
             fsync(fileno(fp)) == 0;
    if (fp) ok &= fclose(fp) == 0;
    if (!ok) { snprintf(err, CKPT_ERR, "%.300s: cannot write: %s", path, strerror(errno)); return 0; }
    ckpt_fsync_dir(dir);
    return 1;
}

// Write step's checkpoint atomically, then keep only the newest `keep` complete checkpoints. Refuses non-finite
// parameters or moments; a failed write (a full disk) removes its .tmp folder and leaves the older ones as they were.
static inline int ckpt_save(const char *run_dir, const ModelDesc *m, const Config *c, const float *params,
                            const CkptTrainState *s, int keep, char *err) {
    char tmp[900], final_dir[900];
    if (!ckpt_check_finite(m, params, 0, "parameter", s->step, err) ||
        !ckpt_check_finite(m, s->adam_m, 0, "AdamW m of", s->step, err) ||
        !ckpt_check_finite(m, s->adam_v, 1, "AdamW v of", s->step, err) || !ckpt_make_dirs(run_dir, err))
        return 0;
    ckpt_step_dir(tmp, sizeof tmp, run_dir, s->step, ".tmp");
    ckpt_step_dir(final_dir, sizeof final_dir, run_dir, s->step, "");
    ckpt_remove_dir(tmp); // leftovers of a crashed earlier attempt
    if (mkdir(tmp, 0755) != 0) { snprintf(err, CKPT_ERR, "%.300s: cannot create: %s", tmp, strerror(errno)); return 0; }
    if (!ckpt_write_files(tmp, m, c, params, s, err)) { ckpt_remove_dir(tmp); return 0; }
    ckpt_remove_dir(final_dir); // this very step's checkpoint (a re-run): replaced only now that its successor is whole
    if (rename(tmp, final_dir) != 0) {
        snprintf(err, CKPT_ERR, "%.300s: cannot rename to %.300s: %s", tmp, final_dir, strerror(errno));
        return 0;
    }
    ckpt_fsync_dir(run_dir);
    uint64_t *kept = (uint64_t *)sdm_malloc(sizeof(uint64_t) * (size_t)keep);
    if (keep >= 1 && ckpt_list(run_dir, kept, keep) > keep) ckpt_remove_below(run_dir, "", kept[keep - 1]);
    free(kept);
    return 1;
}

// ---- reading ----------------------------------------------------------------------------------------------------

// Read and check a file's header against its size and magic; leaves fp positioned after the header. Opened without
// blocking and refused unless a regular file, so a FIFO or a device given as a checkpoint cannot hang the reader.
static inline FILE *ckpt_open(const char *path, const char *magic, CkptHeader *h, char *err) {
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0) { snprintf(err, CKPT_ERR, "%.300s: cannot open: %s", path, strerror(errno)); return NULL; }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, CKPT_ERR, "%.300s: not a regular file (offset 0)", path);
        close(fd);
        return NULL;
    }
    FILE *fp = fdopen(fd, "rb");
    if (!fp) { snprintf(err, CKPT_ERR, "%.300s: cannot open: %s", path, strerror(errno)); close(fd); return NULL; }
    char why[300] = "";
    if ((uint64_t)st.st_size < sizeof *h || fread(h, sizeof *h, 1, fp) != 1)
        snprintf(why, sizeof why, "%lld bytes, shorter than its 128-byte header at offset 0", (long long)st.st_size);
    else if (memcmp(h->magic, magic, 8) != 0)
        snprintf(why, sizeof why, "wrong magic at offset 0 (not a %.8s checkpoint file)", magic);
    else if (h->version != CKPT_VERSION) snprintf(why, sizeof why, "unsupported version %u at offset 8", h->version);
    else if (h->header_bytes != sizeof *h)
        snprintf(why, sizeof why, "wrong header size %u at offset 12", h->header_bytes);
    else if ((uint64_t)st.st_size - sizeof *h != h->body_bytes)
        snprintf(why, sizeof why, "file is %lld bytes, body_bytes at offset 32 says 128 + %llu (truncated?)",
                 (long long)st.st_size, (unsigned long long)h->body_bytes);
    if (why[0]) {
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

static inline void ckpt_checksum_error(const char *path, const CkptHeader *h, char *err) {
    snprintf(err, CKPT_ERR, "%.300s: checksum mismatch: bytes between offset 0 and %llu are not the ones written "
             "(corrupt file)", path, (unsigned long long)(sizeof *h + h->body_bytes));
}

// 1 when the n loaded fp32 values x, read from offset `at` of path, are finite (and >= 0 when nonneg: AdamW's v);
// else 0 with err naming the first bad value's index and offset. A loaded NaN would train on silently.
static inline int ckpt_check_loaded(const char *path, const float *x, uint64_t n, int nonneg, size_t at,
                                    const char *what, char *err) {
    long long i = ckpt_first_bad(x, (long long)n, nonneg);
    if (i < 0) return 1;
    snprintf(err, CKPT_ERR, "%.300s: %s %lld at offset %llu is %g: a checkpoint never holds %s", path, what, i,
             (unsigned long long)(at + 4 * (uint64_t)i), x[i],
             isfinite(x[i]) ? "a negative second moment" : "a non-finite value");
    return 0;
}

// The config text and tensor table of a model.bin: rebuild the model description from the text (into c and m)
// and check that the table describes exactly that model.
static inline int ckpt_check_model(const char *path, char *text, size_t text_bytes, const CkptTensor *table,
                                   uint64_t n_tensors, Config *c, ModelDesc *m, char *err) {
    char name[CKPT_ERR], msg[CFG_ERR];
    cfg_defaults(c);
    snprintf(name, sizeof name, "%.600s (config text from offset %zu)", path, sizeof(CkptHeader));
    if (!cfg_parse_text(c, text, name, msg)) { snprintf(err, CKPT_ERR, "%s", msg); return 0; }
    if (!cfg_validate(c, msg)) {
        snprintf(err, CKPT_ERR, "%.400s: stored config at offset %zu: %.300s", path, sizeof(CkptHeader), msg);
        return 0;
    }
    model_build(m, c);
    if ((uint64_t)m->n_params != n_tensors) {
        snprintf(err, CKPT_ERR, "%.300s: n_tensors at offset 48 says %llu, its config describes %d", path,
                 (unsigned long long)n_tensors, m->n_params);
        return 0;
    }
    size_t table_at = sizeof(CkptHeader) + text_bytes;
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        const CkptTensor *t = &table[i];
        if (strncmp(t->name, p->name, sizeof t->name) || t->shape[0] != (uint64_t)p->shape[0] ||
            t->shape[1] != (uint64_t)p->shape[1] || t->offset != (uint64_t)p->offset ||
            t->numel != (uint64_t)p->numel) {
            snprintf(err, CKPT_ERR, "%.300s: tensor %d at offset %zu ('%.64s') does not match the model its config "
                     "describes ('%s')", path, i, table_at + sizeof *t * i, t->name, p->name);
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
    if (!ok)
        snprintf(err, CKPT_ERR, "%.300s: the sizes at offsets 40, 48 and 56 do not add up to body_bytes at offset 32",
                 path);
    char *text = ok ? (char *)sdm_malloc(h.config_bytes + 1) : NULL;
    CkptTensor *table = ok ? (CkptTensor *)sdm_malloc(sizeof(CkptTensor) * (h.n_tensors + 1)) : NULL;
    ok = ok && ckpt_get(fp, text, h.config_bytes, &hash, path, err) &&
         ckpt_get(fp, table, sizeof(CkptTensor) * h.n_tensors, &hash, path, err);
    const char *nul = ok ? (const char *)memchr(text, 0, h.config_bytes) : NULL;
    if (nul) { // the parser would stop there and ignore the rest (cfg_load_file refuses a NUL too)
        snprintf(err, CKPT_ERR, "%.300s: NUL byte in the config text at offset %zu", path,
                 sizeof h + (size_t)(nul - text));
        ok = 0;
    }
    if (ok) {
        text[h.config_bytes] = 0;
        ok = ckpt_check_model(path, text, h.config_bytes, table, h.n_tensors, c, m, err);
    }
    if (ok && (uint64_t)m->storage != h.n_params) {
        snprintf(err, CKPT_ERR, "%.300s: n_params at offset 56 says %llu values, its config describes %lld", path,
                 (unsigned long long)h.n_params, m->storage);
        ok = 0;
    }
    if (ok) {
        *params = (float *)sdm_malloc(sizeof(float) * (size_t)m->storage);
        ok = ckpt_get(fp, *params, sizeof(float) * (size_t)m->storage, &hash, path, err);
    }
    if (ok && ckpt_file_checksum(hash, &h) != h.checksum) {
        ckpt_checksum_error(path, &h, err);
        ok = 0;
    }
    // ckpt_save never writes a non-finite value, so one here was put there after the checksum was (an edited file)
    ok = ok && ckpt_check_loaded(path, *params, (uint64_t)m->storage, 0,
                                 sizeof h + h.config_bytes + sizeof(CkptTensor) * h.n_tensors, "parameter", err);
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
        snprintf(err, CKPT_ERR, "%.300s: n_params at offset 56: optimizer state for %llu values, the model has %llu",
                 path, (unsigned long long)h.n_params, (unsigned long long)n_params);
    } else if (h.loader_bytes != loader_bytes || h.body_bytes != 8 * n_params + loader_bytes) {
        snprintf(err, CKPT_ERR, "%.300s: loader_bytes at offset 72: a dataloader record of %llu bytes, expected %llu "
                 "(body_bytes at offset 32: %llu)", path, (unsigned long long)h.loader_bytes,
                 (unsigned long long)loader_bytes, (unsigned long long)h.body_bytes);
    } else if (ckpt_get(fp, adam_m, 4 * n_params, &hash, path, err) &&
               ckpt_get(fp, adam_v, 4 * n_params, &hash, path, err) &&
               ckpt_get(fp, loader, loader_bytes, &hash, path, err)) {
        if (ckpt_file_checksum(hash, &h) != h.checksum) ckpt_checksum_error(path, &h, err);
        else ok = ckpt_check_loaded(path, adam_m, n_params, 0, sizeof h, "AdamW m", err) &&
                  ckpt_check_loaded(path, adam_v, n_params, 1, sizeof h + 4 * n_params, "AdamW v", err);
    }
    fclose(fp);
    *step = h.step;
    *rng_state = h.rng_state;
    return ok;
}

// ---- resuming ---------------------------------------------------------------------------------------------------

// Append " key: saved X vs requested Y;" to err for each architecture key (cfg_is_architecture) whose values differ;
// returns how many. Layer lists compare by the layers they name, so `all` equals `0,1` on two layers.
static inline int ckpt_architecture_diff(const Config *saved, const Config *want, char *err, size_t *pos) {
    char a[1200], b[1200];
    int diffs = 0;
    for (int i = 0; i < CFG_N_FIELDS; i++) {
        const CfgField *f = &CFG_FIELDS[i];
        if (!cfg_is_architecture(f->key)) continue;
        cfg_format(saved, f, a, sizeof a);
        cfg_format(want, f, b, sizeof b);
        int same = !strcmp(a, b);
        if (f->type == CFG_LAYERS) {
            const LayerList *ls = (const LayerList *)((const char *)saved + f->offset);
            const LayerList *lw = (const LayerList *)((const char *)want + f->offset);
            same = 1;
            for (int l = 0; l < SDM_MAX(saved->n_layers, want->n_layers); l++)
                same &= cfg_layer_in(ls, l) == cfg_layer_in(lw, l);
        }
        if (same) continue;
        diffs++;
        if (*pos < CKPT_ERR) *pos += snprintf(err + *pos, CKPT_ERR - *pos, " %s: saved %.100s vs requested %.100s;",
                                              f->key, a, b);
    }
    return diffs;
}

// Resuming needs the requested model (want, wm) to be the saved one (saved, sm) of checkpoint file `path`: every
// architecture key and every tensor (name, shape, offset; all are fp32) must agree. Returns 0 with err naming what
// differs. Non-architecture keys (learning rate, steps, precision, speed knobs) may change on resume.
static inline int ckpt_check_same_model(const char *path, const Config *saved, const ModelDesc *sm, const Config *want,
                                        const ModelDesc *wm, char *err) {
    size_t pos = (size_t)snprintf(err, CKPT_ERR, "%.300s: the checkpoint's model differs from the requested one "
                                  "(delete run_dir or fix the config):", path);
    if (ckpt_architecture_diff(saved, want, err, &pos)) return 0;
    if (sm->n_params != wm->n_params || sm->storage != wm->storage) {
        snprintf(err + pos, CKPT_ERR - pos, " %d tensors of %lld values vs requested %d of %lld", sm->n_params,
                 sm->storage, wm->n_params, wm->storage);
        return 0;
    }
    for (int i = 0; i < sm->n_params; i++) {
        const ParamSpec *s = &sm->params[i], *w = &wm->params[i];
        if (strcmp(s->name, w->name) || s->shape[0] != w->shape[0] || s->shape[1] != w->shape[1] ||
            s->offset != w->offset) {
            snprintf(err + pos, CKPT_ERR - pos, " tensor %d: saved %s [%lld, %lld] vs requested %s [%lld, %lld]", i,
                     s->name, s->shape[0], s->shape[1], w->name, w->shape[0], w->shape[1]);
            return 0;
        }
    }
    return 1;
}

// The keys a rank may set for itself: its run name, the folders and data paths of its own host (only rank 0 writes
// run_dir) and what only rank 0 logs. Every other key decides either the sequence of collectives every rank must issue
// alike (steps, grad_acc_steps, fsdp_type, model_dtype, dump_every, eval_every, probe_freq, ...) or the arithmetic
// ranks must share (seed and init: the initial weights; the optimizer's hyper-parameters: each rank updates its own
// shard): a rank that differs would hang the run in a collective or train silently on inconsistent weights.
static const char *const CKPT_RANK_LOCAL_KEYS[] = {"name", "run_dir", "data.train", "data.val", "checkpoint.keep",
                                                   "logging.freq", "logging.profile", "logging.peak_tflops",
                                                   "logging.hbm_tbps"};

// 1 when this rank's configuration `mine` agrees with rank 0's on every key but the architecture keys (which
// ckpt_check_same_model compares) and CKPT_RANK_LOCAL_KEYS; else 0 with err naming the keys that differ.
static inline int ckpt_check_same_run(const Config *rank0, const Config *mine, char *err) {
    size_t pos = (size_t)snprintf(err, CKPT_ERR, "its settings differ from rank 0's (every key but the per-rank "
                                  "name, run_dir, data.train, data.val, checkpoint.keep, logging.* must agree):");
    char a[1200], b[1200];
    int diffs = 0;
    for (int i = 0; i < CFG_N_FIELDS; i++) {
        const CfgField *f = &CFG_FIELDS[i];
        int local = cfg_is_architecture(f->key);
        for (size_t k = 0; k < sizeof CKPT_RANK_LOCAL_KEYS / sizeof CKPT_RANK_LOCAL_KEYS[0]; k++)
            local |= !strcmp(f->key, CKPT_RANK_LOCAL_KEYS[k]);
        if (local) continue;
        cfg_format(rank0, f, a, sizeof a);
        cfg_format(mine, f, b, sizeof b);
        if (!strcmp(a, b)) continue;
        diffs++;
        if (pos < CKPT_ERR) pos += snprintf(err + pos, CKPT_ERR - pos, " %s: rank 0 %.100s vs %.100s;", f->key, a, b);
    }
    return diffs == 0;
}

// The checkpoint rank 0 resumes from (found = 0: none, start afresh).
typedef struct { uint64_t found, step; } CkptId;

// A checkpoint loaded for resuming: parameters and AdamW moments, malloc'ed fp32. ckpt_load_resume fills them whole
// ([storage], lo = 0, hi = storage); ckpt_resume_all_ranks leaves each rank its ZeRO shard only (core/shard.h
// shard_range): [hi - lo] values each, element 0 being flat element lo (the whole arrays on one rank).
// host_bytes: the most host memory the resume held at once for these arrays on this rank (its shards and the
// broadcast piece; rank 0: the whole arrays it loads).
typedef struct {
    CkptId id;
    float *params, *adam_m, *adam_v;
    long long lo, hi;
    uint64_t rng_state;
    size_t host_bytes;
} CkptResume;

static inline void ckpt_resume_free(CkptResume *r) {
    free(r->params);
    free(r->adam_m);
    free(r->adam_v);
    r->params = r->adam_m = r->adam_v = NULL;
}

// Load checkpoint folder dir to resume the model (want, wm): model.bin must hold the same model
// (ckpt_check_same_model), state.bin its optimizer state at the same step and a loader record of loader_bytes
// (into loader). Returns 0 with err naming the file and problem.
static inline int ckpt_load_resume(const char *dir, const Config *want, const ModelDesc *wm, void *loader,
                                   uint64_t loader_bytes, CkptResume *r, char *err) {
    char path[1100];
    Config saved;
    ModelDesc *sm = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    uint64_t step, state_step;
    snprintf(path, sizeof path, "%s/model.bin", dir);
    int ok = ckpt_load_model(path, &saved, sm, &r->params, &step, err) &&
             ckpt_check_same_model(path, &saved, sm, want, wm, err);
    free(sm);
    if (!ok) return 0;
    size_t n = (size_t)wm->storage;
    r->lo = 0;
    r->hi = (long long)n;
    r->adam_m = (float *)sdm_malloc(4 * n);
    r->adam_v = (float *)sdm_malloc(4 * n);
    snprintf(path, sizeof path, "%s/state.bin", dir);
    if (!ckpt_load_state(path, n, r->adam_m, r->adam_v, loader, loader_bytes, &state_step, &r->rng_state, err))
        return 0;
    if (state_step != step) {
        snprintf(err, CKPT_ERR, "%.300s: step %llu at offset 16, model.bin says %llu", path,
                 (unsigned long long)state_step, (unsigned long long)step);
        return 0;
    }
    return 1;
}

// The collectives a resume needs, over every rank of the run: core/dist.cuh's on GPUs, core/loopback.h's in tests.
// piece_bytes: the largest broadcast0 a resume issues (0: CKPT_PIECE_BYTES; tests take small ones).
typedef struct {
    int rank, world;
    void *ctx;
    void (*broadcast0)(void *ctx, void *buf, size_t bytes); // rank 0's bytes to every rank
    void (*sum)(void *ctx, float *x, size_t n);             // in place, over ranks
    size_t piece_bytes;
} CkptComm;

#define CKPT_PIECE_BYTES ((size_t)256 << 20)

static inline size_t ckpt_piece_bytes(const CkptComm *c) {
    size_t p = c->piece_bytes ? c->piece_bytes : CKPT_PIECE_BYTES;
    return p < 4 ? 4 : p / 4 * 4; // whole fp32 values
}

// What a resume hands over piece by piece: the whole parameter array, which every rank needs (train_sdm: the model's
// working copy on the device), in consecutive pieces [lo, hi) of the flat array, x [hi - lo] valid during the call
// only, on every rank alike. NULL params: not needed.
typedef struct {
    void *ctx;
    void (*params)(void *ctx, long long lo, long long hi, const float *x);
} CkptSink;

// 1 on every rank when every rank passes ok; otherwise 0 on every rank with err: a failed rank's own message
// prefixed by "rank R <what>: ", elsewhere the failed ranks named. No rank stops alone, waiting for the others.
static inline int ckpt_all_ranks_ok(const CkptComm *c, int ok, const char *what, char *err) {
    float *failed = (float *)sdm_calloc((size_t)c->world, sizeof(float));
    failed[c->rank] = (float)!ok;
    c->sum(c->ctx, failed, (size_t)c->world);
    char ranks[256] = "";
    int n = 0;
    size_t pos = 0;
    for (int q = 0; q < c->world; q++)
        if (failed[q] != 0 && pos < sizeof ranks)
            pos += snprintf(ranks + pos, sizeof ranks - pos, "%s%d", n++ ? ", " : "", q);
    free(failed);
    if (n == 0) return 1;
    char own[CKPT_ERR];
    snprintf(own, sizeof own, "%s", err);
    if (ok) snprintf(err, CKPT_ERR, "rank%s %.200s %.400s; stopping every rank", n > 1 ? "s" : "", ranks, what);
    else snprintf(err, CKPT_ERR, "rank %d %.300s: %.400s", c->rank, what, own);
    return 0;
}

// buf [bytes] on every rank = rank 0's, in pieces of at most ckpt_piece_bytes (the collective stages them on the
// device).
static inline void ckpt_broadcast0(const CkptComm *c, void *buf, size_t bytes) {
    const size_t piece = ckpt_piece_bytes(c);
    for (size_t at = 0; at < bytes; at += piece)
        c->broadcast0(c->ctx, (char *)buf + at, bytes - at < piece ? bytes - at : piece);
}

// Rank 0's fp32 array src [n] (whole, loaded) to every rank, in the pieces ckpt_broadcast0 would send (the same
// collectives on every rank): the other ranks receive each piece into buf [min(n, piece)] and copy its part in
// [lo, hi) to dst [hi - lo] (dst NULL: none kept); every rank passes each piece to take (when not NULL).
static inline void ckpt_broadcast_array(const CkptComm *c, float *src, long long n, float *buf, long long lo,
                                        long long hi, float *dst,
                                        void (*take)(void *, long long, long long, const float *), void *ctx) {
    const long long piece = (long long)(ckpt_piece_bytes(c) / 4);
    for (long long at = 0; at < n; at += piece) {
        long long end = n - at < piece ? n : at + piece;
        float *x = c->rank == 0 ? src + at : buf;
        if (c->world > 1) c->broadcast0(c->ctx, x, 4 * (size_t)(end - at));
        long long a = at > lo ? at : lo, b = end < hi ? end : hi;
        if (dst && c->rank != 0 && b > a) memcpy(dst + (a - lo), x + (a - at), 4 * (size_t)(b - a));
        if (take) take(ctx, at, end, x);
    }
}

// A malloc'ed array's first count values kept, the rest returned to the allocator.
static inline float *ckpt_keep_front(float *x, long long count) {
    float *y = (float *)realloc(x, 4 * (size_t)(count > 0 ? count : 1));
    return y ? y : x;
}

// Resume on every rank from the newest complete checkpoint of rank 0's run_dir. Rank 0 picks and loads it, then
// broadcasts its step, parameters, AdamW moments and loader record, so the other ranks need no copy of the folder.
// Each rank keeps of the parameters and moments only its ZeRO shard (r->lo, r->hi: core/shard.h shard_range over
// comm->world); the whole parameters go to sink->params piece by piece (sink NULL: not needed). So a rank other than
// 0 holds 12 bytes per value of its shard and one broadcast piece (ckpt_piece_bytes), never the whole arrays; rank 0
// holds the whole arrays it loads until the broadcast is over, then its shard.
// Every rank first checks its configured model against rank 0's (the architecture keys and the tensor table; rank 0
// checks the checkpoint's against its own), then the rest of its configuration (ckpt_check_same_run), so ranks that
// disagree stop before anything is sent. Returns 1 with r->id.found = 0 (start afresh) or r loaded; 0 on every rank,
// with err naming the ranks, when rank 0 cannot load the checkpoint or any rank's model or run settings differ.
static inline int ckpt_resume_all_ranks(const char *run_dir, const Config *want, const ModelDesc *wm, void *loader,
                                        uint64_t loader_bytes, const CkptComm *comm, const CkptSink *sink,
                                        CkptResume *r, char *err) {
    memset(r, 0, sizeof *r);
    Config *cfg0 = (Config *)sdm_malloc(sizeof(Config));
    ModelDesc *m0 = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    *cfg0 = *want;
    comm->broadcast0(comm->ctx, cfg0, sizeof *cfg0);
    model_build(m0, cfg0);
    int ok = ckpt_check_same_model("rank 0's configuration", cfg0, m0, want, wm, err);
    free(m0);
    if (ckpt_all_ranks_ok(comm, ok, "is configured for another model than rank 0", err)) {
        ok = ckpt_check_same_run(cfg0, want, err);
        ok = ckpt_all_ranks_ok(comm, ok, "is configured for another run than rank 0", err);
    } else ok = 0;
    free(cfg0);
    if (!ok) return 0;

    char dir[1024];
    if (comm->rank == 0 && ckpt_newest(run_dir, &r->id.step)) {
        r->id.found = 1;
        ckpt_step_dir(dir, sizeof dir, run_dir, r->id.step, "");
        ok = ckpt_load_resume(dir, want, wm, loader, loader_bytes, r, err);
    }
    comm->broadcast0(comm->ctx, &r->id, sizeof r->id);
    if (!ckpt_all_ranks_ok(comm, ok, "cannot load the checkpoint to resume from", err)) {
        ckpt_resume_free(r);
        return 0;
    }
    if (!r->id.found) return 1;
    long long n = wm->storage;
    void (*take)(void *, long long, long long, const float *) = sink ? sink->params : NULL;
    void *ctx = sink ? sink->ctx : NULL;
    if (comm->world == 1) {
        r->host_bytes = 12 * (size_t)n;
        ckpt_broadcast_array(comm, r->params, n, NULL, 0, n, NULL, take, ctx); // no collective: the pieces to take
        return 1;
    }
    shard_range(n, comm->world, comm->rank, &r->lo, &r->hi);
    size_t keep = 4 * (size_t)(r->hi - r->lo);
    float *buf = NULL;
    if (comm->rank != 0) {
        size_t piece = ckpt_piece_bytes(comm) < 4 * (size_t)n ? ckpt_piece_bytes(comm) : 4 * (size_t)n;
        r->params = (float *)sdm_malloc(keep);
        r->adam_m = (float *)sdm_malloc(keep);
        r->adam_v = (float *)sdm_malloc(keep);
        buf = (float *)sdm_malloc(piece);
        r->host_bytes = 3 * keep + piece;
    } else r->host_bytes = 12 * (size_t)n;
    ckpt_broadcast_array(comm, r->params, n, buf, r->lo, r->hi, r->params, take, ctx);
    ckpt_broadcast_array(comm, r->adam_m, n, buf, r->lo, r->hi, r->adam_m, NULL, NULL);
    ckpt_broadcast_array(comm, r->adam_v, n, buf, r->lo, r->hi, r->adam_v, NULL, NULL);
    free(buf);
    if (comm->rank == 0) { // its shard is the front of the whole arrays: [0, hi)
        r->params = ckpt_keep_front(r->params, r->hi);
        r->adam_m = ckpt_keep_front(r->adam_m, r->hi);
        r->adam_v = ckpt_keep_front(r->adam_v, r->hi);
    }
    ckpt_broadcast0(comm, loader, loader_bytes);
    comm->broadcast0(comm->ctx, &r->rng_state, sizeof r->rng_state);
    return 1;
}

#endif
