// The associative-recall dataset: the generator is deterministic per seed and keeps its promises (every query
// answered by an earlier fact of its document, gaps in range, keys unique, filler free of digits and task
// words); the scorer gives 100% on the true answers, about chance (10% per digit) on answers shuffled between
// queries, 0% on wrong ones; the default dataset is generated on first use and loads through the dataloader.
#define _POSIX_C_SOURCE 200809L
#include <sys/wait.h>
#include <unistd.h>

#include "data/dataloader.h"
#include "data/dataset.h"
#include "data/recall.h"
#include "tests/test.h"
#include "tests/test_data_util.h"

static RecallConfig small_config(uint64_t seed) {
    RecallConfig c = recall_default_config();
    c.seed = seed;
    c.train_tokens = 200000;
    c.val_tokens = 20000;
    return c;
}

static void generate(const RecallConfig *c, int docs, ByteBuf *all) {
    Rng r = rng_make(c->seed);
    ByteBuf doc = {NULL, 0, 0};
    all->len = 0;
    for (int i = 0; i < docs; i++) {
        recall_generate_document(&r, c, &doc);
        bytebuf_append(all, doc.data, doc.len);
        bytebuf_append(all, "\n#\n", 3);
    }
    bytebuf_free(&doc);
}

static void test_determinism(void) {
    RecallConfig a = small_config(5), b = small_config(6);
    ByteBuf x = {NULL, 0, 0}, y = {NULL, 0, 0};
    generate(&a, 20, &x);
    generate(&a, 20, &y);
    CHECK(x.len == y.len && memcmp(x.data, y.data, x.len) == 0, "seed 5 twice: different documents");
    generate(&b, 20, &y);
    CHECK(x.len != y.len || memcmp(x.data, y.data, x.len) != 0, "seeds 5 and 6: the same documents");
    bytebuf_free(&x);
    bytebuf_free(&y);
}

// Check one document independently of the scorer: parse every query with sscanf, find its fact with strstr.
static void check_document(const RecallConfig *c, const char *doc, int *queries, int *gap_min, int *gap_max,
                           int *wrong, int *overshoot) {
    const char *q = doc;
    while ((q = strstr(q, RECALL_QUERY_PREFIX)) != NULL) {
        char rel[32], key[32], value[16], fact[96];
        const char *tail = q + strlen(RECALL_QUERY_PREFIX);
        const char *of = strstr(tail, " of "), *mark = strstr(tail, RECALL_QUERY_MID);
        if (!of || !mark || of > mark || of - tail >= 32 || mark - of - 4 >= 32) { (*wrong)++; q++; continue; }
        snprintf(rel, sizeof rel, "%.*s", (int)(of - tail), tail);
        snprintf(key, sizeof key, "%.*s", (int)(mark - of - 4), of + 4);
        const char *answer = mark + strlen(RECALL_QUERY_MID);
        snprintf(value, sizeof value, "%.*s", RECALL_VALUE_DIGITS, answer);
        snprintf(fact, sizeof fact, "The %s of %s is ", rel, key);
        const char *f = strstr(doc, fact);
        if (!f || f > q || strncmp(f + strlen(fact), value, RECALL_VALUE_DIGITS) != 0 ||
            answer[RECALL_VALUE_DIGITS] != '.') {
            (*wrong)++;
        } else {
            const char *again = strstr(f + 1, fact);
            if (again && again < q) (*wrong)++;  // a key is stated once per document
            int gap = (int)(answer - (f + strlen(fact)));
            *gap_min = SDM_MIN(*gap_min, gap);
            *gap_max = SDM_MAX(*gap_max, gap);
            *overshoot += gap > c->max_gap + RECALL_MAX_OVERSHOOT;
        }
        (*queries)++;
        q = answer;
    }
}

static void test_generator_promises(void) {
    RecallConfig c = small_config(9);
    Rng r = rng_make(9);
    ByteBuf doc = {NULL, 0, 0};
    int queries = 0, expected = 0, wrong = 0, overshoot = 0, gap_min = 1 << 30, gap_max = 0, stray = 0;
    for (int d = 0; d < 60; d++) {
        int before = queries;
        recall_generate_document(&r, &c, &doc);
        bytebuf_append(&doc, "", 1);  // NUL-terminate for strstr
        check_document(&c, (const char *)doc.data, &queries, &gap_min, &gap_max, &wrong, &overshoot);
        int facts = 0;
        for (const char *p = (const char *)doc.data; (p = strstr(p, " is ")) != NULL; p++)
            facts += p[4] >= '0' && p[4] <= '9';
        expected += facts * c.queries_per_fact;
        stray += queries - before != facts * c.queries_per_fact;
    }
    printf("recall generator: %d queries, gaps %d..%d\n", queries, gap_min, gap_max);
    CHECK(wrong == 0, "%d queries without a matching earlier fact", wrong);
    CHECK(queries == expected && stray == 0, "%d queries for %d expected (%d documents off)", queries, expected, stray);
    CHECK(gap_min >= c.min_gap, "gap %d below min_gap %d", gap_min, c.min_gap);
    CHECK(overshoot == 0 && gap_max > c.max_gap / 2, "gaps up to %d (%d beyond max_gap + %d)", gap_max, overshoot,
          RECALL_MAX_OVERSHOOT);
    bytebuf_free(&doc);
}

static void test_filler(void) {
    Rng r = rng_make(1);
    ByteBuf s = {NULL, 0, 0};
    int bad = 0;
    for (int i = 0; i < 3000; i++) {
        s.len = 0;
        filler_sentence(&r, &s);
        bytebuf_append(&s, "", 1);
        const char *t = (const char *)s.data;
        bad += !isupper((unsigned char)t[0]) || t[s.len - 2] != '.';
        for (size_t k = 0; k + 1 < s.len; k++)
            bad += isdigit((unsigned char)t[k]) || t[k] < ' ' || (unsigned char)t[k] > '~';
        bad += strstr(t, "code") || strstr(t, "pin") || strstr(t, "number") || strstr(t, "Question") ||
               strstr(t, "Answer");
        bad += strstr(t, " a a") || strstr(t, " a e") || strstr(t, " a i") || strstr(t, " a o") ||
               strstr(t, " a u") != NULL;
        bad += strlen(t) > RECALL_MAX_OVERSHOOT / 2;
    }
    CHECK(bad == 0, "%d problems in filler sentences", bad);
    bytebuf_free(&s);
}

// Rows of T+1 tokens cut from one stream of documents (stride T, as the dataloader does); pred[t] = tokens[t+1],
// then `mode` edits the predicted answer digits: 0 true, 1 answers of another query, 2 always wrong.
typedef struct { long row, pos; } AnswerAt;

static GapScore score_stream(int mode) {
    const long T = 4096;
    RecallConfig c = small_config(21);
    Rng r = rng_make(c.seed), pick = rng_make(77);
    ByteBuf doc = {NULL, 0, 0};
    size_t cap = 0, n = 0;
    int32_t *stream = NULL;
    while (n < 300000) {
        recall_generate_document(&r, &c, &doc);
        if (n + doc.len + 2 > cap) {
            cap = 2 * (n + doc.len + 2);
            stream = (int32_t *)realloc(stream, cap * sizeof(int32_t));
        }
        n += tok_encode_document(doc.data, doc.len, stream + n);
    }
    long rows = ((long)n - 1) / T;
    int32_t *pred = (int32_t *)sdm_malloc((size_t)rows * T * sizeof(int32_t));
    for (long k = 0; k < rows; k++)
        for (long t = 0; t < T; t++) pred[k * T + t] = stream[k * T + t + 1];
    if (mode) {
        // digits of answers: those following RECALL_QUERY_MID; mode 1 copies another answer's digits in their place
        const char *mid = RECALL_QUERY_MID;
        const long mlen = (long)strlen(mid);
        long *ans = (long *)sdm_malloc(n * sizeof(long)), na = 0;
        for (long i = 0; i + mlen + RECALL_VALUE_DIGITS < (long)n; i++)
            if (recall_match(stream, (long)n, i, mid, (size_t)mlen)) ans[na++] = i + mlen;
        for (long a = 0; a < na; a++) {
            long other = ans[rng_below(&pick, (uint32_t)na)];
            for (int d = 0; d < RECALL_VALUE_DIGITS; d++) {
                long pos = ans[a] + d;  // stream position of the digit; predicted at pos - 1
                for (long k = (pos - 1) / T; k >= 0 && pos - k * T <= T; k--) {  // rows holding pos (overlap of one)
                    if (pos - k * T < 1 || k >= rows) continue;
                    int32_t truth = stream[pos];
                    pred[k * T + (pos - k * T) - 1] = mode == 1 ? stream[other + d] : (truth == '0' ? '1' : '0');
                }
            }
        }
        free(ans);
    }
    GapScore s;
    recall_score_init(&s);
    for (long k = 0; k < rows; k++) recall_score_row(&s, stream + k * T, pred + k * T, T);
    free(stream);
    free(pred);
    bytebuf_free(&doc);
    return s;
}

static void test_scorer(void) {
    uint64_t q, exact, digits, right;
    GapScore truth = score_stream(0);
    gap_score_totals(&truth, &q, &exact, &digits, &right);
    gap_score_print(&truth, "recall", stdout);
    int buckets = 0;
    for (int b = 0; b < RECALL_BUCKETS; b++) buckets += truth.queries[b] > 0;
    CHECK(q > 500 && exact == q && right == digits && digits == q * RECALL_VALUE_DIGITS,
          "true answers: %llu/%llu exact, %llu/%llu digits", (unsigned long long)exact, (unsigned long long)q,
          (unsigned long long)right, (unsigned long long)digits);
    CHECK(buckets >= 4 && truth.queries[0] == 0, "queries in %d gap buckets (none expected below min_gap 256)",
          buckets);
    CHECK(truth.unanswerable > 0, "rows cut the stream, so some facts must fall in an earlier row");
    GapScore shuffled = score_stream(1);
    uint64_t q2, exact2, digits2, right2;
    gap_score_totals(&shuffled, &q2, &exact2, &digits2, &right2);
    double acc = (double)right2 / (double)digits2;
    printf("shuffled answers: digit accuracy %.4f, exact %.4f\n", acc, (double)exact2 / (double)q2);
    CHECK(q2 == q && acc > 0.06 && acc < 0.16 && (double)exact2 / (double)q2 < 0.02,
          "shuffled answers: digit accuracy %.4f, exact %llu of %llu (chance: 0.1 and ~0)", acc,
          (unsigned long long)exact2, (unsigned long long)q2);
    GapScore wrong = score_stream(2);
    uint64_t q3, exact3, digits3, right3;
    gap_score_totals(&wrong, &q3, &exact3, &digits3, &right3);
    CHECK(q3 == q && right3 == 0 && exact3 == 0, "wrong answers scored %llu digits right", (unsigned long long)right3);
}

// A fact in the previous document does not answer a query (same key, same value): not scored.
static void test_scorer_document_boundary(void) {
    const char *a = "The pin of kavo is 11111. Filler.",
               *b = "Some filler. Question: what is the pin of kavo? Answer: 11111. End.";
    int32_t row[256];
    long n = (long)tok_encode_document((const uint8_t *)a, strlen(a), row);
    n += (long)tok_encode_document((const uint8_t *)b, strlen(b), row + n);
    GapScore s;
    recall_score_init(&s);
    recall_score_row(&s, row, row + 1, n - 1);
    uint64_t q, exact, digits, right;
    gap_score_totals(&s, &q, &exact, &digits, &right);
    CHECK(q == 0 && s.unanswerable == 1, "a fact of another document was used: %llu scored, %llu unanswerable",
          (unsigned long long)q, (unsigned long long)s.unanswerable);
    n = (long)tok_encode_document((const uint8_t *)a, strlen(a), row) - 1;  // the same text as one document
    n += (long)tok_encode_bytes((const uint8_t *)b, strlen(b), row + n);
    recall_score_init(&s);
    recall_score_row(&s, row, row + 1, n - 1);
    gap_score_totals(&s, &q, &exact, &digits, &right);
    CHECK(q == 1 && exact == 1 && s.queries[0] == 1, "one document: %llu scored", (unsigned long long)q);
}

static void test_default_dataset(void) {
    char dir[TEST_PATH_LEN], sub[TEST_PATH_LEN + 32], err[DATA_ERR_LEN] = "", pattern[TEST_PATH_LEN + 64],
         path[TEST_PATH_LEN + 64];
    test_tmpdir(dir);
    snprintf(sub, sizeof sub, "%s/gen/erated", dir);  // directories are created as needed
    CHECK(dataset_ensure_default(sub, err) == 0, "default dataset: %s", err);
    snprintf(pattern, sizeof pattern, "%s/%s", sub, DATASET_VAL_PATTERN);
    DataLoader val;
    const int B = 4, T = 4096;
    CHECK(dataloader_open(&val, pattern, B, T, 0, 1, 0, 0, TOK_BYTES_VOCAB, err) == 0, "open %s: %s", pattern, err);
    int32_t *batch = (int32_t *)sdm_malloc((size_t)B * (T + 1) * sizeof(int32_t));
    GapScore s;
    recall_score_init(&s);
    for (int k = 0; k < 8 && dataloader_next_batch(&val, batch, err) == 0; k++)
        for (int b = 0; b < B; b++)
            recall_score_row(&s, batch + (size_t)b * (T + 1), batch + (size_t)b * (T + 1) + 1, T);
    uint64_t q, exact, digits, right;
    gap_score_totals(&s, &q, &exact, &digits, &right);
    CHECK(q > 50 && exact == q, "validation batches: %llu of %llu true answers exact", (unsigned long long)exact,
          (unsigned long long)q);
    dataloader_close(&val);
    // A matching stamp means no regeneration (a deleted shard stays deleted); a different one regenerates.
    snprintf(path, sizeof path, "%s/recall_val_000000.bin", sub);
    remove(path);
    CHECK(dataset_ensure_default(sub, err) == 0 && fopen(path, "rb") == NULL, "regenerated although the stamp matched");
    snprintf(path, sizeof path, "%s/%s", sub, DATASET_STAMP);
    test_write_file(path, "old\n", 4);
    snprintf(path, sizeof path, "%s/recall_val_000000.bin", sub);
    FILE *f = NULL;
    CHECK(dataset_ensure_default(sub, err) == 0 && (f = fopen(path, "rb")) != NULL,
          "not regenerated after a stamp change: %s", err);
    if (f) fclose(f);
    RecallConfig bad = recall_default_config();
    bad.max_gap = 10;
    CHECK(recall_dataset_write(sub, &bad, err) != 0 && strstr(err, "min_gap"), "bad config accepted: %s", err);
    bad.min_gap = bad.max_gap = 1000000000;  // documents of a GB each: refused, nothing written
    CHECK(recall_dataset_write(sub, &bad, err) != 0 && strstr(err, "max_gap <= 1048576"), "gap 1e9 accepted: %s", err);
    bad.min_gap = 256;
    bad.max_gap = RECALL_MAX_GAP + 1;
    CHECK(recall_config_check(&bad, err) != 0, "max_gap %d accepted", bad.max_gap);
    free(batch);
    test_rmdir(dir);
}

// Several ranks on first use at once: each must return with a complete set it can load (under the directory's lock
// the first generates, the others wait and find its stamp), never see another rank's half-written set.
static void test_concurrent_first_use(void) {
    char dir[TEST_PATH_LEN], pattern[2 * TEST_PATH_LEN + 64];
    test_tmpdir(dir);
    snprintf(pattern, sizeof pattern, "%s/%s,%s/%s", dir, DATASET_TRAIN_PATTERN, dir, DATASET_VAL_PATTERN);
    pid_t pids[3];
    for (int k = 0; k < 3; k++)
        if ((pids[k] = fork()) == 0) {
            char err[DATA_ERR_LEN];
            DataLoader dl;
            int rc = dataset_ensure_default(dir, err) || dataloader_open(&dl, pattern, 4, 4096, 0, 1, 1, 1, 258, err);
            if (rc) printf("rank %d: %s\n", k, err);
            fflush(stdout);
            _exit(rc ? 3 : 0);
        }
    int failed = 0;
    for (int k = 0; k < 3; k++) {
        int status = 0;
        waitpid(pids[k], &status, 0);
        failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    CHECK(failed == 0, "%d of 3 concurrent first uses failed", failed);
    test_rmdir(dir);
}

int main(void) {
    test_determinism();
    test_generator_promises();
    test_filler();
    test_scorer();
    test_scorer_document_boundary();
    test_default_dataset();
    test_concurrent_first_use();
    return test_summary();
}
