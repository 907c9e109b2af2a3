// data/jsonl.h: a strict, allocation-reusing JSON parser for one JSONL line, extracting one top-level string
// member (the document text). The whole line is checked against the JSON grammar (RFC 8259) so that a broken
// line is refused rather than half-read; string escapes (\n, \", \uXXXX, surrogate pairs) are decoded to UTF-8.
#ifndef SDM_DATA_JSONL_H
#define SDM_DATA_JSONL_H

#include <stdint.h>
#include <string.h>

#include "core/common.h"
#include "data/shard.h"
#include "data/tokenizer.h"

#define JSON_MAX_DEPTH 128

typedef struct {
    uint8_t *data;
    size_t len, cap;
} ByteBuf;

static inline void bytebuf_reserve(ByteBuf *b, size_t extra) {
    if (b->len + extra <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    uint8_t *p = (uint8_t *)realloc(b->data, cap);
    if (!p) sdm_die("out of host memory growing a buffer to %zu bytes", cap);
    b->data = p;
    b->cap = cap;
}

static inline void bytebuf_append(ByteBuf *b, const void *src, size_t n) {
    if (n == 0) return;  // an empty string may meet a buffer never allocated (memcpy must not see NULL)
    bytebuf_reserve(b, n);
    memcpy(b->data + b->len, src, n);
    b->len += n;
}

static inline void bytebuf_free(ByteBuf *b) { free(b->data); memset(b, 0, sizeof *b); }

// b holds exactly the characters of s (an empty b may have no buffer at all).
static inline int bytebuf_equals(const ByteBuf *b, const char *s) {
    return b->len == strlen(s) && (b->len == 0 || memcmp(b->data, s, b->len) == 0);
}

typedef struct {
    ByteBuf text;  // the decoded field of the last line parsed
    ByteBuf key;   // scratch: the member name being compared
    // per line:
    const uint8_t *start, *p, *end;
    char *err;
} JsonlParser;

static inline void jsonl_parser_free(JsonlParser *jp) { bytebuf_free(&jp->text); bytebuf_free(&jp->key); }

static inline int json_fail(JsonlParser *jp, const char *what) {
    return data_fail(jp->err, "column %zu: %s", (size_t)(jp->p - jp->start) + 1, what);
}

static inline void json_skip_ws(JsonlParser *jp) {
    while (jp->p < jp->end && (*jp->p == ' ' || *jp->p == '\t' || *jp->p == '\n' || *jp->p == '\r')) jp->p++;
}

static inline int json_hex4(JsonlParser *jp, uint32_t *v) {
    if (jp->end - jp->p < 4) return json_fail(jp, "truncated \\u escape");
    *v = 0;
    for (int i = 0; i < 4; i++) {
        uint8_t c = jp->p[i];
        uint32_t d = c >= '0' && c <= '9' ? (uint32_t)(c - '0') : c >= 'a' && c <= 'f' ? (uint32_t)(c - 'a' + 10)
                   : c >= 'A' && c <= 'F' ? (uint32_t)(c - 'A' + 10) : 16u;
        if (d == 16) return json_fail(jp, "bad hex digit in \\u escape");
        *v = *v * 16 + d;
    }
    jp->p += 4;
    return 0;
}

// \uXXXX (jp->p just after the 'u'), joining a surrogate pair; a lone surrogate cannot be UTF-8, so it is refused.
static inline int json_unicode_escape(JsonlParser *jp, uint32_t *cp) {
    if (json_hex4(jp, cp)) return -1;
    if (*cp >= 0xDC00 && *cp <= 0xDFFF) return json_fail(jp, "lone low surrogate in \\u escape");
    if (*cp < 0xD800 || *cp > 0xDBFF) return 0;
    uint32_t lo = 0;
    if (jp->end - jp->p < 2 || jp->p[0] != '\\' || jp->p[1] != 'u')
        return json_fail(jp, "lone high surrogate in \\u escape");
    jp->p += 2;
    if (json_hex4(jp, &lo)) return -1;
    if (lo < 0xDC00 || lo > 0xDFFF) return json_fail(jp, "high surrogate not followed by a low one");
    *cp = 0x10000 + ((*cp - 0xD800) << 10) + (lo - 0xDC00);
    return 0;
}

// Length of the run from p of bytes that stand for themselves in a string (not '"', '\\' or a control byte).
// Eight bytes at a time: a word has none of them when no byte is zero after xor with '"' or '\\' and none
// is below 0x20 (the classic "has a byte less than n" test, which has no false negatives).
static inline size_t json_plain_run(const uint8_t *p, const uint8_t *end) {
    const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    const uint8_t *s = p;
    while (end - p >= 8) {
        uint64_t w, q, b;
        memcpy(&w, p, 8);
        q = w ^ (ones * '"');
        b = w ^ (ones * '\\');
        if ((((q - ones) & ~q) | ((b - ones) & ~b) | ((w - ones * 0x20) & ~w)) & highs) break;
        p += 8;
    }
    while (p < end && *p != '"' && *p != '\\' && *p >= 0x20) p++;
    return (size_t)(p - s);
}

// A string starting at the opening quote, decoded into out (or only checked when out is NULL).
static inline int json_string(JsonlParser *jp, ByteBuf *out) {
    jp->p++;  // opening quote
    for (;;) {
        size_t run = json_plain_run(jp->p, jp->end);
        if (out) bytebuf_append(out, jp->p, run);
        jp->p += run;
        if (jp->p == jp->end) return json_fail(jp, "unterminated string");
        uint8_t c = *jp->p;
        if (c == '"') { jp->p++; return 0; }
        if (c < 0x20) return json_fail(jp, "raw control character inside a string");
        if (jp->end - jp->p < 2) return json_fail(jp, "unterminated escape");
        uint8_t e = jp->p[1], one = 0, enc[4];
        size_t n = 1;
        jp->p += 2;
        switch (e) {
        case '"': one = '"'; break;
        case '\\': one = '\\'; break;
        case '/': one = '/'; break;
        case 'b': one = '\b'; break;
        case 'f': one = '\f'; break;
        case 'n': one = '\n'; break;
        case 'r': one = '\r'; break;
        case 't': one = '\t'; break;
        case 'u': {
            uint32_t cp = 0;
            if (json_unicode_escape(jp, &cp)) return -1;
            n = utf8_encode(cp, enc);
            break;
        }
        default: jp->p -= 1; return json_fail(jp, "unknown escape");
        }
        if (n == 1 && e != 'u') enc[0] = one;
        if (out) bytebuf_append(out, enc, n);
    }
}

static inline int json_digits(JsonlParser *jp) {
    const uint8_t *s = jp->p;
    while (jp->p < jp->end && *jp->p >= '0' && *jp->p <= '9') jp->p++;
    return jp->p > s ? 0 : json_fail(jp, "digit expected in number");
}

static inline int json_number(JsonlParser *jp) {
    if (*jp->p == '-') jp->p++;
    if (jp->p < jp->end && *jp->p == '0') jp->p++;
    else if (json_digits(jp)) return -1;
    if (jp->p < jp->end && *jp->p == '.') { jp->p++; if (json_digits(jp)) return -1; }
    if (jp->p < jp->end && (*jp->p == 'e' || *jp->p == 'E')) {
        jp->p++;
        if (jp->p < jp->end && (*jp->p == '+' || *jp->p == '-')) jp->p++;
        if (json_digits(jp)) return -1;
    }
    return 0;
}

static inline int json_literal(JsonlParser *jp, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(jp->end - jp->p) < n || memcmp(jp->p, word, n) != 0) return json_fail(jp, "invalid literal");
    jp->p += n;
    return 0;
}

static inline int json_value(JsonlParser *jp, int depth, const char *field, int *found);

// An object or array starting at its bracket. Top-level (depth 1) members named field are decoded into jp->text.
static inline int json_container(JsonlParser *jp, int depth, const char *field, int *found) {
    const uint8_t close = *jp->p == '{' ? '}' : ']';
    if (depth > JSON_MAX_DEPTH) return json_fail(jp, "nesting too deep");
    jp->p++;
    json_skip_ws(jp);
    if (jp->p < jp->end && *jp->p == close) { jp->p++; return 0; }
    for (;;) {
        int wanted = 0;
        if (close == '}') {
            if (jp->p == jp->end || *jp->p != '"') return json_fail(jp, "member name (a string) expected");
            jp->key.len = 0;
            if (json_string(jp, &jp->key)) return -1;
            wanted = depth == 1 && bytebuf_equals(&jp->key, field);
            json_skip_ws(jp);
            if (jp->p == jp->end || *jp->p != ':') return json_fail(jp, "':' expected after member name");
            jp->p++;
            json_skip_ws(jp);
        }
        if (wanted) {
            if (*found) return json_fail(jp, "duplicate member with the document field's name");
            if (jp->p == jp->end || *jp->p != '"') return json_fail(jp, "the document field is not a string");
            jp->text.len = 0;
            if (json_string(jp, &jp->text)) return -1;
            *found = 1;
        } else if (json_value(jp, depth + 1, field, found)) {
            return -1;
        }
        json_skip_ws(jp);
        if (jp->p == jp->end) return json_fail(jp, "unterminated object or array");
        if (*jp->p == close) { jp->p++; return 0; }
        if (*jp->p != ',') return json_fail(jp, "',' or closing bracket expected");
        jp->p++;
        json_skip_ws(jp);
    }
}

static inline int json_value(JsonlParser *jp, int depth, const char *field, int *found) {
    if (jp->p == jp->end) return json_fail(jp, "value expected");
    switch (*jp->p) {
    case '{': case '[': return json_container(jp, depth, field, found);
    case '"': return json_string(jp, NULL);
    case 't': return json_literal(jp, "true");
    case 'f': return json_literal(jp, "false");
    case 'n': return json_literal(jp, "null");
    default:
        if (*jp->p == '-' || (*jp->p >= '0' && *jp->p <= '9')) return json_number(jp);
        return json_fail(jp, "value expected");
    }
}

// line [n] (no newline): one JSON object. On success jp->text holds the decoded string member `field`.
// On failure err holds "column C: what is wrong".
static inline int jsonl_parse_line(JsonlParser *jp, const uint8_t *line, size_t n, const char *field, char *err) {
    int found = 0;
    jp->start = jp->p = line;
    jp->end = line + n;
    jp->err = err;
    json_skip_ws(jp);
    if (jp->p == jp->end || *jp->p != '{') return json_fail(jp, "a JSON object expected");
    if (json_container(jp, 1, field, &found)) return -1;
    json_skip_ws(jp);
    if (jp->p != jp->end) return json_fail(jp, "unexpected characters after the object");
    if (!found) return data_fail(err, "no \"%s\" string field", field);
    return 0;
}

#endif
