// data/dataset.h: the embedded default dataset (the associative-recall task of data/recall.h) as token shards,
// generated on first use so that training needs no download:
//     dataset_ensure_default("data/generated", err)   -> recall_train_*.bin, recall_val_*.bin, recall_dataset.txt
// The same files come from `make dataset` (./prepare_data --recall -o data/generated).
#ifndef SDM_DATA_DATASET_H
#define SDM_DATA_DATASET_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "data/recall.h"
#include "data/shard.h"

#define DATASET_DEFAULT_DIR "data/generated"
#define DATASET_TRAIN_PATTERN "recall_train_*.bin"  // relative to the dataset directory
#define DATASET_VAL_PATTERN "recall_val_*.bin"
#define DATASET_STAMP "recall_dataset.txt"           // written last: the dataset is complete when it matches
#define DATASET_SHARD_TOKENS (8u << 20)
#define DATASET_LOCK ".sdm_data.lock"                // taken by every writer of shards into the directory

// The stamp describes what was generated; a different config (or generator version) means regenerate.
static inline void dataset_stamp_text(const RecallConfig *c, char *out, size_t cap) {
    snprintf(out, cap,
             "sdm.c associative-recall dataset, generator version 2 (manifests)\n"
             "seed %llu\ntrain_tokens %llu\nval_tokens %llu\nmin_gap %d\nmax_gap %d\nmin_facts %d\nmax_facts %d\n"
             "queries_per_fact %d\nshard_tokens %u\n",
             (unsigned long long)c->seed, (unsigned long long)c->train_tokens, (unsigned long long)c->val_tokens,
             c->min_gap, c->max_gap, c->min_facts, c->max_facts, c->queries_per_fact, DATASET_SHARD_TOKENS);
}

// mkdir -p
static inline int dataset_make_dir(const char *dir, char *err) {
    char path[SHARD_PATH_LEN];
    if (strlen(dir) >= sizeof path) return data_fail(err, "%s: path too long", dir);
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != 0) continue;
        char c = *p;
        *p = 0;
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            return data_fail(err, "%s: cannot create: %s", path, strerror(errno));
        *p = c;
        if (c == 0) return 0;
    }
}

// An exclusive lock on {dir}/DATASET_LOCK (fcntl, so the kernel releases it when the process ends, however it
// ends): writers into one directory take turns, and dataset_ensure_default waits for a writer before it reads the
// stamp. *fd holds it until dataset_unlock.
static inline int dataset_lock(const char *dir, int *fd, char *err) {
    char path[SHARD_PATH_LEN + 32];
    snprintf(path, sizeof path, "%s/%s", dir, DATASET_LOCK);
    *fd = open(path, O_RDWR | O_CREAT, 0644);
    if (*fd < 0) return data_fail(err, "%s: cannot open: %s", path, strerror(errno));
    struct flock l;
    memset(&l, 0, sizeof l);
    l.l_type = F_WRLCK;
    l.l_whence = SEEK_SET;
    int rc;
    while ((rc = fcntl(*fd, F_SETLKW, &l)) != 0 && errno == EINTR) {}
    if (rc != 0) { close(*fd); return data_fail(err, "%s: cannot lock: %s", path, strerror(errno)); }
    return 0;
}

static inline void dataset_unlock(int fd) { close(fd); }

static inline int dataset_stamp_matches(const char *dir, const char *want) {
    char path[SHARD_PATH_LEN + 64], have[1024];
    snprintf(path, sizeof path, "%s/%s", dir, DATASET_STAMP);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    size_t n = fread(have, 1, sizeof have - 1, f);
    fclose(f);
    have[n] = 0;
    return strcmp(have, want) == 0;
}

// Generate the recall dataset into dir (train and validation shards, then the stamp).
static inline int recall_dataset_write(const char *dir, const RecallConfig *c, char *err) {
    char stamp[1024], path[SHARD_PATH_LEN + 64];
    ShardWriter w;
    if (recall_config_check(c, err) || dataset_make_dir(dir, err)) return -1;
    snprintf(path, sizeof path, "%s/%s", dir, DATASET_STAMP);
    remove(path);  // the dataset is incomplete until the stamp is written again
    const char *prefixes[2] = {"recall_train", "recall_val"};
    const uint64_t sizes[2] = {c->train_tokens, c->val_tokens};
    for (int split = 0; split < 2; split++) {
        if (shard_writer_open(&w, dir, prefixes[split], TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES, DATASET_SHARD_TOKENS,
                              err))
            return -1;
        if (recall_write_split(c, (uint64_t)split, sizes[split], &w, err)) { shard_writer_abort(&w); return -1; }
        if (shard_writer_close(&w, err)) return -1;
    }
    char tmp[SHARD_PATH_LEN + 96];
    snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid());
    dataset_stamp_text(c, stamp, sizeof stamp);
    FILE *f = fopen(tmp, "wb");
    if (!f) return data_fail(err, "%s: cannot create: %s", tmp, strerror(errno));
    int bad = fputs(stamp, f) < 0;
    if (fclose(f) != 0 || bad || rename(tmp, path) != 0) return data_fail(err, "%s: write failed", path);
    return 0;
}

// Make sure the default dataset exists in dir (normally DATASET_DEFAULT_DIR); generates it (a few seconds) when
// missing or made by another generator version. Safe when several ranks call it at once: under the directory's
// lock the first generates, the others find its stamp. Returns 0, or -1 with a message in err.
static inline int dataset_ensure_default(const char *dir, char *err) {
    RecallConfig c = recall_default_config();
    char stamp[1024];
    int lock, rc = 0;
    dataset_stamp_text(&c, stamp, sizeof stamp);
    if (dataset_make_dir(dir, err) || dataset_lock(dir, &lock, err)) return -1;
    if (!dataset_stamp_matches(dir, stamp)) {
        fprintf(stderr, "sdm: generating the default recall dataset in %s (once)\n", dir);
        rc = recall_dataset_write(dir, &c, err);
    }
    dataset_unlock(lock);
    return rc;
}

#endif
