// tests/test_data_synthetic.c: the MQAR and copy generators (document length, alphabets, gaps within bounds,
// answers recoverable, determinism by seed), their shards through the dataloader (row k = document k), the
// scorers on hand-made rows (perfect, wrong, partial, unanswerable), and the log-spaced accumulators of
// data/eval_stats.h.
#define _POSIX_C_SOURCE 200809L
#include <limits.h>

#include "data/dataloader.h"
#include "data/synthetic.h"
#include "tests/test.h"
#include "tests/test_data_util.h"

static SynConfig config(SynTask task, int T, int min_gap, int max_gap) {
    SynConfig c = syn_default_config(task);
    c.seed = 5;
    c.seq_len = T;
    c.min_gap = min_gap;
    c.max_gap = max_gap;
    c.train_tokens = 64u * (uint64_t)T;
    c.val_tokens = 16u * (uint64_t)T;
    return c;
}

// The invariants of one document; returns the number of problems (printed).
static int check_mqar_document(const SynConfig *c, const int32_t *doc, int dropped) {
    const long T = c->seq_len, P = c->pairs;
    long lo, hi;
    int bad = 0, queries = 0;
    syn_gap_range(c, &lo, &hi);
    bad += doc[0] != TOK_BOS || doc[T - 1] != TOK_EOS;
    for (long i = 0; i < P; i++) {
        bad += doc[1 + 3 * i] != SYN_FACT || !syn_is_key(doc[2 + 3 * i]) || !syn_is_value(doc[3 + 3 * i]);
        for (long j = 0; j < i; j++) bad += doc[2 + 3 * j] == doc[2 + 3 * i];  // distinct keys
    }
    for (long t = 1 + 3 * P; t < T - 1; t++) {
        if (syn_is_filler(doc[t])) continue;
        if (doc[t] != SYN_QUERY || t + 2 > T - 2) { bad++; continue; }
        long f = 0;
        while (f < P && doc[2 + 3 * f] != doc[t + 1]) f++;
        long gap = t + 2 - (3 + 3 * f);
        if (f == P || doc[3 + 3 * f] != doc[t + 2] || gap < lo || gap > hi) {
            printf("query at %ld: key %d value %d gap %ld (bounds %ld..%ld)\n", t, doc[t + 1], doc[t + 2], gap, lo, hi);
            bad++;
        }
        queries++;
        t += 2;
    }
    bad += queries + dropped != P;
    return bad;
}

static int check_copy_document(const SynConfig *c, const int32_t *doc) {
    const long T = c->seq_len, L = c->copy_len;
    long lo, hi, from = -1, to = -1;
    int bad = doc[0] != TOK_BOS || doc[T - 1] != TOK_EOS;
    syn_gap_range(c, &lo, &hi);
    for (long t = 1; t < T - 1; t++) {
        if (doc[t] == SYN_COPY_FROM) bad += from >= 0, from = t;
        else if (doc[t] == SYN_COPY_TO) bad += to >= 0, to = t;
        else if (!syn_is_filler(doc[t]) && !syn_is_key(doc[t])) bad++;
    }
    if (from < 0 || to < 0) return bad + 1;
    bad += to - from < lo || to - from > hi || to + L > T - 2;
    for (long i = 1; i <= L; i++) bad += !syn_is_key(doc[from + i]) || doc[from + i] != doc[to + i];
    bad += syn_is_key(doc[from + L + 1]) || syn_is_key(doc[to + L + 1]);  // exactly L letters
    return bad;
}

static void test_generator(void) {
    const SynConfig cases[] = {
        config(SYN_MQAR, 1024, 16, 0), config(SYN_MQAR, 256, 3, 60), config(SYN_MQAR, 2048, 512, 1500),
        config(SYN_COPY, 1024, 16, 0), config(SYN_COPY, 128, 1, 60),
    };
    char err[DATA_ERR_LEN];
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const SynConfig *c = &cases[k];
        CHECK(syn_config_check(c, err) == 0, "case %zu: %s", k, err);
        int32_t *doc = (int32_t *)sdm_malloc((size_t)c->seq_len * sizeof(int32_t));
        Rng r = rng_make(c->seed);
        long lo, hi, gmin = LONG_MAX, gmax = 0;
        int bad = 0, dropped = 0;
        syn_gap_range(c, &lo, &hi);
        for (int d = 0; d < 300; d++) {
            int drop = syn_document(&r, c, doc);
            dropped += drop;
            bad += c->task == SYN_MQAR ? check_mqar_document(c, doc, drop) : check_copy_document(c, doc);
            GapScore s;  // the scorer recovers every answer from the document with the next BOS
            syn_score_init(&s);
            int32_t *row = (int32_t *)sdm_malloc((size_t)(c->seq_len + 1) * sizeof(int32_t));
            memcpy(row, doc, (size_t)c->seq_len * sizeof(int32_t));
            row[c->seq_len] = TOK_BOS;
            EVAL_TASKS[c->task == SYN_MQAR ? 1 : 2].score_row(&s, row, row + 1, c->seq_len);
            uint64_t q, exact, tok, right;
            gap_score_totals(&s, &q, &exact, &tok, &right);
            bad += q != (c->task == SYN_MQAR ? (uint64_t)(c->pairs - drop) : 1) || exact != q || s.unanswerable;
            for (int b = 0; b < s.n; b++)
                if (s.queries[b])
                    gmin = SDM_MIN(gmin, gap_bucket_low(&s, b)), gmax = SDM_MAX(gmax, gap_bucket_low(&s, b));
            free(row);
        }
        printf("%s T=%d gaps %ld..%ld: buckets from %ld to %ld, %d facts unqueried in 300 documents\n",
               syn_task_name(c->task), c->seq_len, lo, hi, gmin, gmax, dropped);
        CHECK(bad == 0, "case %zu (%s): %d problems", k, syn_task_name(c->task), bad);
        CHECK(dropped < 30, "case %zu: %d facts unqueried", k, dropped);
        CHECK(gmax >= hi / 2 && gmin <= SDM_MAX(lo, 32), "case %zu: gaps do not span %ld..%ld", k, lo, hi);
        free(doc);
    }
    SynConfig bad = config(SYN_MQAR, 64, 16, 0);
    CHECK(syn_config_check(&bad, err) != 0 && strstr(err, "seq_len"), "16 pairs in T=64 accepted: %s", err);
    bad = config(SYN_MQAR, 1024, 16, 40);
    CHECK(syn_config_check(&bad, err) != 0 && strstr(err, "reach past"), "max_gap shorter than the facts accepted: %s",
          err);
    bad = config(SYN_MQAR, 1024, 16, 1020);
    CHECK(syn_config_check(&bad, err) != 0 && strstr(err, "max_gap"), "max_gap beyond the row accepted: %s", err);
    bad = config(SYN_COPY, 1024, 16, 0);
    bad.copy_len = 600;
    CHECK(syn_config_check(&bad, err) != 0 && strstr(err, "copy_len"), "a copy longer than the row accepted: %s", err);
}

// Whole files from the same seed are identical; another seed differs.
static void test_determinism(void) {
    char dir[TEST_PATH_LEN], one[TEST_PATH_LEN + 8], two[TEST_PATH_LEN + 8], path[TEST_PATH_LEN + 64];
    char err[DATA_ERR_LEN] = "";
    test_tmpdir(dir);
    snprintf(one, sizeof one, "%s/one", dir);
    snprintf(two, sizeof two, "%s/two", dir);
    for (int task = 0; task < 2; task++) {
        SynConfig c = config((SynTask)task, 512, 16, 0);
        uint64_t dropped;
        size_t n1, n2, n3;
        const char *name = syn_task_name(c.task);
        CHECK(syn_dataset_write(one, &c, &dropped, err) == 0 && syn_dataset_write(two, &c, &dropped, err) == 0, "%s",
              err);
        snprintf(path, sizeof path, "%s/%s_train_000000.bin", one, name);
        uint8_t *x = test_read_file(path, &n1);
        snprintf(path, sizeof path, "%s/%s_train_000000.bin", two, name);
        uint8_t *y = test_read_file(path, &n2);
        CHECK(n1 == n2 && n1 == SHARD_HEADER_BYTES + 2 * c.train_tokens && memcmp(x, y, n1) == 0,
              "%s: same seed, different files (%zu, %zu bytes)", name, n1, n2);
        c.seed = 6;
        CHECK(syn_dataset_write(two, &c, &dropped, err) == 0, "%s", err);
        uint8_t *z = test_read_file(path, &n3);
        CHECK(n3 == n1 && memcmp(x, z, n1) != 0, "%s: seeds 5 and 6 give the same file", name);
        free(x);
        free(y);
        free(z);
    }
    test_rmdir(dir);
}

// Shards of whole documents through the loader: every row (shuffled, over two shards) is one document plus the
// next BOS, and true predictions score every query exact with none unanswerable.
static void test_rows_are_documents(void) {
    char dir[TEST_PATH_LEN], pattern[TEST_PATH_LEN + 64], err[DATA_ERR_LEN] = "";
    test_tmpdir(dir);
    const int T = 1024, B = 8;
    SynConfig c = config(SYN_MQAR, T, 16, 0);
    c.train_tokens = (SYN_SHARD_TOKENS / T + 100) * (uint64_t)T;  // two shards
    uint64_t dropped;
    CHECK(syn_dataset_write(dir, &c, &dropped, err) == 0, "%s", err);
    snprintf(pattern, sizeof pattern, "%s/mqar_train_*.bin", dir);
    DataLoader dl;
    CHECK(dataloader_open(&dl, pattern, B, T, 0, 1, 3, 1, TOK_BYTES_VOCAB, err) == 0, "%s", err);
    CHECK(dl.num_shards == 2, "%d shards", dl.num_shards);
    int32_t *batch = (int32_t *)sdm_malloc((size_t)B * (T + 1) * sizeof(int32_t));
    GapScore s;
    syn_score_init(&s);
    int misaligned = 0;
    for (int k = 0; k < 64 && dataloader_next_batch(&dl, batch, err) == 0; k++)
        for (int b = 0; b < B; b++) {
            const int32_t *row = batch + (size_t)b * (T + 1);
            misaligned += row[0] != TOK_BOS || row[T - 1] != TOK_EOS || row[T] != TOK_BOS;
            mqar_score_row(&s, row, row + 1, T);
        }
    uint64_t q, exact, tok, right;
    gap_score_totals(&s, &q, &exact, &tok, &right);
    gap_score_print(&s, "mqar", stdout);
    CHECK(misaligned == 0, "%d rows are not exactly one document", misaligned);
    CHECK(q > 64 * B * 15 && exact == q && s.unanswerable == 0, "%llu queries, %llu exact, %llu unanswerable",
          (unsigned long long)q, (unsigned long long)exact, (unsigned long long)s.unanswerable);
    dataloader_close(&dl);
    free(batch);
    test_rmdir(dir);
}

// Tokens of a hand-written row: '@' FACT, '?' QUERY, '<' COPY_FROM, '>' COPY_TO, '^' BOS, '$' EOS; others as is.
static long hand_row(const char *text, int32_t *row) {
    long n = 0;
    for (const char *p = text; *p; p++)
        row[n++] = *p == '@' ? SYN_FACT : *p == '?' ? SYN_QUERY : *p == '<' ? SYN_COPY_FROM : *p == '>' ? SYN_COPY_TO
                 : *p == '^' ? TOK_BOS : *p == '$' ? TOK_EOS : (uint8_t)*p;
    return n;
}

static void test_mqar_scorer(void) {
    int32_t row[256], pred[256];
    long n = hand_row("^@a1@b2..........................?b2.?a1?c3..$", row);
    const long T = n - 1;
    GapScore s;
    uint64_t q, exact, tok, right;
    for (long t = 0; t < T; t++) pred[t] = row[t + 1];  // perfect
    syn_score_init(&s);
    mqar_score_row(&s, row, pred, T);
    gap_score_totals(&s, &q, &exact, &tok, &right);
    CHECK(q == 2 && exact == 2 && tok == 2 && s.unanswerable == 1,
          "perfect: %llu queries, %llu exact, %llu unanswerable", (unsigned long long)q, (unsigned long long)exact,
          (unsigned long long)s.unanswerable);
    CHECK(s.queries[0] == 1 && s.queries[1] == 1, "gaps 29 (b) and 36 (a) land in [0,32) and [32,64)? %llu %llu",
          (unsigned long long)s.queries[0], (unsigned long long)s.queries[1]);
    pred[34] = '7';  // the answer of "?b2" (value at 35) is wrong; the key's prediction does not count
    pred[33] = 'x';
    syn_score_init(&s);
    mqar_score_row(&s, row, pred, T);
    gap_score_totals(&s, &q, &exact, &tok, &right);
    CHECK(q == 2 && exact == 1 && right == 1 && s.exact[0] == 0 && s.exact[1] == 1, "one wrong: %llu exact, %llu right",
          (unsigned long long)exact, (unsigned long long)right);
    // a fact in the previous document does not answer; a query cut by the row's end is not counted
    n = hand_row("^@a1$^...?a1...?b", row);
    for (long t = 0; t < n - 1; t++) pred[t] = row[t + 1];
    syn_score_init(&s);
    mqar_score_row(&s, row, pred, n - 1);
    gap_score_totals(&s, &q, &exact, &tok, &right);
    CHECK(q == 0 && s.unanswerable == 1, "across documents: %llu scored, %llu unanswerable", (unsigned long long)q,
          (unsigned long long)s.unanswerable);
}

static void test_copy_scorer(void) {
    int32_t row[256], pred[256];
    long n = hand_row("^..<abcd....>abcd..$", row);
    GapScore s;
    uint64_t q, exact, tok, right;
    for (long t = 0; t < n - 1; t++) pred[t] = row[t + 1];
    syn_score_init(&s);
    copy_score_row(&s, row, pred, n - 1);
    gap_score_totals(&s, &q, &exact, &tok, &right);
    CHECK(q == 1 && exact == 1 && tok == 4 && right == 4 && s.queries[0] == 1, "perfect copy: %llu tokens, %llu right",
          (unsigned long long)tok, (unsigned long long)right);
    pred[14] = 'z';  // predicts row[15] = 'c': partial
    syn_score_init(&s);
    copy_score_row(&s, row, pred, n - 1);
    gap_score_totals(&s, &q, &exact, &tok, &right);
    CHECK(q == 1 && exact == 0 && tok == 4 && right == 3, "partial copy: %llu exact, %llu of %llu right",
          (unsigned long long)exact, (unsigned long long)right, (unsigned long long)tok);
    for (long t = 0; t < n - 1; t++) pred[t] = '.';
    syn_score_init(&s);
    copy_score_row(&s, row, pred, n - 1);
    gap_score_totals(&s, &q, &exact, &tok, &right);
    CHECK(q == 1 && right == 0 && exact == 0, "wrong copy: %llu right", (unsigned long long)right);
    n = hand_row("^<ab..>abc", row);  // the copy runs into the row's end: its length is unknown, not scored
    syn_score_init(&s);
    copy_score_row(&s, row, row + 1, n - 1);
    CHECK(s.queries[0] == 0 && s.unanswerable == 0, "a cut copy was scored");
    n = hand_row("^<ab.$^>ab.", row);
    syn_score_init(&s);
    copy_score_row(&s, row, row + 1, n - 1);
    CHECK(s.queries[0] == 0 && s.unanswerable == 1, "a copy across documents was scored");
}

// Each scorer counts only its own task: run on the other tasks' rows (and on recall text) it finds nothing.
static void test_tasks_are_disjoint(void) {
    const int T = 4096;  // holds most of a recall document
    int32_t *row = (int32_t *)sdm_malloc((size_t)(T + 1) * sizeof(int32_t));
    RecallConfig rc = recall_default_config();
    Rng r = rng_make(9);
    ByteBuf doc = {NULL, 0, 0};
    int wrong = 0;
    for (int k = 0; k < 50; k++) {
        int task = k % 3;
        if (task == 0) {
            recall_generate_document(&r, &rc, &doc);
            long m = (long)tok_encode_document(doc.data, SDM_MIN(doc.len, (size_t)T - 1), row);
            for (long t = m; t <= T; t++) row[t] = ' ';
        } else {
            SynConfig c = config(task == 1 ? SYN_MQAR : SYN_COPY, T, 16, 0);
            syn_document(&r, &c, row);
            row[T] = TOK_BOS;
        }
        for (int e = 0; e < EVAL_NUM_TASKS; e++) {
            if (e == task) continue;
            GapScore s;
            EVAL_TASKS[e].init(&s);
            EVAL_TASKS[e].score_row(&s, row, row + 1, T);
            uint64_t q, exact, tok, right;
            gap_score_totals(&s, &q, &exact, &tok, &right);
            wrong += q > 0 || s.unanswerable > 0;
        }
    }
    CHECK(wrong == 0, "%d scorers found answers in another task's rows", wrong);
    bytebuf_free(&doc);
    free(row);
}

static void test_eval_stats(void) {
    GapScore s;
    gap_score_init(&s, 32, 4);  // [0,32) [32,64) [64,128) [128,inf)
    const long gaps[] = {1, 31, 32, 63, 64, 127, 128, 100000};
    const int want[] = {0, 0, 1, 1, 2, 2, 3, 3};
    int bad = 0;
    for (int i = 0; i < 8; i++) bad += gap_bucket(&s, gaps[i]) != want[i];
    CHECK(bad == 0 && gap_bucket_high(&s, 3) == -1 && gap_bucket_low(&s, 3) == 128, "gap buckets");
    PositionLoss p;
    position_loss_init(&p, 10);  // [1,1] [2,3] [4,7] [8,10]
    float losses[20];
    for (int t = 0; t < 20; t++) losses[t] = (float)(t % 10);  // row r, position t+1: loss t
    position_loss_add(&p, losses, 2);
    CHECK(p.count[0] == 2 && p.count[1] == 4 && p.count[2] == 8 && p.count[3] == 6 && p.count[4] == 0,
          "position counts");
    CHECK(p.sum[1] == 2 * (1 + 2) && p.sum[3] == 2 * (7 + 8 + 9) && position_bucket_high(&p, 3) == 10, "position sums");
    char buf[512];
    FILE *f = fmemopen(buf, sizeof buf, "w");
    position_loss_tsv(&p, 7, f);
    fclose(f);
    CHECK(strstr(buf, "7\t8\t10\t8.000000\t6\n") != NULL, "position TSV line: %s", buf);
}

int main(void) {
    test_generator();
    test_determinism();
    test_rows_are_documents();
    test_mqar_scorer();
    test_copy_scorer();
    test_tasks_are_disjoint();
    test_eval_stats();
    return test_summary();
}
