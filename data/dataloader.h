// data/dataloader.h: rows of T+1 tokens from token shards, for B rows per rank and `world` ranks.
//
// Rows: shard s with n tokens holds (n-1)/T rows; row r is tokens [r*T, r*T + T] (inputs 0..T-1, targets 1..T),
// so consecutive rows overlap by one token and every token but the first is a target exactly once per epoch.
// Epoch order: the shards in an order shuffled from (seed, epoch), each shard's rows permuted from
// (seed, epoch, shard) by a keyed bijection (a Feistel network with cycle walking: O(1) memory, random access).
// Concatenated, this gives every row of the data one position p in [0, total_rows) for the epoch.
// Global batch k is positions [k*G, (k+1)*G) with G = world*B; rank r takes [k*G + r*B, k*G + (r+1)*B). So
// ranks get disjoint slices that together are the global batch, and the global batch depends on G only (not on
// how G splits into world x B). An epoch ends when fewer than G positions are left (they are dropped; a new
// epoch reshuffles, so other rows are dropped next time). Validation loaders (shuffle = 0) use the identity.
//
// The state is (seed, epoch, position): next_batch is a pure function of it, so restoring a saved state gives
// exactly the batches an uninterrupted run would have seen, on any world size with the same G.
#ifndef SDM_DATA_DATALOADER_H
#define SDM_DATA_DATALOADER_H

#include <glob.h>
#include <stdio.h>
#include <string.h>

#include "core/common.h"
#include "core/rng.h"
#include "data/shard.h"

#define DATALOADER_STATE_MAGIC 0x54534C44u  // "DLST"
#define DATALOADER_STATE_VERSION 1

// Written into checkpoints as is (48 bytes, no pointers, no padding).
typedef struct {
    uint32_t magic, version;
    uint64_t seed;
    uint64_t epoch;
    uint64_t position;    // rows of this epoch's order handed out so far, by all ranks together
    uint64_t total_rows;  // rows in the data: a fingerprint checked on restore
    uint32_t seq_len;     // T
    uint32_t shuffle;
} DataLoaderState;

typedef struct {
    char path[SHARD_PATH_LEN];
    ShardHeader h;
    uint64_t rows;
} LoaderShard;

typedef struct {
    int B, T, rank, world, shuffle;
    uint32_t max_vocab;          // the model's vocabulary: a shard with a larger one is refused
    uint32_t vocab, tokenizer;   // common to every shard
    uint64_t seed, epoch, position, total_rows;
    int num_shards;
    LoaderShard *shards;         // [num_shards], in sorted path order
    int *order;                  // [num_shards]: the epoch's shard order
    uint64_t *start;             // [num_shards + 1]: first position of each shard in the epoch's order
    uint64_t order_epoch;        // the epoch order/start were computed for (UINT64_MAX: none yet)
    FILE *f;                     // the shard read last, kept open
    int f_shard;
    uint8_t *scratch;            // [(T+1) * 4]
} DataLoader;

static inline uint64_t loader_mix(uint64_t a, uint64_t b, uint64_t c) {
    Rng r = rng_make(a ^ (b * 0xD1B54A32D192ED03ull) ^ (c * 0x8CB92BA72F3D8DD7ull));
    return rng_u64(&r);
}

// A bijection of [0, n) keyed by key: a 4-round Feistel network on the smallest even number of bits covering
// n, cycle-walking values >= n back into range (each walk step lands in range with probability > 1/4).
static inline uint64_t loader_permute(uint64_t i, uint64_t n, uint64_t key) {
    if (n <= 1) return i;
    int bits = 2;
    while (bits < 64 && (n - 1) >> bits) bits += 2;
    const int half = bits / 2;
    const uint64_t mask = (1ull << half) - 1;
    uint64_t x = i;
    do {
        uint64_t l = x >> half, r = x & mask;
        for (uint64_t round = 0; round < 4; round++) {
            uint64_t t = l ^ (loader_mix(key, round, r) & mask);
            l = r;
            r = t;
        }
        x = (l << half) | r;
    } while (x >= n);
    return x;
}

static inline int loader_add_shard(DataLoader *dl, const char *path, char *err) {
    LoaderShard s;
    FILE *f;
    if (strlen(path) >= sizeof s.path) return data_fail(err, "%s: path too long", path);
    if (shard_open(path, &s.h, &f, err)) return -1;
    fclose(f);
    if (s.h.vocab > dl->max_vocab)  // its tokens are checked against its vocab on every read: bound that by the model's
        return data_fail(err, "%s: offset 12: vocab %u exceeds the model's vocabulary %u", path, s.h.vocab,
                         dl->max_vocab);
    if (shard_manifest_check(path, &s.h, err)) return -1;  // only shards of a complete set
    if (dl->num_shards > 0 && (s.h.vocab != dl->vocab || s.h.tokenizer != dl->tokenizer))
        return data_fail(err, "%s: offset 12: vocab %u / tokenizer %u differ from %s (vocab %u / tokenizer %u)", path,
                         s.h.vocab, s.h.tokenizer, dl->shards[0].path, dl->vocab, dl->tokenizer);
    snprintf(s.path, sizeof s.path, "%s", path);
    s.rows = s.h.count > (uint64_t)dl->T ? (s.h.count - 1) / (uint64_t)dl->T : 0;
    dl->vocab = s.h.vocab;
    dl->tokenizer = s.h.tokenizer;
    dl->shards = (LoaderShard *)realloc(dl->shards, (size_t)(dl->num_shards + 1) * sizeof(LoaderShard));
    if (!dl->shards) sdm_die("out of host memory listing shards");
    dl->shards[dl->num_shards++] = s;
    dl->total_rows += s.rows;
    return 0;
}

// patterns: comma-separated globs or paths; each must match at least one file.
static inline int loader_add_patterns(DataLoader *dl, const char *patterns, char *err) {
    char pat[SHARD_PATH_LEN];
    for (const char *p = patterns; *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len >= sizeof pat) return data_fail(err, "%.*s: pattern too long", (int)SDM_MIN(len, (size_t)200), p);
        memcpy(pat, p, len);
        pat[len] = 0;
        p += len + (comma ? 1 : 0);
        if (len == 0) continue;
        glob_t g;
        if (glob(pat, 0, NULL, &g) != 0 || g.gl_pathc == 0) {
            globfree(&g);
            return data_fail(err, "%s: no file matches (unreadable or missing)", pat);
        }
        int rc = 0;
        for (size_t i = 0; i < g.gl_pathc && rc == 0; i++) rc = loader_add_shard(dl, g.gl_pathv[i], err);
        globfree(&g);
        if (rc) return -1;
    }
    if (dl->num_shards == 0) return data_fail(err, "empty list of shards \"%s\"", patterns);
    return 0;
}

static inline void dataloader_close(DataLoader *dl) {
    if (dl->f) fclose(dl->f);
    free(dl->shards);
    free(dl->order);
    free(dl->start);
    free(dl->scratch);
    memset(dl, 0, sizeof *dl);
}

// Open the shards matching patterns for rank `rank` of `world`, B rows of T+1 tokens per batch.
// shuffle = 1 for training, 0 for validation (every row in file order). Shards whose vocab exceeds max_vocab (the
// model's) are refused, so every token handed out is < max_vocab.
static inline int dataloader_open(DataLoader *dl, const char *patterns, int B, int T, int rank, int world,
                                  uint64_t seed, int shuffle, uint32_t max_vocab, char *err) {
    memset(dl, 0, sizeof *dl);
    if (B < 1 || T < 1 || world < 1 || rank < 0 || rank >= world)
        return data_fail(err, "dataloader: bad shape B=%d T=%d rank=%d world=%d", B, T, rank, world);
    dl->B = B; dl->T = T; dl->rank = rank; dl->world = world; dl->seed = seed; dl->shuffle = shuffle != 0;
    dl->max_vocab = max_vocab;
    dl->f_shard = -1;
    dl->order_epoch = UINT64_MAX;
    if (loader_add_patterns(dl, patterns, err)) { dataloader_close(dl); return -1; }
    uint64_t G = (uint64_t)world * (uint64_t)B;
    if (dl->total_rows < G) {
        uint64_t tokens = 0;
        for (int i = 0; i < dl->num_shards; i++) tokens += dl->shards[i].h.count;
        data_fail(err, "%s: %llu tokens in %d shard(s) make %llu rows of T+1 = %d tokens, fewer than one global "
                  "batch of world*B = %llu rows (world*B*(T+1) = %llu tokens)", patterns, (unsigned long long)tokens,
                  dl->num_shards, (unsigned long long)dl->total_rows, T + 1, (unsigned long long)G,
                  (unsigned long long)(G * (uint64_t)(T + 1)));
        dataloader_close(dl);
        return -1;
    }
    dl->order = (int *)sdm_malloc((size_t)dl->num_shards * sizeof(int));
    dl->start = (uint64_t *)sdm_malloc((size_t)(dl->num_shards + 1) * sizeof(uint64_t));
    dl->scratch = (uint8_t *)sdm_malloc((size_t)(T + 1) * 4);
    return 0;
}

// Shard order of the current epoch (Fisher-Yates from (seed, epoch)) and where each shard starts in it.
static inline void loader_epoch_order(DataLoader *dl) {
    if (dl->order_epoch == dl->epoch) return;
    Rng r = rng_make(loader_mix(dl->seed, dl->epoch, 0x5EEDull));
    for (int i = 0; i < dl->num_shards; i++) dl->order[i] = i;
    for (int i = dl->num_shards - 1; dl->shuffle && i > 0; i--) {
        int j = (int)rng_below(&r, (uint32_t)i + 1), t = dl->order[i];
        dl->order[i] = dl->order[j];
        dl->order[j] = t;
    }
    dl->start[0] = 0;
    for (int k = 0; k < dl->num_shards; k++) dl->start[k + 1] = dl->start[k] + dl->shards[dl->order[k]].rows;
    dl->order_epoch = dl->epoch;
}

// Position p of the epoch's order -> (shard, row in that shard).
static inline void loader_locate(const DataLoader *dl, uint64_t p, int *shard, uint64_t *row) {
    int lo = 0, hi = dl->num_shards - 1;  // the last k with start[k] <= p (and rows > 0)
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (dl->start[mid] <= p) lo = mid; else hi = mid - 1;
    }
    *shard = dl->order[lo];
    uint64_t i = p - dl->start[lo], n = dl->shards[*shard].rows;
    *row = dl->shuffle ? loader_permute(i, n, loader_mix(dl->seed, dl->epoch, (uint64_t)*shard + 1)) : i;
}

static inline int loader_read_row(DataLoader *dl, int shard, uint64_t row, int32_t *out, char *err) {
    const LoaderShard *s = &dl->shards[shard];
    if (dl->f_shard != shard) {
        ShardHeader h;
        if (dl->f) fclose(dl->f);
        dl->f = NULL;
        dl->f_shard = -1;
        if (shard_open(s->path, &h, &dl->f, err)) return -1;
        if (h.count != s->h.count || h.vocab != s->h.vocab)
            return data_fail(err, "%s: offset 0: the shard changed since the loader opened it", s->path);
        dl->f_shard = shard;
    }
    return shard_read_tokens(dl->f, &s->h, s->path, row * (uint64_t)dl->T, (size_t)dl->T + 1, out, dl->scratch, err);
}

// out [B, T+1]: this rank's slice of the next global batch. Returns 0, or -1 (file, offset and cause in err).
static inline int dataloader_next_batch(DataLoader *dl, int32_t *out, char *err) {
    const uint64_t G = (uint64_t)dl->world * (uint64_t)dl->B;
    if (dl->position + G > dl->total_rows) { dl->epoch++; dl->position = 0; }
    loader_epoch_order(dl);
    for (int b = 0; b < dl->B; b++) {
        int shard;
        uint64_t row;
        loader_locate(dl, dl->position + (uint64_t)dl->rank * (uint64_t)dl->B + (uint64_t)b, &shard, &row);
        if (loader_read_row(dl, shard, row, out + (size_t)b * (size_t)(dl->T + 1), err)) return -1;
    }
    dl->position += G;
    return 0;
}

static inline uint64_t dataloader_batches_per_epoch(const DataLoader *dl) {
    return dl->total_rows / ((uint64_t)dl->world * (uint64_t)dl->B);
}

// Back to the first batch of epoch 0 (for a validation pass).
static inline void dataloader_reset(DataLoader *dl) { dl->epoch = 0; dl->position = 0; }

static inline void dataloader_get_state(const DataLoader *dl, DataLoaderState *s) {
    memset(s, 0, sizeof *s);
    s->magic = DATALOADER_STATE_MAGIC;
    s->version = DATALOADER_STATE_VERSION;
    s->seed = dl->seed;
    s->epoch = dl->epoch;
    s->position = dl->position;
    s->total_rows = dl->total_rows;
    s->seq_len = (uint32_t)dl->T;
    s->shuffle = (uint32_t)dl->shuffle;
}

// Continue from a saved state (its seed included). Refused when the data or the row length differ.
static inline int dataloader_set_state(DataLoader *dl, const DataLoaderState *s, char *err) {
    if (s->magic != DATALOADER_STATE_MAGIC || s->version != DATALOADER_STATE_VERSION)
        return data_fail(err, "dataloader state: bad magic or version (0x%08x, %u)", s->magic, s->version);
    if (s->total_rows != dl->total_rows || s->seq_len != (uint32_t)dl->T || s->shuffle != (uint32_t)dl->shuffle)
        return data_fail(err,
                         "dataloader state: saved for %llu rows of T=%u (shuffle %u), but the loader has %llu rows of "
                         "T=%d (shuffle %d): different data or seq_len",
                         (unsigned long long)s->total_rows, s->seq_len, s->shuffle, (unsigned long long)dl->total_rows,
                         dl->T, dl->shuffle);
    if (s->position > s->total_rows)
        return data_fail(err, "dataloader state: position %llu beyond %llu rows", (unsigned long long)s->position,
                         (unsigned long long)s->total_rows);
    dl->seed = s->seed;
    dl->epoch = s->epoch;
    dl->position = s->position;
    dl->order_epoch = UINT64_MAX;  // the seed may have changed
    return 0;
}

#endif
