// data/tokenizer.h: the bytes tokenizer (docs/FORMATS.md#bytes-tokenizer: V = 258, tokens 0..255 are bytes, BOS = 256,
// EOS = 257; a document is BOS + its bytes + EOS) and a strict UTF-8 validator used by the prepare tool.
#ifndef SDM_DATA_TOKENIZER_H
#define SDM_DATA_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TOK_BYTES_VOCAB 258
#define TOK_BOS 256
#define TOK_EOS 257

// out [n + 2]: BOS, the n bytes, EOS. Returns the number of tokens written (n + 2).
static inline size_t tok_encode_document(const uint8_t *text, size_t n, int32_t *out) {
    out[0] = TOK_BOS;
    for (size_t i = 0; i < n; i++) out[i + 1] = text[i];
    out[n + 1] = TOK_EOS;
    return n + 2;
}

// out [n] (without specials), for prompts: the text bytes as tokens. Returns n.
static inline size_t tok_encode_bytes(const uint8_t *text, size_t n, int32_t *out) {
    for (size_t i = 0; i < n; i++) out[i] = text[i];
    return n;
}

static inline int tok_is_special(int32_t t) { return t == TOK_BOS || t == TOK_EOS; }

// out [n]: the bytes of tokens, with BOS/EOS (and anything outside the vocab) dropped. Returns bytes written.
static inline size_t tok_decode(const int32_t *tokens, size_t n, uint8_t *out) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (tokens[i] >= 0 && tokens[i] < 256) out[m++] = (uint8_t)tokens[i];
    return m;
}

// A printable name for one token, for logs and generation: the byte itself, or "<bos>", "<eos>", "<?>".
static inline const char *tok_name(int32_t t, char buf[8]) {
    if (t == TOK_BOS) return "<bos>";
    if (t == TOK_EOS) return "<eos>";
    if (t < 0 || t > 255) return "<?>";
    buf[0] = (char)t;
    buf[1] = 0;
    return buf;
}

// Length of the valid UTF-8 sequence starting at s[0] (1..4), or 0 when it is invalid: bad lead byte, missing or
// bad continuation, overlong form, a surrogate (U+D800..DFFF) or a code point above U+10FFFF (RFC 3629).
static inline size_t utf8_sequence_length(const uint8_t *s, size_t avail) {
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return 0;
    if (avail < len || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return len;
}

// Returns n when s[0..n) is valid UTF-8, else the offset of the first invalid sequence. ASCII runs go 8 at a time.
static inline size_t utf8_valid_prefix(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if ((w & 0x8080808080808080ull) == 0) { i += 8; continue; }
        }
        size_t len = utf8_sequence_length(s + i, n - i);
        if (len == 0) return i;
        i += len;
    }
    return n;
}

// Append the UTF-8 encoding of code point cp (< 0x110000, not a surrogate) to out; returns bytes written.
static inline size_t utf8_encode(uint32_t cp, uint8_t *out) {
    if (cp < 0x80) { out[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { out[0] = (uint8_t)(0xC0 | (cp >> 6)); out[1] = (uint8_t)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

#endif
