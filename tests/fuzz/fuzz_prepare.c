// tests/fuzz/fuzz_prepare.c: prepare_data's input parsing (data/prepare.h, data/jsonl.h, data/tokenizer.h). The first
// byte picks (bits 0-1) the unit: 0 whole file, 1 paragraphs, 2 lines, 3 JSONL with member "text"; bit 2 --skip-bad;
// bit 3 a validation split (every 2nd document). The rest is the input file, run through preparer_add_file and
// preparer_close into shards, and each of its lines through jsonl_parse_line alone. Promises checked: a JSONL
// refusal names a column inside the line; a decoded string is what json_string promises (no raw bytes lost); a refused
// input names the file (and a line); a prepared set loads (its shard and manifest pass shard_open and the manifest
// check); a whole-file document of valid UTF-8 comes out as BOS, its bytes, EOS, across the shards.
#define PREP_BLOCK 4096u       // small input blocks and write buffers: lines cross block boundaries, buffers
#define SHARD_WRITE_BUF 1100   // flush, at the sizes the fuzzer makes (the production values are megabytes)
#define FUZZ_SHARD_TOKENS 1000 // and documents span several shards
#include "data/prepare.h"
#include "tests/fuzz/fuzz.h"

static void check_jsonl_lines(const uint8_t *text, size_t n) {
    static JsonlParser jp; // reused across inputs, as prepare_data reuses its parser across lines
    char err[DATA_ERR_LEN];
    for (size_t start = 0; start < n;) {
        const uint8_t *nl = (const uint8_t *)memchr(text + start, '\n', n - start);
        size_t end = nl ? (size_t)(nl - text) : n, len = end - start;
        uint8_t *line = (uint8_t *)malloc(len ? len : 1); // exactly the line: ASan sees reads past its end
        if (len) memcpy(line, text + start, len);
        err[0] = 0;
        if (jsonl_parse_line(&jp, line, len, "text", err) != 0) {
            size_t col = 0;
            int named = sscanf(err, "column %zu:", &col) == 1 && col >= 1 && col <= len + 1;
            FUZZ_ASSERT(named || !strcmp(err, "no \"text\" string field"), "unclear JSONL refusal: '%s'", err);
        } else {
            FUZZ_ASSERT(jp.text.len <= 4 * len, "decoded %zu bytes from a line of %zu", jp.text.len, len);
        }
        free(line);
        start = end + 1;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    PrepUnit unit = (PrepUnit)(data[0] & 3);
    const uint8_t *text = data + 1;
    size_t n = size - 1;
    check_jsonl_lines(text, n);

    const char *in = fuzz_path("input.txt"), *shards[8];
    char name[64];
    for (int i = 0; i < 8; i++) {
        snprintf(name, sizeof name, "train_%06d.bin", i);
        shards[i] = fuzz_path(name);
        remove(shards[i]);
        snprintf(name, sizeof name, "val_%06d.bin", i);
        fuzz_path(name); // removed at exit
    }
    fuzz_path("train.manifest"), fuzz_path("val.manifest");
    fuzz_write_file(in, text, n);
    char dir[512], err[DATA_ERR_LEN] = "";
    snprintf(dir, sizeof dir, "%.*s", (int)(strrchr(in, '/') - in), in);
    Preparer pp;
    if (preparer_open(&pp, dir, FUZZ_SHARD_TOKENS, err)) { fprintf(stderr, "fuzz: %s\n", err); abort(); }
    pp.skip_bad = (data[0] >> 2) & 1;
    pp.val_every = (data[0] >> 3) & 1 ? 2 : 0;
    pp.report = NULL;
    if (preparer_add_file(&pp, in, unit, err) != 0) {
        FUZZ_ASSERT(strstr(err, in), "refusal without the file: '%s'", err);
        preparer_abort(&pp);
        return 0;
    }
    uint64_t docs = pp.docs;
    if (preparer_close(&pp, err) != 0) {
        FUZZ_ASSERT(strstr(err, "no training documents"), "close failed: '%s'", err);
        return 0;
    }
    // every train shard opens and is listed; the tokens of all of them in order
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * 8 * FUZZ_SHARD_TOKENS);
    uint8_t scratch[4 * FUZZ_SHARD_TOKENS];
    uint64_t total = 0;
    for (int i = 0; i < 8; i++) {
        ShardHeader h;
        FILE *f = NULL;
        if (shard_open(shards[i], &h, &f, err) != 0) {
            FUZZ_ASSERT(i > 0, "a prepared shard does not open: %s", err);
            break;
        }
        FUZZ_ASSERT(shard_manifest_check(shards[i], &h, err) == 0, "a prepared shard is not in its manifest: %s", err);
        FUZZ_ASSERT(h.count <= FUZZ_SHARD_TOKENS, "shard %d holds %llu tokens", i, (unsigned long long)h.count);
        FUZZ_ASSERT(shard_read_tokens(f, &h, shards[i], 0, h.count, tok + total, scratch, err) == 0, "%s", err);
        total += h.count;
        fclose(f);
    }
    if (unit == PREP_TEXT_FILE && docs == 1) {
        FUZZ_ASSERT(total == n + 2 && utf8_valid_prefix(text, n) == n, "whole file of %zu bytes: %llu tokens", n,
                    (unsigned long long)total);
        FUZZ_ASSERT(tok[0] == TOK_BOS && tok[n + 1] == TOK_EOS, "document not framed by BOS and EOS");
        for (size_t i = 0; i < n; i++) FUZZ_ASSERT(tok[i + 1] == text[i], "byte %zu changed", i);
    }
    free(tok);
    return 0;
}
