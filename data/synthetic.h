// data/synthetic.h: synthetic recall tasks sized to the training rows (MQAR and copy), their generator and their
// scorers, and the table of every task's scorer that evaluation runs (recall, mqar, copy).
//
// A document is exactly T = seq_len tokens: BOS, T-2 body tokens, EOS. The dataloader cuts row k of a shard as
// tokens [kT, kT+T], so with shards holding whole documents, row k is document k plus the next document's BOS:
// no fact is ever cut from its query. The body uses four disjoint alphabets, so the scorers find every answer
// from the row alone, and filler says nothing about keys or values:
//   markers  SYN_FACT, SYN_QUERY, SYN_COPY_FROM, SYN_COPY_TO (control bytes 1..4, absent from real text)
//   keys     A-Z a-z (52)          values  0-9 (10: chance is 0.1)          filler  16 punctuation bytes
//
//   mqar: BOS, P facts  FACT key value  (distinct keys), then filler with one query  QUERY key value  per fact,
//         its value (the answer) g tokens after the fact's value, g log-uniform in [min_gap, max_gap]; facts are
//         queried in the order their gaps give. Queries come after the facts, so fact i (from 0) has gaps of at
//         least 3(P-i): the smallest gaps belong to the last facts. A gap that cannot be placed (outside the body or on
//         another query) is redrawn; after SYN_TRIES draws the fact stays unqueried (counted as dropped).
//   copy: BOS, filler, COPY_FROM s_1..s_L, filler, COPY_TO s_1..s_L, filler: L random letters, both markers g
//         tokens apart (so each letter is g tokens from its original), g log-uniform in [max(min_gap, L+1),
//         max_gap]; every letter of the second copy is an answer token.
//   max_gap 0 means the largest gap the row allows (mqar T-5, copy T-3-L).
//
// Scores go into a GapScore (data/eval_stats.h), buckets [0,32), [32,64), ..., [32768, inf).
#ifndef SDM_DATA_SYNTHETIC_H
#define SDM_DATA_SYNTHETIC_H

#include "data/dataset.h"  // dataset_make_dir; data/recall.h

#define SYN_FACT 1
#define SYN_QUERY 2
#define SYN_COPY_FROM 3
#define SYN_COPY_TO 4
#define SYN_KEYS "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
#define SYN_NUM_KEYS 52
#define SYN_VALUES "0123456789"
#define SYN_FILLER " .,;:-+*/=~^_|#%"
#define SYN_TRIES 1000
#define SYN_GAP_FIRST 32
#define SYN_BUCKETS 12
#define SYN_SHARD_TOKENS (8u << 20)  // rounded down to whole documents

typedef enum { SYN_MQAR, SYN_COPY } SynTask;

typedef struct {
    SynTask task;
    uint64_t seed;
    uint64_t train_tokens, val_tokens;  // rounded up to whole documents
    int seq_len;                        // T: tokens per document = the training rows' seq_len
    int min_gap, max_gap;               // tokens from statement to answer; max_gap 0: the largest that fits
    int pairs;                          // mqar: facts per document (<= 52 keys)
    int copy_len;                       // copy: letters L of the string
} SynConfig;

static inline SynConfig syn_default_config(SynTask task) {
    SynConfig c;
    c.task = task;
    c.seed = 1;
    c.train_tokens = 16u << 20;
    c.val_tokens = 1u << 20;
    c.seq_len = 1024;
    c.min_gap = 16;
    c.max_gap = 0;
    c.pairs = 16;
    c.copy_len = 32;
    return c;
}

static inline const char *syn_task_name(SynTask t) { return t == SYN_MQAR ? "mqar" : "copy"; }

// The gap range actually drawn from.
static inline void syn_gap_range(const SynConfig *c, long *lo, long *hi) {
    long T = c->seq_len;
    *lo = c->task == SYN_COPY ? SDM_MAX((long)c->min_gap, (long)c->copy_len + 1) : c->min_gap;
    *hi = c->max_gap ? c->max_gap : (c->task == SYN_MQAR ? T - 5 : T - 3 - c->copy_len);
}

static inline int syn_config_check(const SynConfig *c, char *err) {
    long T = c->seq_len, lo, hi;
    syn_gap_range(c, &lo, &hi);
    if (T < 16 || T > (1 << 24))
        return data_fail(err, "%s: seq_len must be in 16..2^24 (got %ld)", syn_task_name(c->task), T);
    if (c->train_tokens == 0) return data_fail(err, "%s: train_tokens must be positive", syn_task_name(c->task));
    if (c->task == SYN_MQAR) {
        if (c->pairs < 1 || c->pairs > SYN_NUM_KEYS)
            return data_fail(err, "mqar: pairs must be in 1..%d (got %d)", SYN_NUM_KEYS, c->pairs);
        if (6L * c->pairs + 4 > T)  // the facts, and room for every query after them
            return data_fail(err, "mqar: %d pairs need seq_len >= %d (got %ld)", c->pairs, 6 * c->pairs + 4, T);
        if (lo < 1 || hi < lo || hi > T - 5)
            return data_fail(err, "mqar: need 1 <= min_gap <= max_gap <= seq_len - 5 = %ld (got %ld, %ld)", T - 5, lo,
                             hi);
        if (hi < 3L * c->pairs)  // the first fact's query comes after the last fact
            return data_fail(err, "mqar: max_gap %ld cannot reach past %d facts (need >= %d)", hi, c->pairs,
                             3 * c->pairs);
    } else {
        if (c->copy_len < 1) return data_fail(err, "copy: copy_len must be positive (got %d)", c->copy_len);
        if (hi < lo || hi > T - 3 - c->copy_len)
            return data_fail(err, "copy: need copy_len + 1 <= min_gap <= max_gap <= seq_len - 3 - copy_len = %ld "
                             "(got gaps %ld, %ld with copy_len %d)", T - 3 - c->copy_len, lo, hi, c->copy_len);
    }
    return 0;
}

static inline int syn_is_key(int32_t t) { return (t >= 'A' && t <= 'Z') || (t >= 'a' && t <= 'z'); }
static inline int syn_is_value(int32_t t) { return t >= '0' && t <= '9'; }
static inline int syn_is_filler(int32_t t) { return t > 0 && t < 128 && strchr(SYN_FILLER, (int)t) != NULL; }

// doc [T]: BOS, T-2 filler tokens, EOS.
static inline void syn_fill(Rng *r, int32_t *doc, long T) {
    doc[0] = TOK_BOS;
    for (long i = 1; i < T - 1; i++) doc[i] = (uint8_t)SYN_FILLER[rng_below(r, sizeof SYN_FILLER - 1)];
    doc[T - 1] = TOK_EOS;
}

// One MQAR document into doc [T]. Returns the number of facts left unqueried.
static inline int syn_mqar_document(Rng *r, const SynConfig *c, int32_t *doc) {
    const long T = c->seq_len, P = c->pairs;
    long lo, hi;
    int keys[SYN_NUM_KEYS], dropped = 0;
    syn_gap_range(c, &lo, &hi);
    syn_fill(r, doc, T);
    for (int i = 0; i < SYN_NUM_KEYS; i++) keys[i] = i;
    for (int i = 0; i < P; i++) {  // partial Fisher-Yates: P distinct keys
        int j = i + (int)rng_below(r, (uint32_t)(SYN_NUM_KEYS - i)), t = keys[i];
        keys[i] = keys[j];
        keys[j] = t;
        doc[1 + 3 * i] = SYN_FACT;
        doc[2 + 3 * i] = (uint8_t)SYN_KEYS[keys[i]];
        doc[3 + 3 * i] = (uint8_t)SYN_VALUES[rng_below(r, 10)];
    }
    for (int i = 0; i < P; i++) {  // the first facts have the fewest places for their queries: they go first
        const long v = 3 + 3L * i;  // the fact's value
        int placed = 0;
        for (int tries = 0; tries < SYN_TRIES && !placed; tries++) {
            long a = v + recall_log_uniform(r, lo, hi);  // the query's value
            if (a - 2 <= 3 * P || a > T - 2) continue;
            if (!syn_is_filler(doc[a - 2]) || !syn_is_filler(doc[a - 1]) || !syn_is_filler(doc[a])) continue;
            doc[a - 2] = SYN_QUERY;
            doc[a - 1] = doc[v - 1];
            doc[a] = doc[v];
            placed = 1;
        }
        dropped += !placed;
    }
    return dropped;
}

// One copy document into doc [T].
static inline void syn_copy_document(Rng *r, const SynConfig *c, int32_t *doc) {
    const long T = c->seq_len, L = c->copy_len;
    long lo, hi;
    syn_gap_range(c, &lo, &hi);
    syn_fill(r, doc, T);
    long g = recall_log_uniform(r, lo, hi);
    long m = 1 + (long)rng_below(r, (uint32_t)(T - 2 - L - g));  // COPY_FROM at m, COPY_TO at m + g <= T-2-L
    doc[m] = SYN_COPY_FROM;
    doc[m + g] = SYN_COPY_TO;
    for (long i = 1; i <= L; i++) doc[m + i] = doc[m + g + i] = (uint8_t)SYN_KEYS[rng_below(r, SYN_NUM_KEYS)];
}

// One document of c's task into doc [T]; returns the facts left unqueried (mqar).
static inline int syn_document(Rng *r, const SynConfig *c, int32_t *doc) {
    if (c->task == SYN_MQAR) return syn_mqar_document(r, c, doc);
    syn_copy_document(r, c, doc);
    return 0;
}

// Split `split` (0 train, 1 validation) as whole documents, at least `tokens` tokens. *dropped += unqueried facts.
static inline int syn_write_split(const SynConfig *c, uint64_t split, uint64_t tokens, ShardWriter *w,
                                  uint64_t *dropped, char *err) {
    Rng r = rng_make(c->seed * 2 + split);
    int32_t *doc = (int32_t *)sdm_malloc((size_t)c->seq_len * sizeof(int32_t));
    int rc = 0;
    while (rc == 0 && w->total_tokens < tokens) {
        *dropped += (uint64_t)syn_document(&r, c, doc);
        rc = shard_writer_append(w, doc, (size_t)c->seq_len, err);
    }
    free(doc);
    return rc;
}

// DIR/{task}_train_*.bin and DIR/{task}_val_*.bin; every shard holds whole documents (a multiple of T tokens).
static inline int syn_dataset_write(const char *dir, const SynConfig *c, uint64_t *dropped, char *err) {
    const uint64_t T = (uint64_t)c->seq_len, shard = SDM_MAX(T, SYN_SHARD_TOKENS / T * T);
    const uint64_t sizes[2] = {c->train_tokens, c->val_tokens};
    const char *splits[2] = {"train", "val"};
    *dropped = 0;
    if (syn_config_check(c, err) || dataset_make_dir(dir, err)) return -1;
    for (int split = 0; split < 2; split++) {
        char prefix[32];
        ShardWriter w;
        snprintf(prefix, sizeof prefix, "%s_%s", syn_task_name(c->task), splits[split]);
        if (shard_writer_open(&w, dir, prefix, TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES, shard, err)) return -1;
        if (syn_write_split(c, (uint64_t)split, sizes[split], &w, dropped, err)) { shard_writer_abort(&w); return -1; }
        if (shard_writer_close(&w, err)) return -1;
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------------------
// Scorers: tokens [T+1] one row, pred [T] with pred[t] the prediction of tokens[t+1]. Accumulate into s.

static inline void syn_score_init(GapScore *s) { gap_score_init(s, SYN_GAP_FIRST, SYN_BUCKETS); }

// Position of the marker `marker` before `before` in the same document (for mqar, followed by `key` and a
// value), or -1.
static inline long syn_find_before(const int32_t *tokens, long before, int32_t marker, int32_t key) {
    for (long j = before - 1; j >= 0; j--) {
        if (tok_is_special(tokens[j])) return -1;
        if (tokens[j] == marker && (marker != SYN_FACT || (tokens[j + 1] == key && syn_is_value(tokens[j + 2]))))
            return j;
    }
    return -1;
}

// Every "QUERY key value" whose value is in the row; its fact is the nearest earlier "FACT key value".
static inline void mqar_score_row(GapScore *s, const int32_t *tokens, const int32_t *pred, long T) {
    for (long q = 0; q + 2 <= T; q++) {
        if (tokens[q] != SYN_QUERY || !syn_is_key(tokens[q + 1]) || !syn_is_value(tokens[q + 2])) continue;
        long f = syn_find_before(tokens, q - 2, SYN_FACT, tokens[q + 1]);  // a fact needs 3 tokens before q
        if (f < 0) { s->unanswerable++; continue; }
        gap_score_add(s, q - f, 1, pred[q + 1] == tokens[q + 2]);
    }
}

// Every "COPY_TO letters" whose letters end inside the row; the original follows the nearest earlier COPY_FROM.
static inline void copy_score_row(GapScore *s, const int32_t *tokens, const int32_t *pred, long T) {
    for (long q = 0; q < T; q++) {
        if (tokens[q] != SYN_COPY_TO) continue;
        long L = 0;
        while (q + 1 + L <= T && syn_is_key(tokens[q + 1 + L])) L++;
        if (L == 0 || q + 1 + L > T) continue;  // the copy must end inside the row
        long f = syn_find_before(tokens, q, SYN_COPY_FROM, 0);
        if (f < 0) { s->unanswerable++; continue; }
        long right = 0;
        for (long i = 0; i < L; i++) right += pred[q + i] == tokens[q + 1 + i];
        gap_score_add(s, q - f, L, right);
        q += L;
    }
}

// ---------------------------------------------------------------------------------------------------------
// Every task's scorer, for evaluation. A scorer only counts its own marker structure, so running all of them
// on any data (`eval.task = auto`) reports the tasks that are there.

typedef struct {
    const char *name;
    void (*init)(GapScore *);
    void (*score_row)(GapScore *, const int32_t *tokens, const int32_t *pred, long T);
} EvalTask;

static const EvalTask EVAL_TASKS[] = {
    {"recall", recall_score_init, recall_score_row},
    {"mqar", syn_score_init, mqar_score_row},
    {"copy", syn_score_init, copy_score_row},
};
#define EVAL_NUM_TASKS ((int)(sizeof EVAL_TASKS / sizeof EVAL_TASKS[0]))

#endif
