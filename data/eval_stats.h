// data/eval_stats.h: the two log-spaced accumulators of evaluation, pure C, filled on the host once per batch.
//
//   GapScore:     answers of a recall task bucketed by gap (tokens from where the answer was stated to where it
//                 is asked for): queries, exact answers (every answer token right), answer tokens, tokens right.
//                 Bucket 0 is [0, first), bucket b >= 1 is [first << (b-1), first << b), the last is open-ended.
//                 Every task's scorer (data/recall.h, data/synthetic.h) fills one.
//   PositionLoss: per-token losses bucketed by the position p = t + 1 of the token in its row (tokens seen when
//                 predicting target t+1), buckets [1,1], [2,3], [4,7], ..., the last ending at T (the paper's
//                 perplexity-by-position figure).
//
// Both print a table and append machine-readable TSV lines (one per non-empty bucket) that scripts plot:
//   eval_recall.tsv:    step  task  gap_lo  gap_hi  queries  exact_acc  token_acc    (gap_hi -1: open-ended)
//   eval_positions.tsv: step  pos_lo  pos_hi  mean_loss  count                      (pos_hi inclusive)
#ifndef SDM_DATA_EVAL_STATS_H
#define SDM_DATA_EVAL_STATS_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define GAP_MAX_BUCKETS 16

typedef struct {
    long first;  // upper edge of bucket 0
    int n;       // buckets in use, <= GAP_MAX_BUCKETS
    uint64_t queries[GAP_MAX_BUCKETS], exact[GAP_MAX_BUCKETS];      // answers, answers with every token right
    uint64_t tokens[GAP_MAX_BUCKETS], tokens_right[GAP_MAX_BUCKETS]; // answer tokens, tokens predicted right
    uint64_t unanswerable;  // queries whose statement is not in the row (before it, or in another document)
} GapScore;

static inline void gap_score_init(GapScore *s, long first, int n) {
    memset(s, 0, sizeof *s);
    s->first = first;
    s->n = n < GAP_MAX_BUCKETS ? n : GAP_MAX_BUCKETS;
}

static inline int gap_bucket(const GapScore *s, long gap) {
    int b = 0;
    for (long edge = s->first; b < s->n - 1 && gap >= edge; edge *= 2) b++;
    return b;
}

static inline long gap_bucket_low(const GapScore *s, int b) { return b == 0 ? 0 : s->first << (b - 1); }

// -1 for the open-ended last bucket
static inline long gap_bucket_high(const GapScore *s, int b) { return b == s->n - 1 ? -1 : s->first << b; }

// One answer of ntok tokens, nright of them predicted right, at distance gap from its statement.
static inline void gap_score_add(GapScore *s, long gap, long ntok, long nright) {
    int b = gap_bucket(s, gap);
    s->queries[b]++;
    s->exact[b] += (uint64_t)(nright == ntok);
    s->tokens[b] += (uint64_t)ntok;
    s->tokens_right[b] += (uint64_t)nright;
}

static inline void gap_score_totals(const GapScore *s, uint64_t *queries, uint64_t *exact, uint64_t *tokens,
                                    uint64_t *tokens_right) {
    *queries = *exact = *tokens = *tokens_right = 0;
    for (int b = 0; b < s->n; b++) {
        *queries += s->queries[b];
        *exact += s->exact[b];
        *tokens += s->tokens[b];
        *tokens_right += s->tokens_right[b];
    }
}

// One line per non-empty bucket: "mqar gap [256,512): 120 queries, token acc 0.9500, exact 0.8833".
static inline void gap_score_print(const GapScore *s, const char *task, FILE *out) {
    for (int b = 0; b < s->n; b++) {
        if (!s->queries[b]) continue;
        char hi[24];
        if (gap_bucket_high(s, b) < 0) snprintf(hi, sizeof hi, "inf");
        else snprintf(hi, sizeof hi, "%ld", gap_bucket_high(s, b));
        fprintf(out, "%s gap [%ld,%s): %llu queries, token acc %.4f, exact %.4f\n", task, gap_bucket_low(s, b), hi,
                (unsigned long long)s->queries[b], (double)s->tokens_right[b] / (double)s->tokens[b],
                (double)s->exact[b] / (double)s->queries[b]);
    }
    fprintf(out, "%s: %llu queries without their statement in the row were not scored\n", task,
            (unsigned long long)s->unanswerable);
}

static inline void gap_score_tsv(const GapScore *s, long long step, const char *task, FILE *out) {
    for (int b = 0; b < s->n; b++)
        if (s->queries[b])
            fprintf(out, "%lld\t%s\t%ld\t%ld\t%llu\t%.6f\t%.6f\n", step, task, gap_bucket_low(s, b),
                    gap_bucket_high(s, b), (unsigned long long)s->queries[b],
                    (double)s->exact[b] / (double)s->queries[b], (double)s->tokens_right[b] / (double)s->tokens[b]);
}

// ---------------------------------------------------------------------------------------------------------
// Loss by position. Bucket b holds positions [2^b, 2^(b+1) - 1].

#define POSITION_MAX_BUCKETS 32

typedef struct {
    long T;  // row length: positions 1..T
    double sum[POSITION_MAX_BUCKETS];
    uint64_t count[POSITION_MAX_BUCKETS];
} PositionLoss;

static inline void position_loss_init(PositionLoss *p, long T) {
    memset(p, 0, sizeof *p);
    p->T = T;
}

static inline int position_bucket(long pos) {
    int b = 0;
    while (pos >> (b + 1)) b++;
    return b;
}

// losses [rows, T]: losses[r*T + t] is the loss of predicting token t+1 of row r (position t+1).
static inline void position_loss_add(PositionLoss *p, const float *losses, long rows) {
    for (long r = 0; r < rows; r++)
        for (long t = 0; t < p->T; t++) {
            int b = position_bucket(t + 1);
            p->sum[b] += (double)losses[r * p->T + t];
            p->count[b]++;
        }
}

static inline long position_bucket_high(const PositionLoss *p, int b) {
    long hi = (2L << b) - 1;
    return hi < p->T ? hi : p->T;
}

static inline void position_loss_print(const PositionLoss *p, FILE *out) {
    fprintf(out, "val loss by position:");
    for (int b = 0; b < POSITION_MAX_BUCKETS; b++)
        if (p->count[b])
            fprintf(out, " [%ld,%ld] %.4f", 1L << b, position_bucket_high(p, b), p->sum[b] / (double)p->count[b]);
    fputc('\n', out);
}

static inline void position_loss_tsv(const PositionLoss *p, long long step, FILE *out) {
    for (int b = 0; b < POSITION_MAX_BUCKETS; b++)
        if (p->count[b])
            fprintf(out, "%lld\t%ld\t%ld\t%.6f\t%llu\n", step, 1L << b, position_bucket_high(p, b),
                    p->sum[b] / (double)p->count[b], (unsigned long long)p->count[b]);
}

#endif
