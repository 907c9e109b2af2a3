// Token shards: writer/reader round trips (uint16 and uint32), every refusal of bad input with a message naming
// the file and offset, and fuzzing: 10,000 random corruptions of a real shard in memory plus 1,000 through one
// rewritten temp file and the dataloader. Each must load correctly or be refused, never crash (ASan/UBSan).
#define _POSIX_C_SOURCE 200809L
#include "core/rng.h"
#include "data/dataloader.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "tests/test.h"
#include "tests/test_data_util.h"

static char g_dir[TEST_PATH_LEN];

// Write tokens [n] (values < vocab) as shards of at most limit tokens under prefix; returns the shard count.
static int write_stream(const char *prefix, const int32_t *tokens, size_t n, uint32_t vocab, uint32_t tokenizer,
                        uint64_t limit) {
    ShardWriter w;
    char err[DATA_ERR_LEN];
    int ok = shard_writer_open(&w, g_dir, prefix, vocab, tokenizer, limit, err) == 0 &&
             shard_writer_append(&w, tokens, n, err) == 0;
    ok &= shard_writer_close(&w, err) == 0;
    CHECK(ok, "writing %s: %s", prefix, err);
    return w.num_shards;
}

// Read every shard prefix_000000.bin, ... back into one stream; returns its length.
static size_t read_stream(const char *prefix, int shards, int32_t *out, size_t cap) {
    size_t total = 0;
    for (int s = 0; s < shards; s++) {
        char path[SHARD_PATH_LEN + 160], err[DATA_ERR_LEN];
        ShardHeader h;
        FILE *f;
        shard_path(path, sizeof path, g_dir, prefix, s);
        if (shard_open(path, &h, &f, err)) { CHECK(0, "%s", err); return 0; }
        uint8_t *scratch = (uint8_t *)sdm_malloc(h.count * 4);
        CHECK(total + h.count <= cap, "stream longer than written");
        if (total + h.count <= cap)
            CHECK(shard_read_tokens(f, &h, path, 0, h.count, out + total, scratch, err) == 0, "%s", err);
        total += h.count;
        free(scratch);
        fclose(f);
    }
    return total;
}

static void test_round_trip(uint32_t vocab, uint32_t tokenizer) {
    const size_t n = 2500;
    int32_t *tokens = (int32_t *)sdm_malloc(n * sizeof(int32_t)), *back = (int32_t *)sdm_malloc(n * sizeof(int32_t));
    Rng r = rng_make(vocab);
    for (size_t i = 0; i < n; i++) tokens[i] = (int32_t)rng_below(&r, vocab);
    int shards = write_stream("rt", tokens, n, vocab, tokenizer, 1000);
    CHECK(shards == 3, "vocab %u: %d shards for 2500 tokens at 1000 per shard", vocab, shards);
    size_t got = read_stream("rt", shards, back, n);
    CHECK(got == n && memcmp(tokens, back, n * sizeof(int32_t)) == 0, "vocab %u: round trip differs (%zu tokens)",
          vocab, got);
    // A shorter second run replaces the files and removes the now stale third shard.
    CHECK(write_stream("rt", tokens, 1500, vocab, tokenizer, 1000) == 2, "rewrite");
    char stale[SHARD_PATH_LEN + 160];
    shard_path(stale, sizeof stale, g_dir, "rt", 2);
    FILE *f = fopen(stale, "rb");
    CHECK(f == NULL, "stale shard %s left behind", stale);
    if (f) fclose(f);
    size_t len;
    shard_path(stale, sizeof stale, g_dir, "rt", 0);
    uint8_t *buf = test_read_file(stale, &len);
    CHECK(len == SHARD_HEADER_BYTES + 1000 * (size_t)shard_bytes_per_token_for(vocab), "vocab %u: shard size %zu",
          vocab, len);
    free(buf);
    free(tokens);
    free(back);
}

static void test_writer_refuses_out_of_vocab(void) {
    ShardWriter w;
    char err[DATA_ERR_LEN] = "";
    int32_t bad[2] = {5, TOK_BYTES_VOCAB};
    CHECK(shard_writer_open(&w, g_dir, "oov", TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES, 100, err) == 0, "%s", err);
    CHECK(shard_writer_append(&w, bad, 2, err) != 0 && strstr(err, "258"), "token 258 written: %s", err);
    shard_writer_abort(&w);
}

// A valid bytes-tokenizer shard file of n tokens; returns its path in path.
static void make_shard_file(const char *name, size_t n, char *path, size_t cap) {
    int32_t *t = (int32_t *)sdm_malloc(n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) t[i] = (int32_t)(i % 256);
    write_stream(name, t, n, TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES, n);
    shard_path(path, cap, g_dir, name, 0);
    free(t);
}

// Expect the loader to refuse path, with a message naming the file (and an offset when offset_expected).
static void expect_refused(const char *what, const char *path, int offset_expected, int T) {
    DataLoader dl;
    char err[DATA_ERR_LEN] = "";
    int32_t *batch = (int32_t *)sdm_malloc(2 * (size_t)(T + 1) * sizeof(int32_t));
    int rc = dataloader_open(&dl, path, 2, T, 0, 1, 7, 1, TOK_BYTES_VOCAB, err);
    for (int i = 0; rc == 0 && i < 4; i++) rc = dataloader_next_batch(&dl, batch, err);
    if (dl.shards) dataloader_close(&dl);
    CHECK(rc != 0, "%s: accepted", what);
    CHECK(strstr(err, path) != NULL, "%s: message does not name the file: %s", what, err);
    CHECK(!offset_expected || strstr(err, "offset") != NULL, "%s: message gives no offset: %s", what, err);
    free(batch);
}

static void test_bad_inputs(void) {
    char path[SHARD_PATH_LEN + 160];
    size_t len;
    make_shard_file("bad", 300, path, sizeof path);
    uint8_t *good = test_read_file(path, &len), *buf = (uint8_t *)sdm_malloc(len + 8);
    struct { const char *what; int field; uint32_t value; } header_cases[] = {
        {"wrong magic", SH_MAGIC, 20240520u}, {"wrong version", SH_VERSION, 2},
        {"bytes per token 4 for vocab 258", SH_BYTES_PER_TOKEN, 4},
        {"vocab 300 for the bytes tokenizer", SH_VOCAB, 300}, {"unknown tokenizer", SH_TOKENIZER, 9},
        {"zero tokens", SH_COUNT_LO, 0}, {"more tokens than the file holds", SH_COUNT_LO, 301},
        {"count high word", SH_COUNT_HI, 1}, {"reserved field set", 100, 1},
    };
    for (size_t c = 0; c < sizeof header_cases / sizeof header_cases[0]; c++) {
        memcpy(buf, good, len);
        data_write_u32le(buf + 4 * header_cases[c].field, header_cases[c].value);
        test_write_file(path, buf, len);
        expect_refused(header_cases[c].what, path, 1, 8);
    }
    test_write_file(path, good, len - 3);
    expect_refused("truncated shard", path, 1, 8);
    test_write_file(path, good, 100);
    expect_refused("truncated header", path, 1, 8);
    memcpy(buf, good, len);
    memset(buf + len, 0, 8);
    test_write_file(path, buf, len + 8);
    expect_refused("bytes after the last token", path, 1, 8);
    memcpy(buf, good, len);
    buf[SHARD_HEADER_BYTES + 1] = 0xFF;  // token 0 becomes 0xFF00
    test_write_file(path, buf, len);
    expect_refused("token >= vocab", path, 1, 149);  // 2 rows of 150 tokens: the first batch reads token 0
    test_write_file(path, good, 0);
    expect_refused("empty file", path, 1, 8);
    test_write_file(path, good, len);
    expect_refused("fewer tokens than world*B*(T+1)", path, 0, 200);  // 300 tokens: 1 row of 201, B = 2
    char missing[SHARD_PATH_LEN + 32];
    snprintf(missing, sizeof missing, "%s/no_such_shard.bin", g_dir);
    expect_refused("missing file", missing, 0, 8);
    expect_refused("a directory is not a shard", g_dir, 0, 8);
    free(good);
    free(buf);
}

// One random corruption of buf [*len] (capacity cap): header words, bits, truncation or extension.
static void corrupt(Rng *r, uint8_t *buf, size_t *len, size_t cap) {
    static const uint32_t interesting[] = {0, 1, 2, 3, 4, 255, 256, 257, 258, 259, 65535, 65536, 65537,
                                           0x7FFFFFFFu, 0x80000000u, 0xFFFFFFFFu, SHARD_MAGIC, SHARD_VERSION};
    switch (rng_below(r, 6)) {
    case 0: {  // a header word set to an interesting value
        size_t word = rng_below(r, 10);
        if (4 * word + 4 <= *len) data_write_u32le(buf + 4 * word, interesting[rng_below(r, sizeof interesting / 4)]);
        break;
    }
    case 1:  // a random bit anywhere
        if (*len) buf[rng_below(r, (uint32_t)*len)] ^= (uint8_t)(1u << rng_below(r, 8));
        break;
    case 2:  // a random bit in the first header words
        if (*len >= 32) buf[rng_below(r, 32)] ^= (uint8_t)(1u << rng_below(r, 8));
        break;
    case 3:  // truncate
        *len = rng_below(r, (uint32_t)*len + 1);
        break;
    case 4: {  // extend with random bytes
        size_t extra = rng_below(r, (uint32_t)(cap - *len) + 1);
        for (size_t i = 0; i < extra; i++) buf[*len + i] = (uint8_t)rng_u64(r);
        *len += extra;
        break;
    }
    default:  // a random token byte
        if (*len > SHARD_HEADER_BYTES)
            buf[SHARD_HEADER_BYTES + rng_below(r, (uint32_t)(*len - SHARD_HEADER_BYTES))] = (uint8_t)rng_u64(r);
    }
}

// An accepted buffer must really be valid: checked here independently of the parser.
static int really_valid(const uint8_t *buf, size_t len, const ShardHeader *h) {
    if (len < SHARD_HEADER_BYTES || data_read_u32le(buf) != SHARD_MAGIC || data_read_u32le(buf + 4) != SHARD_VERSION)
        return 0;
    if (len != SHARD_HEADER_BYTES + h->count * (uint64_t)h->bytes_per_token) return 0;
    for (uint64_t i = 0; i < h->count; i++) {
        const uint8_t *p = buf + SHARD_HEADER_BYTES + i * (uint64_t)h->bytes_per_token;
        uint32_t t = h->bytes_per_token == 2 ? (uint32_t)p[0] | ((uint32_t)p[1] << 8) : data_read_u32le(p);
        if (t >= h->vocab) return 0;
    }
    return 1;
}

static void test_fuzz_memory(void) {
    char path[SHARD_PATH_LEN + 160];
    size_t good_len;
    make_shard_file("fuzz", 240, path, sizeof path);
    uint8_t *good = test_read_file(path, &good_len);
    const size_t cap = good_len + 64;
    uint8_t *work = (uint8_t *)sdm_malloc(cap);
    Rng r = rng_make(99);
    int accepted = 0, refused = 0, bad_accept = 0, silent_refusal = 0;
    for (int it = 0; it < 10000; it++) {
        size_t len = good_len;
        memcpy(work, good, good_len);
        int rounds = 1 + (int)rng_below(&r, 4);
        for (int k = 0; k < rounds; k++) corrupt(&r, work, &len, cap);
        uint8_t *exact = (uint8_t *)sdm_malloc(len);  // exactly len bytes: ASan sees any overread
        memcpy(exact, work, len);
        char err[DATA_ERR_LEN] = "";
        ShardHeader h;
        if (shard_validate_buffer(exact, len, "fuzz.bin", &h, err) == 0) {
            accepted++;
            bad_accept += !really_valid(exact, len, &h);
        } else {
            refused++;
            silent_refusal += strstr(err, "fuzz.bin") == NULL;
        }
        free(exact);
    }
    printf("fuzz (memory): %d accepted, %d refused\n", accepted, refused);
    CHECK(accepted > 100 && refused > 5000, "fuzzing explored too little: %d accepted, %d refused", accepted, refused);
    CHECK(bad_accept == 0, "%d invalid buffers accepted", bad_accept);
    CHECK(silent_refusal == 0, "%d refusals without the file name", silent_refusal);
    free(good);
    free(work);
}

// Corrupted files through the dataloader (open, then batches): one temp file rewritten each time.
static void test_fuzz_files(void) {
    char path[SHARD_PATH_LEN + 160];
    size_t good_len;
    make_shard_file("ffuzz", 200, path, sizeof path);
    uint8_t *good = test_read_file(path, &good_len);
    const size_t cap = good_len + 64;
    uint8_t *work = (uint8_t *)sdm_malloc(cap);
    int32_t batch[2 * 17];
    Rng r = rng_make(5);
    int accepted = 0, refused = 0, out_of_vocab = 0, unnamed = 0;
    for (int it = 0; it < 1000; it++) {
        size_t len = good_len;
        memcpy(work, good, good_len);
        corrupt(&r, work, &len, cap);
        test_write_file(path, work, len);
        DataLoader dl;
        char err[DATA_ERR_LEN] = "";
        int rc = dataloader_open(&dl, path, 2, 16, 0, 1, (uint64_t)it, 1, TOK_BYTES_VOCAB, err);
        for (int b = 0; rc == 0 && b < 12; b++) {
            rc = dataloader_next_batch(&dl, batch, err);
            for (int i = 0; rc == 0 && i < 2 * 17; i++) out_of_vocab += batch[i] < 0 || batch[i] >= TOK_BYTES_VOCAB;
        }
        if (dl.shards) dataloader_close(&dl);
        if (rc == 0) accepted++;
        else { refused++; unnamed += strstr(err, path) == NULL; }
    }
    printf("fuzz (files + loader): %d accepted, %d refused\n", accepted, refused);
    CHECK(accepted > 50 && refused > 300, "file fuzzing explored too little: %d accepted, %d refused", accepted,
          refused);
    CHECK(out_of_vocab == 0, "%d out-of-vocab tokens delivered", out_of_vocab);
    CHECK(unnamed == 0, "%d refusals without the file name", unnamed);
    free(good);
    free(work);
}

int main(void) {
    test_tmpdir(g_dir);
    test_round_trip(TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES);
    test_round_trip(128256, SHARD_TOKENIZER_EXTERNAL);
    test_round_trip(65536, SHARD_TOKENIZER_EXTERNAL);
    test_writer_refuses_out_of_vocab();
    test_bad_inputs();
    test_fuzz_memory();
    test_fuzz_files();
    test_rmdir(g_dir);
    return test_summary();
}
