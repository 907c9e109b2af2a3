// data/recall.h: the long-range associative-recall task of the embedded default dataset, and its scorer.
//
// A document is grammar-generated English filler (data/filler.h) with facts and, much later, queries:
//     fact:   "The pin of kavomi is 40917."
//     query:  "Question: what is the pin of kavomi? Answer: 40917."
// Keys are random pronounceable words, unique within a document; values are 5 random digits. Every fact is
// queried queries_per_fact times. A query is placed so that the gap (in bytes = tokens) from the first digit of
// the fact's value to the first digit of the query's answer is at least g, g drawn log-uniformly from
// [min_gap, max_gap]; it exceeds g by at most one filler sentence (RECALL_MAX_OVERSHOOT bytes).
//
// The scorer reads a row of tokens and the model's per-position predictions, finds every query whose answer
// and fact both lie in the row (inside one document), and reports digit accuracy and exact-answer accuracy
// per gap bucket. It needs no metadata, so it works on any batch the dataloader produces.
#ifndef SDM_DATA_RECALL_H
#define SDM_DATA_RECALL_H

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/rng.h"
#include "data/eval_stats.h"
#include "data/filler.h"
#include "data/jsonl.h"
#include "data/shard.h"
#include "data/tokenizer.h"

#define RECALL_VALUE_DIGITS 5
#define RECALL_MAX_FACTS 64
#define RECALL_MAX_GAP (1 << 20)  // a document is about 1.5 max_gap bytes: --min-gap 1e9 would write GBs per document
#define RECALL_MAX_OVERSHOOT 400  // > the longest filler sentence plus the query text before its answer
#define RECALL_QUERY_PREFIX "Question: what is the "
#define RECALL_QUERY_MID "? Answer: "

static const char *recall_relations[] = {"code", "pin", "locker number", "room number", "ticket number"};

typedef struct {
    uint64_t seed;
    uint64_t train_tokens, val_tokens;  // generation stops at the first document end past these sizes
    int min_gap, max_gap;               // bytes from a fact's value to its query's answer (see above)
    int min_facts, max_facts;           // facts per document
    int queries_per_fact;
} RecallConfig;

static inline RecallConfig recall_default_config(void) {
    RecallConfig c;
    c.seed = 1;
    c.train_tokens = 16u << 20;
    c.val_tokens = 1u << 20;
    c.min_gap = 256;
    c.max_gap = 4096;
    c.min_facts = 4;
    c.max_facts = 12;
    c.queries_per_fact = 2;
    return c;
}

static inline int recall_config_check(const RecallConfig *c, char *err) {
    if (c->min_gap < 1 || c->max_gap < c->min_gap || c->max_gap > RECALL_MAX_GAP)
        return data_fail(err, "recall: need 1 <= min_gap <= max_gap <= %d (got %d, %d)", RECALL_MAX_GAP, c->min_gap,
                         c->max_gap);
    if (c->min_facts < 1 || c->max_facts < c->min_facts || c->max_facts > RECALL_MAX_FACTS)
        return data_fail(err, "recall: need 1 <= min_facts <= max_facts <= %d (got %d, %d)", RECALL_MAX_FACTS,
                         c->min_facts, c->max_facts);
    if (c->queries_per_fact < 1 || c->queries_per_fact > 8)
        return data_fail(err, "recall: queries_per_fact must be in 1..8 (got %d)", c->queries_per_fact);
    if (c->train_tokens == 0) return data_fail(err, "recall: train_tokens must be positive");
    return 0;
}

typedef struct {
    char key[16];
    char value[RECALL_VALUE_DIGITS + 1];
    const char *relation;
    long value_pos;    // byte offset of the value in the document once stated, -1 before
    long target;       // the document length at which to state the fact
} RecallFact;

typedef struct { int fact; long target; } RecallQuery;  // ask when the answer would start at or after target

static inline void recall_make_key(Rng *r, char key[16]) {
    static const char consonants[] = "bdfgklmnprstvz", vowels[] = "aeiou";
    int syllables = 2 + (int)rng_below(r, 2), n = 0;
    for (int s = 0; s < syllables; s++) {
        key[n++] = consonants[rng_below(r, sizeof consonants - 1)];
        key[n++] = vowels[rng_below(r, sizeof vowels - 1)];
    }
    if (rng_below(r, 2)) key[n++] = consonants[rng_below(r, sizeof consonants - 1)];
    key[n] = 0;
}

static inline void recall_make_facts(Rng *r, const RecallConfig *c, RecallFact *facts, int nf) {
    for (int i = 0; i < nf; i++) {
        RecallFact *f = &facts[i];
        for (int unique = 0; !unique;) {
            recall_make_key(r, f->key);
            unique = 1;
            for (int j = 0; j < i; j++) unique &= strcmp(facts[j].key, f->key) != 0;
        }
        for (int d = 0; d < RECALL_VALUE_DIGITS; d++) f->value[d] = (char)('0' + rng_below(r, 10));
        f->value[RECALL_VALUE_DIGITS] = 0;
        f->relation = FILLER_PICK(r, recall_relations);
        f->value_pos = -1;
        f->target = (long)rng_below(r, (uint32_t)c->max_gap / 2 + 1);  // facts spread over the first half-gap
    }
}

// An integer log-uniform in [lo, hi].
static inline long recall_log_uniform(Rng *r, long lo, long hi) {
    long g = (long)floor(exp(rng_range(r, log((double)lo), log((double)hi))));
    return SDM_MAX(lo, SDM_MIN(g, hi));
}

static inline long recall_draw_gap(Rng *r, const RecallConfig *c) {
    return recall_log_uniform(r, c->min_gap, c->max_gap);
}

static inline void recall_append(ByteBuf *out, const char *s) { bytebuf_append(out, s, strlen(s)); }

static inline void recall_state_fact(ByteBuf *out, RecallFact *f) {
    filler_word(out, "The");
    filler_word(out, f->relation);
    filler_word(out, "of");
    filler_word(out, f->key);
    filler_word(out, "is");
    bytebuf_append(out, " ", 1);
    f->value_pos = (long)out->len;
    recall_append(out, f->value);
    recall_append(out, ".");
}

static inline size_t recall_query_answer_offset(const RecallFact *f) {
    return 1 + strlen(RECALL_QUERY_PREFIX) + strlen(f->relation) + 4 + strlen(f->key) + strlen(RECALL_QUERY_MID);
}

static inline void recall_ask(ByteBuf *out, const RecallFact *f) {
    filler_word(out, RECALL_QUERY_PREFIX);
    recall_append(out, f->relation);
    recall_append(out, " of ");
    recall_append(out, f->key);
    recall_append(out, RECALL_QUERY_MID);
    recall_append(out, f->value);
    recall_append(out, ".");
}

// Filler between events; a new paragraph now and then.
static inline void recall_filler(Rng *r, ByteBuf *out) {
    if (out->len > 0 && rng_below(r, 6) == 0) recall_append(out, "\n");
    filler_sentence(r, out);
}

// One document's text (no BOS/EOS) into out (cleared first).
static inline void recall_generate_document(Rng *r, const RecallConfig *c, ByteBuf *out) {
    RecallFact facts[RECALL_MAX_FACTS];
    RecallQuery queries[RECALL_MAX_FACTS * 8];
    int nf = c->min_facts + (int)rng_below(r, (uint32_t)(c->max_facts - c->min_facts + 1));
    int stated = 0, nq = 0, asked = 0;
    out->len = 0;
    recall_make_facts(r, c, facts, nf);
    while (stated < nf || asked < nq) {
        int next_fact = -1, next_query = -1;
        for (int i = 0; i < nf; i++)
            if (facts[i].value_pos < 0 && (next_fact < 0 || facts[i].target < facts[next_fact].target)) next_fact = i;
        for (int q = 0; q < nq; q++)
            if (queries[q].fact >= 0 && (next_query < 0 || queries[q].target < queries[next_query].target))
                next_query = q;
        if (next_query >= 0 && (long)out->len >= queries[next_query].target) {
            recall_ask(out, &facts[queries[next_query].fact]);
            queries[next_query].fact = -1;
            asked++;
        } else if (next_fact >= 0 && (long)out->len >= facts[next_fact].target) {
            RecallFact *f = &facts[next_fact];
            recall_state_fact(out, f);
            for (int k = 0; k < c->queries_per_fact; k++, nq++) {
                queries[nq].fact = next_fact;
                queries[nq].target = f->value_pos + recall_draw_gap(r, c) - (long)recall_query_answer_offset(f);
            }
            stated++;
        } else {
            recall_filler(r, out);
        }
    }
    recall_filler(r, out);
}

// The whole split as one token stream (BOS + document + EOS, ...) of at least `tokens` tokens.
static inline int recall_write_split(const RecallConfig *c, uint64_t stream, uint64_t tokens, ShardWriter *w,
                                     char *err) {
    Rng r = rng_make(c->seed * 2 + stream);
    ByteBuf doc = {NULL, 0, 0};
    int32_t *tok = NULL;
    size_t cap = 0;
    int rc = 0;
    while (rc == 0 && w->total_tokens < tokens) {
        recall_generate_document(&r, c, &doc);
        if (cap < doc.len + 2) {
            free(tok);
            cap = 2 * (doc.len + 2);
            tok = (int32_t *)sdm_malloc(cap * sizeof(int32_t));
        }
        rc = shard_writer_append(w, tok, tok_encode_document(doc.data, doc.len, tok), err);
    }
    free(tok);
    bytebuf_free(&doc);
    return rc;
}

// ---------------------------------------------------------------------------------------------------------
// Scorer, into a GapScore (data/eval_stats.h) with buckets [0,256), [256,512), ..., [8192, inf).

#define RECALL_GAP_FIRST 256
#define RECALL_BUCKETS 7

static inline void recall_score_init(GapScore *s) { gap_score_init(s, RECALL_GAP_FIRST, RECALL_BUCKETS); }

// tokens[pos..] equals the bytes of s?
static inline int recall_match(const int32_t *tokens, long n, long pos, const char *s, size_t len) {
    if (pos < 0 || pos + (long)len > n) return 0;
    for (size_t i = 0; i < len; i++)
        if (tokens[pos + (long)i] != (uint8_t)s[i]) return 0;
    return 1;
}

// Length of the run of tokens from pos accepted by want (letters or digits, or the relation text up to " of ").
static inline long recall_run(const int32_t *tokens, long n, long pos, int digits) {
    long i = pos;
    while (i < n && tokens[i] < 128 && (digits ? isdigit(tokens[i]) : (isalpha(tokens[i]) || tokens[i] == ' '))) i++;
    return i - pos;
}

// Position of the value of the fact "The <relation> of <key> is " stated before `before` in the same document, or -1.
static inline long recall_find_fact(const int32_t *tokens, long before, const char *fact, size_t len) {
    for (long j = before - (long)len; j >= 0; j--) {
        if (tok_is_special(tokens[j + (long)len - 1])) return -1;  // crossed into the previous document
        if (recall_match(tokens, before, j, fact, len)) return j + (long)len;
    }
    return -1;
}

// tokens [T+1] one row; pred [T]: pred[t] is the model's prediction of tokens[t+1]. Accumulates into s.
static inline void recall_score_row(GapScore *s, const int32_t *tokens, const int32_t *pred, long T) {
    const size_t plen = strlen(RECALL_QUERY_PREFIX), mlen = strlen(RECALL_QUERY_MID);
    const long n = T + 1;
    for (long q = 0; q + (long)plen <= n; q++) {
        if (!recall_match(tokens, n, q, RECALL_QUERY_PREFIX, plen)) continue;
        // "<relation> of <key>? Answer: <digits>"
        long a = q + (long)plen, head = recall_run(tokens, n, a, 0), key_start = a + head;
        while (key_start > a && tokens[key_start - 1] != ' ') key_start--;  // the key is the last word
        long rel_end = key_start - 4;                                     // before " of "
        if (rel_end <= a || !recall_match(tokens, n, rel_end, " of ", 4) ||
            !recall_match(tokens, n, a + head, RECALL_QUERY_MID, mlen))
            continue;
        long ans = a + head + (long)mlen, nd = recall_run(tokens, n, ans, 1);
        if (nd == 0 || ans + nd >= n) continue;  // the answer must end inside the row
        char fact[96];
        long rel_len = rel_end - a, key_len = a + head - key_start;
        if (rel_len + key_len + 12 >= (long)sizeof fact) continue;
        size_t f = 0;
        memcpy(fact, "The ", 4); f = 4;
        for (long i = a; i < rel_end; i++) fact[f++] = (char)tokens[i];
        memcpy(fact + f, " of ", 4); f += 4;
        for (long i = key_start; i < a + head; i++) fact[f++] = (char)tokens[i];
        memcpy(fact + f, " is ", 4); f += 4;
        long v = recall_find_fact(tokens, q, fact, f);
        if (v < 0) { s->unanswerable++; continue; }
        long right = 0;
        for (long i = ans; i < ans + nd; i++) right += pred[i - 1] == tokens[i];  // ans >= 1: after the query
        gap_score_add(s, ans - v, nd, right);
        q = ans + nd - 1;
    }
}

#endif
