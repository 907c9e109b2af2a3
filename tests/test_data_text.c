// The bytes tokenizer, the UTF-8 validator (against an independent decoder, exhaustively for 1-2 byte inputs and
// on random 3-4 byte ones) and the JSONL parser (escapes, surrogates, nesting, every malformed case, fuzzing).
#include "core/rng.h"
#include "data/jsonl.h"
#include "data/tokenizer.h"
#include "tests/test.h"

static void test_tokenizer(void) {
    uint8_t text[300], back[302];
    int32_t tok[302];
    for (int i = 0; i < 300; i++) text[i] = (uint8_t)(i * 7);
    size_t n = tok_encode_document(text, 300, tok);
    CHECK(n == 302 && tok[0] == TOK_BOS && tok[301] == TOK_EOS, "document framing: %zu tokens, %d ... %d", n, tok[0],
          tok[301]);
    int in_range = 1;
    for (size_t i = 0; i < n; i++) in_range &= tok[i] >= 0 && tok[i] < TOK_BYTES_VOCAB;
    CHECK(in_range, "token outside the vocab");
    size_t m = tok_decode(tok, n, back);
    CHECK(m == 300 && memcmp(back, text, 300) == 0, "decode(encode(x)) != x");
    CHECK(tok_encode_bytes(text, 300, tok) == 300 && tok[0] == text[0] && tok[299] == text[299], "encode_bytes");
    char buf[8];
    CHECK(!strcmp(tok_name(TOK_BOS, buf), "<bos>") && !strcmp(tok_name(TOK_EOS, buf), "<eos>") &&
          !strcmp(tok_name('a', buf), "a") && !strcmp(tok_name(999, buf), "<?>"), "token names");
}

// Reference: s[0..n) is one valid UTF-8 character iff decoding its bits gives a code point in range, not a
// surrogate, whose shortest encoding (utf8_encode) is exactly s.
static int ref_valid_char(const uint8_t *s, size_t n) {
    uint32_t cp;
    if (n == 1) cp = s[0];
    else if (n == 2) cp = s[0] & 0x1Fu;
    else if (n == 3) cp = s[0] & 0x0Fu;
    else cp = s[0] & 0x07u;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3Fu);
    }
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    uint8_t enc[4];
    return utf8_encode(cp, enc) == n && memcmp(enc, s, n) == 0;
}

// Reference validity of a whole string: some split into valid characters exists (lengths from the lead byte).
static int ref_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        size_t len = s[i] < 0x80 ? 1 : s[i] >= 0xF0 ? 4 : s[i] >= 0xE0 ? 3 : s[i] >= 0xC0 ? 2 : 0;
        if (len == 0 || i + len > n || !ref_valid_char(s + i, len)) return 0;
        i += len;
    }
    return 1;
}

static void test_utf8(void) {
    int mismatches = 0;
    uint8_t s[16];
    for (uint32_t v = 0; v < 65536; v++) {  // every 1- and 2-byte string
        s[0] = (uint8_t)v; s[1] = (uint8_t)(v >> 8);
        mismatches += (utf8_valid_prefix(s, 1) == 1) != ref_valid(s, 1);
        mismatches += (utf8_valid_prefix(s, 2) == 2) != ref_valid(s, 2);
    }
    Rng r = rng_make(11);
    int valid_seen = 0;
    for (int it = 0; it < 300000; it++) {  // random 3..12 byte strings biased towards multi-byte leads
        size_t n = 3 + rng_below(&r, 10);
        for (size_t i = 0; i < n; i++) {
            uint32_t k = rng_below(&r, 4);
            s[i] = (uint8_t)(k == 0   ? rng_below(&r, 128)
                             : k == 1 ? 0x80 + rng_below(&r, 64)
                                      : 0xC0 + rng_below(&r, 64));
        }
        int ref = ref_valid(s, n);
        valid_seen += ref;
        mismatches += (utf8_valid_prefix(s, n) == n) != ref;
    }
    CHECK(mismatches == 0, "%d validator disagreements with the reference", mismatches);
    CHECK(valid_seen > 1000, "random strings hit too few valid cases (%d)", valid_seen);
    int bad_encode = 0;
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        size_t n = utf8_encode(cp, s);
        bad_encode += utf8_sequence_length(s, n) != n || !ref_valid_char(s, n);
    }
    CHECK(bad_encode == 0, "%d code points encode to invalid UTF-8", bad_encode);
    const uint8_t where[] = {'a', 'b', 'c', 0xE2, 0x82, 0xAC, 'd', 0xED, 0xA0, 0x80, 'e'};  // "abc€d" + surrogate
    CHECK(utf8_valid_prefix(where, sizeof where) == 7, "first invalid offset %zu, expected 7",
          utf8_valid_prefix(where, sizeof where));
}

typedef struct { const char *line, *text; } JsonCase;

static void test_jsonl_valid(void) {
    static const JsonCase cases[] = {
        {"{\"text\": \"hello\"}", "hello"},
        {"{\"id\":1,\"text\":\"a\\nb\"}", "a\nb"},
        {"{\"text\":\"\\\" \\\\ \\/ \\b \\f \\n \\r \\t\"}", "\" \\ / \b \f \n \r \t"},
        {"{\"text\":\"caf\\u00e9 \\u20AC \\ud83d\\ude00\"}", "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"},
        {"{\"text\":\"raw caf\xC3\xA9\"}", "raw caf\xC3\xA9"},
        {"{\"meta\":{\"text\":\"no\"},\"text\":\"yes\"}", "yes"},
        {"{\"text\":\"x\",\"arr\":[1,-2.5e+3,0,0.5,1E9,true,false,null,{\"a\":[]},[]],\"o\":{}}", "x"},
        {"  {  \"text\"  :  \"x\"  }  \r", "x"},
        {"{\"te\\u0078t\":\"escaped key\"}", "escaped key"},
        {"{\"text\":\"\"}", ""},
    };
    JsonlParser jp;
    memset(&jp, 0, sizeof jp);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char err[DATA_ERR_LEN] = "";
        const char *line = cases[c].line;
        int rc = jsonl_parse_line(&jp, (const uint8_t *)line, strlen(line), "text", err);
        CHECK(rc == 0, "valid line %zu refused: %s: %s", c, line, err);
        CHECK(rc == 0 && jp.text.len == strlen(cases[c].text) && memcmp(jp.text.data, cases[c].text, jp.text.len) == 0,
              "line %zu decoded wrongly: %s", c, line);
    }
    const char nul_line[] = "{\"text\":\"a\\u0000b\"}";
    char err[DATA_ERR_LEN];
    CHECK(jsonl_parse_line(&jp, (const uint8_t *)nul_line, strlen(nul_line), "text", err) == 0 && jp.text.len == 3 &&
          jp.text.data[1] == 0, "\\u0000 is a NUL byte");
    const char other[] = "{\"body\":\"by field\"}";
    CHECK(jsonl_parse_line(&jp, (const uint8_t *)other, strlen(other), "body", err) == 0 && jp.text.len == 8,
          "another field name");
    jsonl_parser_free(&jp);
}

static void test_jsonl_malformed(void) {
    static const char *bad[] = {
        "", "   ", "[1,2]", "\"text\"", "{\"text\": 5}", "{\"text\": \"a\"", "{\"text\": \"a", "{\"text\": \"a\x01\"}",
        "{\"text\": \"\\ud800\"}", "{\"text\": \"\\udc00\"}", "{\"text\": \"\\ud800\\u0041\"}", "{\"text\": \"\\q\"}",
        "{\"text\": \"\\u12G4\"}", "{\"text\": \"\\u12\"}", "{\"text\":\"a\"}x", "{\"text\":\"a\",\"text\":\"b\"}",
        "{\"other\":\"a\"}", "{\"a\":01,\"text\":\"x\"}", "{\"a\":1.,\"text\":\"x\"}", "{\"a\":tru,\"text\":\"x\"}",
        "{\"a\" 1}", "{,}", "{\"text\":\"x\",}", "{\"a\":[1,2,\"text\":\"x\"}", "{\"a\":-,\"text\":\"x\"}",
        "{\"text\":\"x\" \"b\":1}", "{\"a\":1e,\"text\":\"x\"}", "{\"text\":\"x\"}}", "{'text':'x'}",
    };
    JsonlParser jp;
    memset(&jp, 0, sizeof jp);
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        char err[DATA_ERR_LEN] = "";
        int rc = jsonl_parse_line(&jp, (const uint8_t *)bad[c], strlen(bad[c]), "text", err);
        CHECK(rc != 0, "malformed line accepted: %s", bad[c]);
        CHECK(rc == 0 || strstr(err, "column") || strstr(err, "field"), "message without a column: %s -> %s", bad[c],
              err);
    }
    char deep[1000];
    strcpy(deep, "{\"text\":\"x\",\"a\":");
    size_t n = strlen(deep);
    while (n < 600) deep[n++] = '[';
    deep[n] = 0;
    char err[DATA_ERR_LEN] = "";
    CHECK(jsonl_parse_line(&jp, (const uint8_t *)deep, n, "text", err) != 0 && strstr(err, "deep"), "deep nesting: %s",
          err);
    jsonl_parser_free(&jp);
}

// Empty strings reach a parser whose buffers were never allocated: an empty member name, an empty document, and an
// empty field name (each parsed by a fresh parser, so that a memcpy or memcmp of a NULL buffer shows under UBSan).
static void test_jsonl_empty_strings(void) {
    static const struct { const char *line, *field, *text; } cases[] = {
        {"{\"\": 1, \"text\": \"a\"}", "text", "a"}, {"{\"text\": \"\"}", "text", ""}, {"{\"\": \"doc\"}", "", "doc"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        JsonlParser jp;
        char err[DATA_ERR_LEN] = "";
        memset(&jp, 0, sizeof jp);
        int rc = jsonl_parse_line(&jp, (const uint8_t *)cases[c].line, strlen(cases[c].line), cases[c].field, err);
        CHECK(rc == 0 && jp.text.len == strlen(cases[c].text) &&
              (jp.text.len == 0 || memcmp(jp.text.data, cases[c].text, jp.text.len) == 0),
              "%s (field \"%s\"): %s", cases[c].line, cases[c].field, err);
        jsonl_parser_free(&jp);
    }
}

// Random mutations of a valid line: never a crash; an accepted line never decodes to more bytes than it has.
static void test_jsonl_fuzz(void) {
    const char base[] = "{\"id\": 12, \"text\": \"Hi \\\"you\\\"\\n caf\\u00e9 \\ud83d\\ude00 \xC3\xA9!\", "
                        "\"m\": {\"k\": [1, 2.5e3, null]}}";
    const size_t n0 = strlen(base);
    static const char alphabet[] = "{}[]\":,\\u0123456789abcdefnrtlsE.+- \x01\xC3\xA9\xF0\xED";
    JsonlParser jp;
    memset(&jp, 0, sizeof jp);
    Rng r = rng_make(3);
    int accepted = 0, too_long = 0;
    for (int it = 0; it < 20000; it++) {
        uint8_t line[256];
        size_t n = n0;
        memcpy(line, base, n0);
        for (int k = 1 + (int)rng_below(&r, 3); k > 0; k--) {
            size_t at = rng_below(&r, (uint32_t)n);
            uint32_t op = rng_below(&r, 3);
            if (op == 0) line[at] = (uint8_t)alphabet[rng_below(&r, sizeof alphabet - 1)];
            else if (op == 1 && n > 1) { memmove(line + at, line + at + 1, n - at - 1); n--; }
            else if (n < sizeof line) {
                memmove(line + at + 1, line + at, n - at);
                line[at] = (uint8_t)alphabet[rng_below(&r, sizeof alphabet - 1)];
                n++;
            }
        }
        uint8_t *exact = (uint8_t *)sdm_malloc(n);
        memcpy(exact, line, n);
        char err[DATA_ERR_LEN];
        if (jsonl_parse_line(&jp, exact, n, "text", err) == 0) {
            accepted++;
            too_long += jp.text.len > n;
        }
        free(exact);
    }
    printf("json fuzz: %d of 20000 mutated lines accepted\n", accepted);
    CHECK(accepted > 500 && accepted < 19000, "mutations explored too little (%d accepted)", accepted);
    CHECK(too_long == 0, "%d accepted lines decoded longer than their source", too_long);
    jsonl_parser_free(&jp);
}

int main(void) {
    test_tokenizer();
    test_utf8();
    test_jsonl_valid();
    test_jsonl_malformed();
    test_jsonl_empty_strings();
    test_jsonl_fuzz();
    return test_summary();
}
