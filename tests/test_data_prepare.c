// The prepare pipeline end to end: text and JSONL files -> shards -> tokens -> documents, compared with the
// documents the test expects (text units file/para/line, JSON escapes, train/validation split, tiny shards so
// documents straddle shard boundaries), and the reports of bad input: file:line for invalid UTF-8 and malformed
// JSONL (refused, or skipped with --skip-bad), empty and unreadable files, no documents at all; manifests: a failed
// or killed run over an older set leaves nothing the loader takes, and the loader takes only listed shards.
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "data/dataloader.h"
#include "data/prepare.h"
#include "tests/test.h"
#include "tests/test_data_util.h"

static char g_dir[TEST_PATH_LEN];

static void input_path(char *out, const char *name) { snprintf(out, TEST_PATH_LEN + 64, "%s/%s", g_dir, name); }

static void write_input(const char *name, const char *text, size_t n) {
    char path[TEST_PATH_LEN + 64];
    input_path(path, name);
    test_write_file(path, text, n);
}

// All tokens of prefix_000000.bin, prefix_000001.bin, ... in order; *n their count; *shards how many files.
static int32_t *read_all_shards(const char *prefix, size_t *n, int *shards) {
    int32_t *all = NULL;
    *n = 0;
    for (*shards = 0;; (*shards)++) {
        char path[SHARD_PATH_LEN + 160], err[DATA_ERR_LEN];
        ShardHeader h;
        FILE *f;
        shard_path(path, sizeof path, g_dir, prefix, *shards);
        if (shard_open(path, &h, &f, err)) break;
        all = (int32_t *)realloc(all, (*n + h.count) * sizeof(int32_t));
        uint8_t *scratch = (uint8_t *)sdm_malloc(h.count * 2);
        CHECK(shard_read_tokens(f, &h, path, 0, h.count, all + *n, scratch, err) == 0, "%s", err);
        *n += h.count;
        free(scratch);
        fclose(f);
    }
    return all;
}

// Compare the documents in the prefix's shards with expected[count] (each framed BOS ... EOS, in order).
static void check_documents(const char *prefix, const char *const *expected, const size_t *lens, int count) {
    size_t n;
    int shards, doc = 0;
    int32_t *tok = read_all_shards(prefix, &n, &shards);
    size_t i = 0;
    while (i < n && doc < count) {
        CHECK(tok[i] == TOK_BOS, "%s: document %d does not start with BOS", prefix, doc);
        size_t end = i + 1;
        while (end < n && tok[end] != TOK_EOS) end++;
        uint8_t *text = (uint8_t *)sdm_malloc(end - i);
        size_t len = tok_decode(tok + i + 1, end - i - 1, text);
        CHECK(len == end - i - 1, "%s: document %d holds special tokens", prefix, doc);
        CHECK(len == lens[doc] && memcmp(text, expected[doc], len) == 0,
              "%s: document %d differs (%zu vs %zu bytes): %.*s", prefix, doc, len, lens[doc],
              (int)SDM_MIN(len, (size_t)60), (const char *)text);
        free(text);
        i = end + 1;
        doc++;
    }
    CHECK(doc == count && i == n, "%s: %d documents (%zu of %zu tokens), expected %d", prefix, doc, i, n, count);
    free(tok);
}

static Preparer open_preparer(int val_every, int skip_bad, FILE *report) {
    Preparer pp;
    char err[DATA_ERR_LEN];
    if (preparer_open(&pp, g_dir, 7, err)) sdm_die("%s", err);  // 7 tokens per shard: documents straddle shards
    pp.val_every = val_every;
    pp.skip_bad = skip_bad;
    pp.report = report;
    return pp;
}

static int add(Preparer *pp, const char *name, PrepUnit unit, char *err) {
    char path[TEST_PATH_LEN + 64];
    input_path(path, name);
    return preparer_add_file(pp, path, unit, err);
}

static void test_round_trip(void) {
    const char file_text[] = "First line caf\xC3\xA9\r\n\nSecond paragraph \xF0\x9F\x98\x80\nno final newline";
    const char jsonl[] =
        "{\"text\": \"json one\\n\\\"quoted\\\" \\u00e9\"}\n\n   \n{\"id\": 2, \"text\": \"json two\"}\n"
        "{\"text\": \"json three\", \"x\": [1, {\"text\": \"nested\"}]}";
    const char para[] = "\n\npara one\nstill one\n\n\n\npara two\r\n\r\npara three\n";
    write_input("a.txt", file_text, strlen(file_text));
    write_input("b.jsonl", jsonl, strlen(jsonl));
    write_input("c.txt", para, strlen(para));
    Preparer pp = open_preparer(3, 0, NULL);
    char err[DATA_ERR_LEN] = "";
    int rc = add(&pp, "a.txt", PREP_TEXT_FILE, err) || add(&pp, "b.jsonl", PREP_JSONL, err) ||
             add(&pp, "c.txt", PREP_TEXT_PARA, err) || add(&pp, "c.txt", PREP_TEXT_LINE, err);
    CHECK(rc == 0, "prepare failed: %s", err);
    uint64_t docs = pp.docs, val = pp.val_docs;
    CHECK(preparer_close(&pp, err) == 0, "close: %s", err);
    // documents in input order; every third goes to validation
    const char *all[] = {file_text, "json one\n\"quoted\" \xC3\xA9", "json two", "json three", "para one\nstill one",
                         "para two\r", "para three", "para one", "still one", "para two\r", "para three"};
    const int count = (int)(sizeof all / sizeof all[0]);
    CHECK(docs == (uint64_t)count && val == (uint64_t)count / 3, "%llu documents, %llu validation",
          (unsigned long long)docs, (unsigned long long)val);
    const char *train[16], *vals[16];
    size_t train_len[16], val_len[16];
    int nt = 0, nv = 0;
    for (int i = 0; i < count; i++) {
        if ((i + 1) % 3 == 0) { vals[nv] = all[i]; val_len[nv++] = strlen(all[i]); }
        else { train[nt] = all[i]; train_len[nt++] = strlen(all[i]); }
    }
    check_documents("train", train, train_len, nt);
    check_documents("val", vals, val_len, nv);
}

// Run one bad input through a fresh preparer; returns the error (fail mode) or the report (skip mode).
static int run_bad(const char *name, PrepUnit unit, int skip_bad, char *msg, uint64_t *docs, uint64_t *skipped) {
    FILE *report = tmpfile();
    Preparer pp = open_preparer(0, skip_bad, report);
    char err[DATA_ERR_LEN] = "";
    int rc = add(&pp, name, unit, err);
    *docs = pp.docs;
    *skipped = pp.skipped;
    if (rc == 0) rc = preparer_close(&pp, err);
    else preparer_abort(&pp);
    size_t got = 0;
    if (skip_bad && rc == 0) {
        rewind(report);
        got = fread(msg, 1, DATA_ERR_LEN - 1, report);
        msg[got] = 0;
    } else {
        snprintf(msg, DATA_ERR_LEN, "%s", err);
    }
    fclose(report);
    return rc;
}

static void expect_report(const char *name, PrepUnit unit, const char *where, const char *what,
                          uint64_t docs_when_skipping) {
    char msg[DATA_ERR_LEN];
    uint64_t docs, skipped;
    int rc = run_bad(name, unit, 0, msg, &docs, &skipped);
    CHECK(rc != 0 && strstr(msg, where) && strstr(msg, what), "%s refused: rc %d, message \"%s\" (want %s, %s)", name,
          rc, msg, where, what);
    rc = run_bad(name, unit, 1, msg, &docs, &skipped);
    CHECK(rc == 0 && skipped == 1 && docs == docs_when_skipping && strstr(msg, where) && strstr(msg, "skipped"),
          "%s skipped: rc %d, %llu docs, %llu skipped, report \"%s\"", name, rc, (unsigned long long)docs,
          (unsigned long long)skipped, msg);
}

static void test_bad_input(void) {
    char where[TEST_PATH_LEN + 80], path[TEST_PATH_LEN + 64];
    const char bad_text[] = "good one\n\nstill good\nbad \xFF byte\nsame paragraph\n\nlast good\n";
    write_input("bad.txt", bad_text, strlen(bad_text));
    input_path(path, "bad.txt");
    snprintf(where, sizeof where, "%s:4", path);
    expect_report("bad.txt", PREP_TEXT_PARA, where, "invalid UTF-8 at byte column 5", 2);
    const char bad_json[] = "{\"text\": \"ok\"}\n{\"text\": \"unterminated}\n{\"text\": \"ok too\"}\n";
    write_input("bad.jsonl", bad_json, strlen(bad_json));
    input_path(path, "bad.jsonl");
    snprintf(where, sizeof where, "%s:2", path);
    expect_report("bad.jsonl", PREP_JSONL, where, "malformed JSONL line: column", 2);
    const char bad_utf8_json[] = "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": \"raw \xC0\xAF overlong\"}\n";
    write_input("bad8.jsonl", bad_utf8_json, strlen(bad_utf8_json));
    input_path(path, "bad8.jsonl");
    snprintf(where, sizeof where, "%s:3", path);
    expect_report("bad8.jsonl", PREP_JSONL, where, "invalid UTF-8", 2);

    char msg[DATA_ERR_LEN];
    uint64_t docs, skipped;
    write_input("empty.txt", "", 0);
    input_path(path, "empty.txt");
    CHECK(run_bad("empty.txt", PREP_TEXT_FILE, 0, msg, &docs, &skipped) != 0 && strstr(msg, path) &&
          strstr(msg, "empty"),
          "empty input: %s", msg);
    CHECK(run_bad("empty.txt", PREP_TEXT_FILE, 1, msg, &docs, &skipped) != 0 && strstr(msg, "no training documents"),
          "nothing left after skipping: %s", msg);
    input_path(path, "missing.txt");
    CHECK(run_bad("missing.txt", PREP_TEXT_FILE, 1, msg, &docs, &skipped) != 0 && strstr(msg, path) &&
          strstr(msg, "cannot open"),
          "unreadable input: %s", msg);
    write_input("blank.jsonl", "\n  \n", 4);
    CHECK(run_bad("blank.jsonl", PREP_JSONL, 0, msg, &docs, &skipped) != 0 && strstr(msg, "no training documents"),
          "no documents: %s", msg);
}

// A long line crossing many read blocks is one document, intact.
static void test_long_line(void) {
    const size_t n = PREP_BLOCK + PREP_BLOCK / 2 + 3;
    char *text = (char *)sdm_malloc(n + 1);
    for (size_t i = 0; i < n; i++) text[i] = (char)('a' + i % 26);
    text[n] = 0;
    write_input("long.txt", text, n);
    Preparer pp;
    char err[DATA_ERR_LEN] = "";
    CHECK(preparer_open(&pp, g_dir, 1u << 30, err) == 0, "%s", err);
    pp.report = NULL;
    CHECK(add(&pp, "long.txt", PREP_TEXT_LINE, err) == 0 && preparer_close(&pp, err) == 0, "%s", err);
    const char *docs[1] = {text};
    size_t lens[1] = {n};
    check_documents("train", docs, lens, 1);
    free(text);
}

// Prepare `input` (lines) into sub, in shards of 100 tokens; returns the preparer's result. kill: SIGKILL itself
// after the input, before the shards are closed (a forked child).
static int prepare_into(const char *sub, const char *input, int kill_before_close, char *err) {
    char dir[TEST_PATH_LEN + 64];
    Preparer pp;
    input_path(dir, sub);
    mkdir(dir, 0755);
    if (preparer_open(&pp, dir, 100, err)) return -1;
    pp.report = NULL;
    if (add(&pp, input, PREP_TEXT_LINE, err)) { preparer_abort(&pp); return -1; }
    if (kill_before_close) raise(SIGKILL);
    return preparer_close(&pp, err);
}

// The loader on sub/train_*.bin: 0 when it takes the shards.
static int load_train(const char *sub, char *err) {
    char pattern[TEST_PATH_LEN + 96];
    DataLoader dl;
    snprintf(pattern, sizeof pattern, "%s/%s/train_*.bin", g_dir, sub);
    if (dataloader_open(&dl, pattern, 1, 8, 0, 1, 1, 1, TOK_BYTES_VOCAB, err)) return -1;
    dataloader_close(&dl);
    return 0;
}

static int count_files_containing(const char *sub, const char *needle) {
    char dir[TEST_PATH_LEN + 64];
    input_path(dir, sub);
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) n += strstr(e->d_name, needle) != NULL;
    if (d) closedir(d);
    return n;
}

static void copy_file(const char *from, const char *to) {
    size_t n;
    uint8_t *buf = test_read_file(from, &n);
    test_write_file(to, buf, n);
    free(buf);
}

// Issue 9: corpus A (15 shards), then corpus B failing after its first shard, into the same folder: the old code
// left B's shard 0 beside A's shards 1-10 and the loader took the mix. Likewise after a kill -9.
static void test_manifest(void) {
    char a[2200] = "", b[400] = "", err[DATA_ERR_LEN] = "", path[TEST_PATH_LEN + 64], other[TEST_PATH_LEN + 64];
    for (int i = 0; i < 99; i++) strcat(a, "corpus A line\n");  // 99 documents of 15 tokens: 15 shards, the last 85
    for (int i = 0; i < 20; i++) strcat(b, "corpus B line\n");
    strcat(b, "bad \xFF byte\n");
    write_input("a.txt", a, strlen(a));
    write_input("b.txt", b, strlen(b));
    CHECK(prepare_into("mix", "a.txt", 0, err) == 0 && load_train("mix", err) == 0, "corpus A: %s", err);
    CHECK(count_files_containing("mix", "train_0000") == 15, "corpus A: %d shards",
          count_files_containing("mix", "train_0000"));
    CHECK(prepare_into("mix", "b.txt", 0, err) != 0, "corpus B's bad line accepted");
    CHECK(load_train("mix", err) != 0 && strstr(err, "no complete shard set") && strstr(err, "train.manifest"),
          "a failed run left a loadable mix: %s", err);
    CHECK(count_files_containing("mix", ".tmp") == 0, "the failed run left a temporary file");
    // the manifest lists every shard with its size: an unlisted or a replaced shard is refused
    CHECK(prepare_into("mix", "a.txt", 0, err) == 0 && load_train("mix", err) == 0, "corpus A again: %s", err);
    snprintf(path, sizeof path, "%s/mix/train_000001.bin", g_dir);
    snprintf(other, sizeof other, "%s/mix/train_000099.bin", g_dir);
    copy_file(path, other);
    CHECK(load_train("mix", err) != 0 && strstr(err, "train_000099.bin: not listed"), "unlisted shard: %s", err);
    remove(other);
    snprintf(other, sizeof other, "%s/mix/train_000014.bin", g_dir);  // the last, shorter shard
    copy_file(other, path);
    CHECK(load_train("mix", err) != 0 && strstr(err, "train_000001.bin: ") && strstr(err, "lists 100 tokens"),
          "replaced shard: %s", err);
    // kill -9 after some shards were renamed into place: no manifest, nothing loadable
    pid_t pid = fork();
    if (pid == 0) _exit(prepare_into("killed", "a.txt", 1, err) == 0 ? 0 : 3);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && count_files_containing("killed", "train_0000") > 0,
          "the child was not killed mid-run");
    CHECK(load_train("killed", err) != 0 && strstr(err, "no complete shard set"), "killed run loadable: %s", err);
}

// Found by tests/fuzz/fuzz_shard.c's promise that an accepted manifest lists the shard on a line of its own: a line
// longer than the reader's buffer was read in two pieces, so "AAA...As_000000.bin 5 1034" (another name) listed
// s_000000.bin. Such a line is refused now, naming the manifest and the line.
static void test_manifest_long_line(void) {
    char dir[TEST_PATH_LEN + 64], shard[TEST_PATH_LEN + 96], manifest[TEST_PATH_LEN + 96], err[DATA_ERR_LEN] = "";
    snprintf(dir, sizeof dir, "%s/longline", g_dir);
    mkdir(dir, 0755);
    snprintf(shard, sizeof shard, "%s/s_000000.bin", dir);
    snprintf(manifest, sizeof manifest, "%s/s.manifest", dir);
    ShardHeader h = {2, TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES, 5};
    uint8_t file[SHARD_HEADER_BYTES + 10] = {0};
    shard_header_write(file, &h);
    test_write_file(shard, file, sizeof file);
    char text[4096] = SHARD_MANIFEST_HEADER;
    for (int len = 1080; len <= 1095; len++) {  // the split falls before, inside and after the name
        size_t at = strlen(SHARD_MANIFEST_HEADER);
        memset(text + at, 'A', (size_t)len);
        snprintf(text + at + len, sizeof text - at - (size_t)len, "s_000000.bin 5 1034\n");
        test_write_file(manifest, text, strlen(text));
        CHECK(shard_manifest_check(shard, &h, err) != 0 && strstr(err, "s.manifest: line 2 is longer"),
              "a %d-character line listing another name: %s", len, err);
    }
    snprintf(text, sizeof text, "%ss_000000.bin 5 1034\n", SHARD_MANIFEST_HEADER);
    test_write_file(manifest, text, strlen(text));
    CHECK(shard_manifest_check(shard, &h, err) == 0, "the honest manifest: %s", err);
}

int main(void) {
    test_tmpdir(g_dir);
    test_manifest_long_line();
    test_round_trip();
    test_bad_input();
    test_long_line();
    test_manifest();
    test_rmdir(g_dir);
    return test_summary();
}
