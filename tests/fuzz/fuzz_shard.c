// tests/fuzz/fuzz_shard.c: data/shard.h's readers. The first byte picks:
//   even: a token shard. shard_validate_buffer on the bytes, and the same bytes as a file through shard_open and
//         shard_read_tokens (the dataloader's path) in pieces: both must give the same verdict, every accepted token
//         below the vocab, every refusal naming the shard and an offset.
//   odd:  a manifest (s.manifest) for a valid shard s_000000.bin of 5 tokens: shard_manifest_check. An accepted
//         manifest must hold a line whose first word is the shard's name with its token count and size.
#include "data/shard.h"
#include "tests/fuzz/fuzz.h"

static void fuzz_shard(const uint8_t *data, size_t n) {
    uint8_t *buf = (uint8_t *)malloc(n ? n : 1); // exactly n bytes: ASan sees any read past the end
    if (n) memcpy(buf, data, n);
    char err[DATA_ERR_LEN] = "", ferr[DATA_ERR_LEN] = "";
    ShardHeader h, fh;
    int ok = shard_validate_buffer(buf, n, "buf.bin", &h, err) == 0;
    if (ok) FUZZ_ASSERT(n == shard_expected_size(&h) && h.vocab >= 2, "accepted with a size its header does not say");
    else FUZZ_ASSERT(strstr(err, "buf.bin") && strstr(err, "offset"), "refusal without name and offset: '%s'", err);

    const char *path = fuzz_path("shard.bin");
    fuzz_write_file(path, buf, n);
    FILE *f = NULL;
    int fok = shard_open(path, &fh, &f, ferr) == 0;
    if (fok) {
        int32_t out[300];
        uint8_t scratch[300 * 4];
        for (uint64_t first = 0; fok && first < fh.count; first += 257) {
            size_t k = (size_t)SDM_MIN((uint64_t)257, fh.count - first);
            fok = shard_read_tokens(f, &fh, path, first, k, out, scratch, ferr) == 0;
            for (size_t i = 0; fok && i < k; i++)
                FUZZ_ASSERT(out[i] >= 0 && (uint32_t)out[i] < fh.vocab, "token %d handed out, vocab %u", out[i],
                            fh.vocab);
        }
        fclose(f);
    }
    FUZZ_ASSERT(ok == fok, "shard_validate_buffer says %d, the file reader %d ('%s' / '%s')", ok, fok, err, ferr);
    if (!fok) FUZZ_ASSERT(strstr(ferr, path) && strstr(ferr, "offset"), "refusal without path and offset: '%s'", ferr);
    free(buf);
}

// Whether text has a line (split at '\n') whose first word is name, followed by count and bytes.
static int manifest_lists(const char *text, size_t n, const char *name, unsigned long long count,
                          unsigned long long bytes) {
    char line[4096], word[1024];
    for (size_t at = 0; at < n;) {
        const char *nl = (const char *)memchr(text + at, '\n', n - at);
        size_t end = nl ? (size_t)(nl - text) : n, len = SDM_MIN(end - at, sizeof line - 1);
        memcpy(line, text + at, len);
        line[len] = 0;
        unsigned long long c, b;
        if (sscanf(line, "%1023s %llu %llu", word, &c, &b) == 3 && !strcmp(word, name) && c == count && b == bytes)
            return 1;
        at = end + 1;
    }
    return 0;
}

static void fuzz_manifest(const uint8_t *data, size_t n) {
    static int made = 0;
    const char *shard = fuzz_path("s_000000.bin"), *manifest = fuzz_path("s.manifest");
    ShardHeader h = {2, 258, SHARD_TOKENIZER_BYTES, 5};
    if (!made) {
        uint8_t file[SHARD_HEADER_BYTES + 10] = {0};
        shard_header_write(file, &h);
        fuzz_write_file(shard, file, sizeof file);
        made = 1;
    }
    fuzz_write_file(manifest, data, n);
    char err[DATA_ERR_LEN] = "";
    if (shard_manifest_check(shard, &h, err) == 0)
        FUZZ_ASSERT(manifest_lists((const char *)data, n, "s_000000.bin", 5, shard_expected_size(&h)),
                    "a manifest without the line 's_000000.bin 5 %llu' was accepted",
                    (unsigned long long)shard_expected_size(&h));
    else
        FUZZ_ASSERT(strstr(err, "s.manifest") || strstr(err, shard), "refusal without the manifest: '%s'", err);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (data[0] & 1) fuzz_manifest(data + 1, size - 1);
    else fuzz_shard(data + 1, size - 1);
    return 0;
}
