// data/dataset.h: the embedded default dataset (the associative-recall task of data/recall.h) as token shards,
// generated on first use so that training needs no download:
//     dataset_ensure_default("data/generated", err)   -> recall_train_*.bin, recall_val_*.bin, recall_dataset.txt
// The same files come from `make dataset` (./prepare_data --recall -o data/generated).
#ifndef SDM_DATA_DATASET_H
#define SDM_DATA_DATASET_H

#include <errno.h>
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

// The stamp describes what was generated; a different config (or generator version) means regenerate.
static inline void dataset_stamp_text(const RecallConfig *c, char *out, size_t cap) {
    snprintf(out, cap,
             "sdm.c associative-recall dataset, generator version 1\n"
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
        if (mkdir(path, 0755) != 0 && errno != EEXIST) return data_fail(err, "%s: cannot create: %s", path, strerror(errno));
        *p = c;
        if (c == 0) return 0;
    }
}

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
        if (shard_writer_open(&w, dir, prefixes[split], TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES, DATASET_SHARD_TOKENS, err))
            return -1;
        int rc = recall_write_split(c, (uint64_t)split, sizes[split], &w, err);
        if (shard_writer_close(&w, rc ? NULL : err) || rc) return -1;
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
// missing or made by another generator version. Returns 0, or -1 with a message in err.
static inline int dataset_ensure_default(const char *dir, char *err) {
    RecallConfig c = recall_default_config();
    char stamp[1024];
    dataset_stamp_text(&c, stamp, sizeof stamp);
    if (dataset_stamp_matches(dir, stamp)) return 0;
    fprintf(stderr, "sdm: generating the default recall dataset in %s (once)\n", dir);
    return recall_dataset_write(dir, &c, err);
}

#endif
