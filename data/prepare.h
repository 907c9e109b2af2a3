// data/prepare.h: the core of the prepare_data tool, as a library so tests can run it on files: read text or
// JSONL inputs, cut them into documents, check each is valid UTF-8, tokenize with the bytes tokenizer
// (BOS + bytes + EOS) and stream the documents into {dir}/train_NNNNNN.bin and {dir}/val_NNNNNN.bin.
// Invalid documents (bad UTF-8, malformed JSONL lines) are reported as file:line and skipped, or refused.
#ifndef SDM_DATA_PREPARE_H
#define SDM_DATA_PREPARE_H

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "data/jsonl.h"
#include "data/shard.h"
#include "data/tokenizer.h"

typedef enum {
    PREP_TEXT_FILE,  // a whole text file is one document (bytes kept exactly)
    PREP_TEXT_PARA,  // paragraphs separated by blank lines are documents (lines joined with '\n')
    PREP_TEXT_LINE,  // every non-empty line is a document
    PREP_JSONL       // every non-blank line is a JSON object whose string field `field` is a document
} PrepUnit;

#ifndef PREP_BLOCK  // a test or fuzz harness may shrink it, to reach the block boundaries with small inputs
#define PREP_BLOCK (4u << 20)  // input is read in blocks of this many bytes
#endif

typedef struct Preparer Preparer;
struct Preparer {
    // options, set after preparer_open
    int val_every;          // document i goes to validation when (i+1) % val_every == 0; 0: no validation split
    int skip_bad;           // 1: report bad documents on `report` and skip them; 0: refuse them (error)
    const char *field;      // JSONL member holding the text ("text")
    FILE *report;           // where skipped documents are reported (stderr; NULL: silent)
    void (*progress)(const Preparer *);  // called after every input block (NULL: none)
    // totals
    uint64_t docs, val_docs, skipped, bytes_read;
    // internals
    ShardWriter train, val;
    ByteBuf block, doc;     // input lines; the document being assembled (text units)
    uint64_t doc_bad_line;  // first line of the current document with invalid UTF-8 (0: none)
    size_t doc_bad_col;
    JsonlParser jp;
};

static inline int preparer_open(Preparer *pp, const char *dir, uint64_t shard_tokens, char *err) {
    memset(pp, 0, sizeof *pp);
    pp->val_every = 0;
    pp->field = "text";
    pp->report = stderr;
    if (shard_writer_open(&pp->train, dir, "train", TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES, shard_tokens, err) ||
        shard_writer_open(&pp->val, dir, "val", TOK_BYTES_VOCAB, SHARD_TOKENIZER_BYTES, shard_tokens, err))
        return -1;
    return 0;
}

// One valid document (UTF-8 already checked): BOS + bytes + EOS (docs/FORMATS.md#bytes-tokenizer) into the train or the
// validation stream. Empty documents carry nothing to learn and are left out.
static inline int preparer_add_document(Preparer *pp, const uint8_t *text, size_t n, char *err) {
    static const int32_t bos = TOK_BOS, eos = TOK_EOS;
    if (n == 0) return 0;
    int to_val = pp->val_every > 0 && (pp->docs + 1) % (uint64_t)pp->val_every == 0;
    ShardWriter *w = to_val ? &pp->val : &pp->train;
    pp->docs++;
    pp->val_docs += (uint64_t)to_val;
    if (shard_writer_append(w, &bos, 1, err) || shard_writer_append_bytes(w, text, n, err)) return -1;
    return shard_writer_append(w, &eos, 1, err);
}

// A bad document: reported and counted when skipping, an error otherwise. what: "invalid UTF-8 at column 3".
// line 0 stands for the whole file.
static inline int preparer_bad_document(Preparer *pp, const char *path, uint64_t line, const char *what, char *err) {
    char where[SHARD_PATH_LEN + 32];
    if (line) snprintf(where, sizeof where, "%s:%llu", path, (unsigned long long)line);
    else snprintf(where, sizeof where, "%s", path);
    if (!pp->skip_bad) return data_fail(err, "%s: %s (use --skip-bad to skip such documents)", where, what);
    if (pp->report) fprintf(pp->report, "prepare_data: %s: %s; skipped\n", where, what);
    pp->skipped++;
    return 0;
}

static inline int preparer_jsonl_line(Preparer *pp, const char *path, uint64_t line, const uint8_t *s, size_t n,
                                      char *err) {
    char why[DATA_ERR_LEN], what[DATA_ERR_LEN + 32];
    size_t i = 0;
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r')) i++;
    if (i == n) return 0;  // blank line
    if (jsonl_parse_line(&pp->jp, s, n, pp->field, why)) {
        snprintf(what, sizeof what, "malformed JSONL line: %s", why);
        return preparer_bad_document(pp, path, line, what, err);
    }
    size_t valid = utf8_valid_prefix(pp->jp.text.data, pp->jp.text.len);
    if (valid < pp->jp.text.len) {
        snprintf(what, sizeof what, "invalid UTF-8 in the \"%s\" string at decoded byte %zu", pp->field, valid);
        return preparer_bad_document(pp, path, line, what, err);
    }
    return preparer_add_document(pp, pp->jp.text.data, pp->jp.text.len, err);
}

// The document assembled from text lines is complete: add it, or report its first invalid line.
static inline int preparer_end_text_document(Preparer *pp, const char *path, char *err) {
    int rc = 0;
    if (pp->doc_bad_line) {
        char what[96];
        snprintf(what, sizeof what, "invalid UTF-8 at byte column %zu", pp->doc_bad_col + 1);
        rc = preparer_bad_document(pp, path, pp->doc_bad_line, what, err);
    } else {
        rc = preparer_add_document(pp, pp->doc.data, pp->doc.len, err);
    }
    pp->doc.len = 0;
    pp->doc_bad_line = 0;
    return rc;
}

// One line of a text input (with its '\n' when it had one) into the document being assembled.
static inline int preparer_text_line(Preparer *pp, PrepUnit unit, const char *path, uint64_t line, const uint8_t *s,
                                     size_t n, char *err) {
    size_t body = n > 0 && s[n - 1] == '\n' ? n - 1 : n;
    size_t valid = utf8_valid_prefix(s, body);
    if (valid < body && !pp->doc_bad_line) { pp->doc_bad_line = line; pp->doc_bad_col = valid; }
    if (unit == PREP_TEXT_FILE) { bytebuf_append(&pp->doc, s, n); return 0; }
    int blank = body == 0 || (body == 1 && s[0] == '\r');
    if (unit == PREP_TEXT_LINE) {
        if (!blank) bytebuf_append(&pp->doc, s, body);
        return preparer_end_text_document(pp, path, err);
    }
    if (blank) return preparer_end_text_document(pp, path, err);  // PREP_TEXT_PARA
    if (pp->doc.len > 0) bytebuf_append(&pp->doc, "\n", 1);
    bytebuf_append(&pp->doc, s, body);
    return 0;
}

static inline int preparer_line(Preparer *pp, PrepUnit unit, const char *path, uint64_t line, const uint8_t *s,
                                size_t n, char *err) {
    if (unit == PREP_JSONL) return preparer_jsonl_line(pp, path, line, s, n > 0 && s[n - 1] == '\n' ? n - 1 : n, err);
    return preparer_text_line(pp, unit, path, line, s, n, err);
}

// Read path ("-": standard input) block by block and feed its lines (each with its '\n', the last possibly
// without) to the unit's parser.
static inline int preparer_add_file(Preparer *pp, const char *path, PrepUnit unit, char *err) {
    int is_stdin = strcmp(path, "-") == 0;
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) return data_fail(err, "%s: cannot open: %s", path, strerror(errno));
    if (is_stdin) path = "<stdin>";
    uint64_t line = 0, file_bytes = 0;
    size_t carry = 0;  // bytes of an unfinished line at the front of block
    int rc = 0;
    pp->block.len = 0;
    for (;;) {
        bytebuf_reserve(&pp->block, PREP_BLOCK);
        size_t got = fread(pp->block.data + carry, 1, pp->block.cap - carry, f);
        if (ferror(f)) {
            rc = data_fail(err, "%s: read error at offset %llu: %s", path, (unsigned long long)file_bytes,
                           strerror(errno));
            break;
        }
        file_bytes += got;
        pp->bytes_read += got;
        size_t len = carry + got, start = 0;
        int eof = got == 0;
        while (rc == 0 && start < len) {
            const uint8_t *nl = (const uint8_t *)memchr(pp->block.data + start, '\n', len - start);
            if (!nl && !eof) break;
            size_t end = nl ? (size_t)(nl - pp->block.data) + 1 : len;
            rc = preparer_line(pp, unit, path, ++line, pp->block.data + start, end - start, err);
            start = end;
        }
        if (rc || eof) break;
        carry = len - start;
        memmove(pp->block.data, pp->block.data + start, carry);
        pp->block.len = carry;  // so that bytebuf_reserve grows the block when one line fills it
        if (pp->progress) pp->progress(pp);
    }
    if (!is_stdin) fclose(f);
    if (rc == 0 && file_bytes == 0) {
        pp->doc.len = 0;
        return preparer_bad_document(pp, path, 0, "empty input file", err);
    }
    if (rc == 0 && unit != PREP_JSONL) rc = preparer_end_text_document(pp, path, err);
    return rc;
}

static inline void preparer_free(Preparer *pp) {
    bytebuf_free(&pp->block);
    bytebuf_free(&pp->doc);
    jsonl_parser_free(&pp->jp);
}

// After a failure: drop the shards being written and write no manifest (the output is incomplete).
static inline void preparer_abort(Preparer *pp) {
    shard_writer_abort(&pp->train);
    shard_writer_abort(&pp->val);
    preparer_free(pp);
}

// Finish the shards and their manifests. An input with no documents at all is an error: there would be nothing to
// train on.
static inline int preparer_close(Preparer *pp, char *err) {
    if (pp->docs == pp->val_docs) {
        data_fail(err, "no training documents in the input (%llu read, %llu skipped)", (unsigned long long)pp->docs,
                  (unsigned long long)pp->skipped);
        preparer_abort(pp);
        return -1;
    }
    int rc = shard_writer_close(&pp->train, err);
    if (shard_writer_close(&pp->val, rc ? NULL : err)) rc = -1;
    preparer_free(pp);
    return rc;
}

#endif
