// data/shard.h: the token shard format (header parse/validate, reader helpers, a writer that splits a token
// stream into size-limited shards). The format is documented in data/README.md.
//
// Library functions never exit: they return 0 on success and -1 on failure with a message naming the file
// and the byte offset in err (DATA_ERR_LEN bytes), so tests can exercise every refusal. Tools exit on -1.
#ifndef SDM_DATA_SHARD_H
#define SDM_DATA_SHARD_H

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/common.h"
#include "core/file.h"

#define DATA_ERR_LEN 512
#define SHARD_MAGIC 0x544D4453u         // "SDMT" read as a little-endian uint32
#define SHARD_VERSION 1
#define SHARD_HEADER_INTS 256
#define SHARD_HEADER_BYTES (SHARD_HEADER_INTS * 4)
#define SHARD_TOKENIZER_EXTERNAL 0      // tokens from a tokenizer this project does not know
#define SHARD_TOKENIZER_BYTES 1         // data/tokenizer.h: V = 258, BOS 256, EOS 257
#define SHARD_BYTES_VOCAB 258

enum { SH_MAGIC = 0, SH_VERSION, SH_BYTES_PER_TOKEN, SH_VOCAB, SH_TOKENIZER, SH_COUNT_LO, SH_COUNT_HI, SH_RESERVED };

typedef struct {
    int bytes_per_token;   // 2 (uint16 tokens) when vocab <= 65536, else 4 (uint32)
    uint32_t vocab;
    uint32_t tokenizer;    // SHARD_TOKENIZER_*
    uint64_t count;        // tokens after the header
} ShardHeader;

// Write a formatted message into err (when given) and return -1: the one way every data function fails.
static inline int data_fail(char *err, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, DATA_ERR_LEN, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static inline uint32_t data_read_u32le(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline void data_write_u32le(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

static inline int shard_bytes_per_token_for(uint32_t vocab) { return vocab <= 65536u ? 2 : 4; }

// Parse and check a header from the first len bytes of a shard named name. Offsets in messages are byte offsets.
static inline int shard_header_parse(const uint8_t *buf, size_t len, const char *name, ShardHeader *h, char *err) {
    if (len < SHARD_HEADER_BYTES)
        return data_fail(err, "%s: truncated header: %zu bytes, a shard header is %d bytes (data ends at offset %zu)",
                         name, len, SHARD_HEADER_BYTES, len);
    uint32_t v[SHARD_HEADER_INTS];
    for (int i = 0; i < SHARD_HEADER_INTS; i++) v[i] = data_read_u32le(buf + 4 * i);
    if (v[SH_MAGIC] != SHARD_MAGIC)
        return data_fail(err, "%s: offset 0: bad magic 0x%08x (expected 0x%08x): not a token shard", name,
                         v[SH_MAGIC], SHARD_MAGIC);
    if (v[SH_VERSION] != SHARD_VERSION)
        return data_fail(err, "%s: offset 4: unsupported shard version %u (this build reads version %d)", name,
                         v[SH_VERSION], SHARD_VERSION);
    if (v[SH_VOCAB] < 2)
        return data_fail(err, "%s: offset 12: vocab size %u is too small", name, v[SH_VOCAB]);
    if (v[SH_BYTES_PER_TOKEN] != (uint32_t)shard_bytes_per_token_for(v[SH_VOCAB]))
        return data_fail(err, "%s: offset 8: %u bytes per token, but vocab %u needs %d", name,
                         v[SH_BYTES_PER_TOKEN], v[SH_VOCAB], shard_bytes_per_token_for(v[SH_VOCAB]));
    if (v[SH_TOKENIZER] != SHARD_TOKENIZER_EXTERNAL && v[SH_TOKENIZER] != SHARD_TOKENIZER_BYTES)
        return data_fail(err, "%s: offset 16: unknown tokenizer id %u", name, v[SH_TOKENIZER]);
    if (v[SH_TOKENIZER] == SHARD_TOKENIZER_BYTES && v[SH_VOCAB] != SHARD_BYTES_VOCAB)
        return data_fail(err, "%s: offset 12: vocab %u, but the bytes tokenizer has %d", name, v[SH_VOCAB],
                         SHARD_BYTES_VOCAB);
    uint64_t count = (uint64_t)v[SH_COUNT_LO] | ((uint64_t)v[SH_COUNT_HI] << 32);
    if (count == 0) return data_fail(err, "%s: offset 20: empty shard (0 tokens)", name);
    if (count > (UINT64_MAX - SHARD_HEADER_BYTES) / 4)
        return data_fail(err, "%s: offset 20: token count %llu is impossible", name, (unsigned long long)count);
    for (int i = SH_RESERVED; i < SHARD_HEADER_INTS; i++)
        if (v[i] != 0) return data_fail(err, "%s: offset %d: reserved header field is %u, not 0", name, 4 * i, v[i]);
    h->bytes_per_token = (int)v[SH_BYTES_PER_TOKEN];
    h->vocab = v[SH_VOCAB];
    h->tokenizer = v[SH_TOKENIZER];
    h->count = count;
    return 0;
}

static inline void shard_header_write(uint8_t *buf, const ShardHeader *h) {
    memset(buf, 0, SHARD_HEADER_BYTES);
    data_write_u32le(buf + 4 * SH_MAGIC, SHARD_MAGIC);
    data_write_u32le(buf + 4 * SH_VERSION, SHARD_VERSION);
    data_write_u32le(buf + 4 * SH_BYTES_PER_TOKEN, (uint32_t)h->bytes_per_token);
    data_write_u32le(buf + 4 * SH_VOCAB, h->vocab);
    data_write_u32le(buf + 4 * SH_TOKENIZER, h->tokenizer);
    data_write_u32le(buf + 4 * SH_COUNT_LO, (uint32_t)h->count);
    data_write_u32le(buf + 4 * SH_COUNT_HI, (uint32_t)(h->count >> 32));
}

static inline uint64_t shard_expected_size(const ShardHeader *h) {
    return SHARD_HEADER_BYTES + h->count * (uint64_t)h->bytes_per_token;
}

// A shard's total size must be exactly header + count tokens: shorter is truncated, longer is corrupt.
static inline int shard_check_size(const ShardHeader *h, uint64_t size, const char *name, char *err) {
    uint64_t want = shard_expected_size(h);
    if (size < want)
        return data_fail(err,
                         "%s: truncated: the header promises %llu tokens (%llu bytes) but the data ends at offset %llu",
                         name, (unsigned long long)h->count, (unsigned long long)want, (unsigned long long)size);
    if (size > want)
        return data_fail(err, "%s: offset %llu: %llu unexpected bytes after the last of %llu tokens", name,
                         (unsigned long long)want, (unsigned long long)(size - want), (unsigned long long)h->count);
    return 0;
}

// Decode n tokens stored at byte offset `offset` of shard name into out, refusing any token >= vocab.
static inline int shard_decode_tokens(const uint8_t *src, size_t n, const ShardHeader *h, const char *name,
                                      uint64_t offset, int32_t *out, char *err) {
    for (size_t i = 0; i < n; i++) {
        uint32_t t = h->bytes_per_token == 2 ? (uint32_t)src[2 * i] | ((uint32_t)src[2 * i + 1] << 8)
                                             : data_read_u32le(src + 4 * i);
        if (t >= h->vocab || t > (uint32_t)INT32_MAX)
            return data_fail(err, "%s: offset %llu: token %u is out of range (vocab %u)", name,
                             (unsigned long long)(offset + i * (uint64_t)h->bytes_per_token), t, h->vocab);
        out[i] = (int32_t)t;
    }
    return 0;
}

// Check a whole shard held in memory: header, exact size and every token. Used by tests and the fuzzer.
static inline int shard_validate_buffer(const uint8_t *buf, size_t len, const char *name, ShardHeader *h, char *err) {
    if (shard_header_parse(buf, len, name, h, err) || shard_check_size(h, len, name, err)) return -1;
    int32_t chunk[1024];
    for (uint64_t i = 0; i < h->count; i += 1024) {
        size_t n = (size_t)SDM_MIN((uint64_t)1024, h->count - i);
        uint64_t off = SHARD_HEADER_BYTES + i * (uint64_t)h->bytes_per_token;
        if (shard_decode_tokens(buf + off, n, h, name, off, chunk, err)) return -1;
    }
    return 0;
}

// Open a shard file (a regular file: a FIFO would block), parse its header and check its size. On success *out is
// open, positioned after the header.
static inline int shard_open(const char *path, ShardHeader *h, FILE **out, char *err) {
    char why[160];
    FILE *f = sdm_fopen_regular(path, why, sizeof why);
    if (!f) return data_fail(err, "%s: %s", path, why);
    uint8_t hdr[SHARD_HEADER_BYTES];
    size_t got = fread(hdr, 1, sizeof hdr, f);
    if (ferror(f)) { fclose(f); return data_fail(err, "%s: read error at offset 0: %s", path, strerror(errno)); }
    if (shard_header_parse(hdr, got, path, h, err)) { fclose(f); return -1; }
    long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (size < 0) { fclose(f); return data_fail(err, "%s: cannot determine the file size", path); }
    if (shard_check_size(h, (uint64_t)size, path, err) || fseek(f, SHARD_HEADER_BYTES, SEEK_SET) != 0) {
        fclose(f);
        return -1;
    }
    *out = f;
    return 0;
}

// Read n tokens starting at token index `first` of an open shard into out (int32), checking each against vocab.
static inline int shard_read_tokens(FILE *f, const ShardHeader *h, const char *name, uint64_t first, size_t n,
                                    int32_t *out, uint8_t *scratch /* n * bytes_per_token */, char *err) {
    uint64_t off = SHARD_HEADER_BYTES + first * (uint64_t)h->bytes_per_token;
    if (first + n > h->count)
        return data_fail(err, "%s: offset %llu: read of %zu tokens past the end (%llu tokens)", name,
                         (unsigned long long)off, n, (unsigned long long)h->count);
    if (fseek(f, (long)off, SEEK_SET) != 0 || fread(scratch, (size_t)h->bytes_per_token, n, f) != n)
        return data_fail(err, "%s: offset %llu: short read of %zu tokens (file changed or unreadable)", name,
                         (unsigned long long)off, n);
    return shard_decode_tokens(scratch, n, h, name, off, out, err);
}

// ---------------------------------------------------------------------------------------------------------
// Manifest: {dir}/{prefix}.manifest lists the shards of a complete set, one `NAME TOKENS BYTES` line each after
// the line SHARD_MANIFEST_HEADER. A writer removes it before touching any shard of the prefix and writes it last
// (.tmpPID, then rename), so a shard set is complete iff its manifest exists; the dataloader refuses shards it
// does not list with their size. A failed or killed run over an older set thus leaves nothing loadable.

#define SHARD_MANIFEST_HEADER "sdm.c shard manifest 1\n"
#define SHARD_PATH_LEN 1024

// {dir}/{prefix}.manifest of the shard at path ({dir}/{prefix}_NNNNNN.bin); -1 when path is not named that way.
static inline int shard_manifest_of(const char *path, char *out, size_t cap, const char **name, char *err) {
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    size_t n = strlen(base), digits = 0;
    while (n >= 4 + digits + 1 && base[n - 5 - digits] >= '0' && base[n - 5 - digits] <= '9') digits++;
    if (n < 4 || strcmp(base + n - 4, ".bin") || digits == 0 || n < digits + 6 || base[n - 5 - digits] != '_')
        return data_fail(err, "%s: not named PREFIX_NNNNNN.bin, so no PREFIX.manifest can list it", path);
    *name = base;
    snprintf(out, cap, "%.*s.manifest", (int)(base - path + n - 5 - digits), path);
    return 0;
}

// The shard at path (header h, size checked) must be listed in its manifest with its token count and size.
static inline int shard_manifest_check(const char *path, const ShardHeader *h, char *err) {
    char manifest[SHARD_PATH_LEN + 16], line[SHARD_PATH_LEN + 64], why[160], listed[SHARD_PATH_LEN];
    const char *name = NULL; // set by shard_manifest_of (gcc cannot see it through the inlining)
    if (shard_manifest_of(path, manifest, sizeof manifest, &name, err)) return -1;
    FILE *f = sdm_fopen_regular(manifest, why, sizeof why);
    if (!f)
        return data_fail(err, "%s: no complete shard set: %s: %s (it is written last; the set is incomplete, being "
                         "written, or older than manifests: run prepare_data again)", path, manifest, why);
    int ok = fgets(line, sizeof line, f) && !strcmp(line, SHARD_MANIFEST_HEADER), found = 0, lineno = 1, whole = 1;
    unsigned long long tokens = 0, bytes = 0;
    while (ok && whole && !found && fgets(line, sizeof line, f)) {
        lineno++;
        whole = strchr(line, '\n') || feof(f); // else the rest of the line would be read as a line of its own
        found = whole && sscanf(line, "%1023s %llu %llu", listed, &tokens, &bytes) == 3 && !strcmp(listed, name);
    }
    fclose(f);
    if (!ok) return data_fail(err, "%s: not a shard manifest (first line)", manifest);
    if (!whole)
        return data_fail(err, "%s: line %d is longer than %d characters: not a shard manifest", manifest, lineno,
                         (int)sizeof line - 2);
    if (!found) return data_fail(err, "%s: not listed in %s: not part of the complete shard set", path, manifest);
    if (tokens != h->count || bytes != shard_expected_size(h))
        return data_fail(err, "%s: %s lists %llu tokens (%llu bytes), the file holds %llu: another run's shard",
                         path, manifest, tokens, bytes, (unsigned long long)h->count);
    return 0;
}

// ---------------------------------------------------------------------------------------------------------
// ShardWriter: appends a token stream to {dir}/{prefix}_000000.bin, _000001.bin, ... with at most shard_limit
// tokens each. Each shard is written under a per-process .tmpPID name and renamed when complete, so a crash
// never leaves a file that looks finished, and processes writing the same (deterministic) data do not collide.
// Opening removes the prefix's manifest; a successful close removes stale shards of the prefix beyond the last
// one written and writes the manifest; shard_writer_abort (any failure) removes the temporary file only.

#ifndef SHARD_WRITE_BUF  // a fuzz harness may shrink it (at least SHARD_HEADER_BYTES + 4), to reach the flushes
#define SHARD_WRITE_BUF (1 << 20)
#endif

typedef struct {
    char dir[SHARD_PATH_LEN], prefix[128];
    ShardHeader h;          // of the shard being written (count grows)
    uint64_t shard_limit;   // tokens per shard
    FILE *f;
    char tmp_path[SHARD_PATH_LEN + 160];
    int num_shards;         // shards completed
    uint64_t total_tokens;
    uint8_t *buf;           // SHARD_WRITE_BUF bytes of encoded tokens waiting for fwrite
    size_t buf_used;
} ShardWriter;

static inline void shard_path(char *out, size_t cap, const char *dir, const char *prefix, int index) {
    snprintf(out, cap, "%s/%s_%06d.bin", dir, prefix, index);
}

static inline int shard_writer_open(ShardWriter *w, const char *dir, const char *prefix, uint32_t vocab,
                                    uint32_t tokenizer, uint64_t shard_limit, char *err) {
    memset(w, 0, sizeof *w);
    if (strlen(dir) >= sizeof w->dir || strlen(prefix) >= sizeof w->prefix)
        return data_fail(err, "%s: output path too long", dir);
    if (shard_limit == 0) return data_fail(err, "shard size limit must be at least 1 token");
    snprintf(w->dir, sizeof w->dir, "%s", dir);
    snprintf(w->prefix, sizeof w->prefix, "%s", prefix);
    w->h.vocab = vocab;
    w->h.tokenizer = tokenizer;
    w->h.bytes_per_token = shard_bytes_per_token_for(vocab);
    w->shard_limit = shard_limit;
    char manifest[SHARD_PATH_LEN + 160];
    snprintf(manifest, sizeof manifest, "%s/%s.manifest", dir, prefix);
    if (remove(manifest) != 0 && errno != ENOENT)  // the old set stops being complete before any shard changes
        return data_fail(err, "%s: cannot remove: %s", manifest, strerror(errno));
    w->buf = (uint8_t *)sdm_malloc(SHARD_WRITE_BUF);
    return 0;
}

static inline int shard_writer_flush_buf(ShardWriter *w, char *err) {
    if (w->buf_used && fwrite(w->buf, 1, w->buf_used, w->f) != w->buf_used)
        return data_fail(err, "%s: write failed: %s", w->tmp_path, strerror(errno));
    w->buf_used = 0;
    return 0;
}

static inline int shard_writer_start(ShardWriter *w, char *err) {
    char final_path[SHARD_PATH_LEN + 140];
    shard_path(final_path, sizeof final_path, w->dir, w->prefix, w->num_shards);
    snprintf(w->tmp_path, sizeof w->tmp_path, "%s.tmp%ld", final_path, (long)getpid());  // per process: see README
    w->f = fopen(w->tmp_path, "wb");
    if (!w->f) return data_fail(err, "%s: cannot create: %s", w->tmp_path, strerror(errno));
    w->h.count = 0;
    memset(w->buf, 0, SHARD_HEADER_BYTES);  // placeholder, rewritten with the count when the shard is finished
    w->buf_used = SHARD_HEADER_BYTES;
    return 0;
}

static inline int shard_writer_finish(ShardWriter *w, char *err) {
    uint8_t hdr[SHARD_HEADER_BYTES];
    char final_path[SHARD_PATH_LEN + 160];
    if (shard_writer_flush_buf(w, err)) return -1;
    shard_header_write(hdr, &w->h);
    int bad = fseek(w->f, 0, SEEK_SET) != 0 || fwrite(hdr, 1, sizeof hdr, w->f) != sizeof hdr;
    bad |= fclose(w->f) != 0;
    w->f = NULL;
    if (bad) return data_fail(err, "%s: write failed: %s", w->tmp_path, strerror(errno));
    shard_path(final_path, sizeof final_path, w->dir, w->prefix, w->num_shards);
    if (rename(w->tmp_path, final_path) != 0)
        return data_fail(err, "%s: cannot rename to %s: %s", w->tmp_path, final_path, strerror(errno));
    w->num_shards++;
    return 0;
}

// Room for how many of n more tokens before the shard is full or the buffer must be flushed (opens a shard).
static inline int shard_writer_room(ShardWriter *w, size_t n, size_t *room, char *err) {
    if (!w->f && shard_writer_start(w, err)) return -1;
    if (w->buf_used + 4 > SHARD_WRITE_BUF && shard_writer_flush_buf(w, err)) return -1;
    size_t buf_room = (SHARD_WRITE_BUF - w->buf_used) / (size_t)w->h.bytes_per_token;
    *room = (size_t)SDM_MIN((uint64_t)SDM_MIN(n, buf_room), w->shard_limit - w->h.count);
    return 0;
}

// m tokens were encoded into the buffer: count them, and finish the shard when it is full.
static inline int shard_writer_advance(ShardWriter *w, size_t m, char *err) {
    w->buf_used += m * (size_t)w->h.bytes_per_token;
    w->h.count += m;
    w->total_tokens += m;
    return w->h.count == w->shard_limit ? shard_writer_finish(w, err) : 0;
}

// tokens [n]: appended to the stream; each must be in [0, vocab).
static inline int shard_writer_append(ShardWriter *w, const int32_t *tokens, size_t n, char *err) {
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= w->h.vocab)
            return data_fail(err, "%s: refusing to write token %d (vocab %u)", w->prefix, tokens[i], w->h.vocab);
    while (n > 0) {
        size_t m;
        if (shard_writer_room(w, n, &m, err)) return -1;
        uint8_t *p = w->buf + w->buf_used;
        if (w->h.bytes_per_token == 2)
            for (size_t i = 0; i < m; i++) { p[2 * i] = (uint8_t)tokens[i]; p[2 * i + 1] = (uint8_t)(tokens[i] >> 8); }
        else
            for (size_t i = 0; i < m; i++) data_write_u32le(p + 4 * i, (uint32_t)tokens[i]);
        if (shard_writer_advance(w, m, err)) return -1;
        tokens += m;
        n -= m;
    }
    return 0;
}

// bytes [n] appended as the tokens 0..255 (the bytes tokenizer's identity map, without building an int32 copy:
// this is the prepare tool's hot loop). The vocab is at least 258, so every byte is a valid token.
static inline int shard_writer_append_bytes(ShardWriter *w, const uint8_t *bytes, size_t n, char *err) {
    if (w->h.vocab < 256)
        return data_fail(err, "%s: bytes need a vocab of at least 256 (have %u)", w->prefix, w->h.vocab);
    while (n > 0) {
        size_t m;
        if (shard_writer_room(w, n, &m, err)) return -1;
        uint8_t *p = w->buf + w->buf_used;
        if (w->h.bytes_per_token == 2)
            for (size_t i = 0; i < m; i++) { p[2 * i] = bytes[i]; p[2 * i + 1] = 0; }
        else
            for (size_t i = 0; i < m; i++) data_write_u32le(p + 4 * i, bytes[i]);
        if (shard_writer_advance(w, m, err)) return -1;
        bytes += m;
        n -= m;
    }
    return 0;
}

// {dir}/{prefix}.manifest listing the shards written (all full but the last), via .tmpPID and rename.
static inline int shard_writer_manifest(ShardWriter *w, char *err) {
    char path[SHARD_PATH_LEN + 160], tmp[SHARD_PATH_LEN + 192];
    snprintf(path, sizeof path, "%s/%s.manifest", w->dir, w->prefix);
    snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return data_fail(err, "%s: cannot create: %s", tmp, strerror(errno));
    int bad = fputs(SHARD_MANIFEST_HEADER, f) < 0;
    for (int i = 0; i < w->num_shards; i++) {
        ShardHeader h = w->h;
        h.count = i + 1 < w->num_shards ? w->shard_limit : w->total_tokens - w->shard_limit * (uint64_t)i;
        bad |= fprintf(f, "%s_%06d.bin %llu %llu\n", w->prefix, i, (unsigned long long)h.count,
                       (unsigned long long)shard_expected_size(&h)) < 0;
    }
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) { remove(tmp); return data_fail(err, "%s: write failed", path); }
    return 0;
}

// Finish the last shard, delete stale {prefix}_N.bin files left by an earlier, longer run, write the manifest.
static inline int shard_writer_close(ShardWriter *w, char *err) {
    int rc = w->f ? shard_writer_finish(w, err) : 0;
    for (int i = w->num_shards; rc == 0; i++) {
        char stale[SHARD_PATH_LEN + 160];
        shard_path(stale, sizeof stale, w->dir, w->prefix, i);
        if (remove(stale) != 0) break;
    }
    if (rc == 0) rc = shard_writer_manifest(w, err);
    free(w->buf);
    w->buf = NULL;
    return rc;
}

// After a failure: drop the shard being written; no manifest, so the prefix's set stays incomplete.
static inline void shard_writer_abort(ShardWriter *w) {
    if (w->f) { fclose(w->f); remove(w->tmp_path); }
    w->f = NULL;
    free(w->buf);
    w->buf = NULL;
}

#endif
