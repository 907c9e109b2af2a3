// tests/test_prompts.c: the prompts of `infer_sdm --prompts` (data/prompts.h): plain lines (empty ones skipped, every
// other byte kept), JSONL (the named string member of each line's object, escapes decoded, other members of any kind
// skipped, blank lines skipped), the refusals with file and line (broken JSON, a missing or non-string member, no
// prompt at all), and random bytes that never crash or half-read a file (under ASan/UBSan).
#include "core/rng.h"
#include "data/prompts.h"
#include "tests/test.h"

// prompts_split of the C string text; *out as prompts_split leaves it.
static int split(const char *text, int jsonl, const char *field, Prompt **out, char *err) {
    return prompts_split((const uint8_t *)text, strlen(text), jsonl, field, "p.jsonl", out, err);
}

static int prompt_is(const Prompt *p, const char *want, size_t n) { return p->n == n && !memcmp(p->bytes, want, n); }

static void test_lines(void) {
    Prompt *p;
    char err[DATA_ERR_LEN];
    int n = split("hello\n\nab\r\n\tx y\n", 0, "prompt", &p, err);
    CHECK(n == 3, "plain lines: %d prompts, expected 3", n);
    if (n == 3)
        CHECK(prompt_is(&p[0], "hello", 5) && prompt_is(&p[1], "ab\r", 3) && prompt_is(&p[2], "\tx y", 4),
              "plain lines: the bytes of each line (a \\r kept, tabs and spaces kept)");
    if (n > 0) prompts_free(p, n);
    n = split("last line without newline", 0, "prompt", &p, err);
    CHECK(n == 1 && prompt_is(&p[0], "last line without newline", 25), "a last line without '\\n'");
    if (n > 0) prompts_free(p, n);
    CHECK(split("\n\n\n", 0, "prompt", &p, err) == -1 && p == NULL && strstr(err, "no prompt"),
          "only empty lines: refused (%s)", err);
    CHECK(split("", 0, "prompt", &p, err) == -1 && strstr(err, "p.jsonl"), "an empty file: refused, named (%s)", err);
}

static void test_jsonl(void) {
    Prompt *p;
    char err[DATA_ERR_LEN];
    const char *text = "{\"id\": 7, \"prompt\": \"Q: caf\\u00e9?\\nA:\", \"meta\": {\"prompt\": \"inner\"}}\n"
                       "   \n"
                       "{\"prompt\": \"\"}\r\n"
                       "{\"tags\": [\"a\", null, true, 1.5e3], \"prompt\": \"tab\\there \\\"q\\\" \\ud83d\\ude00\"}";
    int n = split(text, 1, "prompt", &p, err);
    CHECK(n == 3, "jsonl: %d prompts, expected 3 (%s)", n, n < 0 ? err : "");
    if (n == 3) {
        CHECK(prompt_is(&p[0], "Q: caf\xc3\xa9?\nA:", 12), "jsonl: escapes decoded to UTF-8, the top-level member");
        CHECK(p[1].n == 0, "jsonl: an empty member is an empty prompt (BOS alone)");
        CHECK(prompt_is(&p[2], "tab\there \"q\" \xf0\x9f\x98\x80", 17), "jsonl: tab, quotes, a surrogate pair");
    }
    if (n > 0) prompts_free(p, n);
    n = split("{\"q\": \"x\"}\n{\"q\": \"y\", \"prompt\": 3}\n", 1, "q", &p, err);
    CHECK(n == 2 && prompt_is(&p[0], "x", 1) && prompt_is(&p[1], "y", 1), "jsonl: another member name");
    if (n > 0) prompts_free(p, n);

    // refusals name the file and the line
    static const struct { const char *text, *why; } BAD[] = {
        {"{\"prompt\": \"a\"}\n{\"prompt\": \"b\"", "line 2"},         // unterminated object
        {"{\"prompt\": \"a\"}\n\n{\"other\": \"b\"}\n", "line 3"},     // no such member
        {"{\"prompt\": 5}\n", "line 1"},                               // not a string
        {"[\"prompt\", \"a\"]\n", "line 1"},                           // not an object
        {"{\"prompt\": \"a\"} trailing\n", "line 1"},                  // characters after the object
        {"{\"prompt\": \"a\\x\"}\n", "line 1"},                        // bad escape
        {"\n\n", "no prompt"},                                         // nothing
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        err[0] = 0;
        n = split(BAD[i].text, 1, "prompt", &p, err);
        CHECK(n == -1 && p == NULL && strstr(err, "p.jsonl") && strstr(err, BAD[i].why),
              "bad jsonl %zu: refused naming the file and '%s' (got %d: %s)", i, BAD[i].why, n, err);
    }
}

// Random bytes, some shaped like JSONL: every call either succeeds with prompts that are byte ranges of a line's
// decoded member, or fails cleanly; ASan/UBSan catch any out-of-bounds read.
static void test_fuzz(void) {
    Rng r = rng_make(99);
    static const char *PIECES[] = {"{", "}", "\"prompt\"", ":", "\"", "\\", "\\u", "d83d", "\n", ",", "[", "]", "x",
                                   " ", "null", "1e5", "\xff", "\\n"};
    uint8_t buf[256];
    int ok = 0, failed = 0;
    for (int it = 0; it < 20000; it++) {
        size_t n = 0, len = rng_below(&r, sizeof buf - 16);
        while (n < len) {
            if (rng_below(&r, 2)) { buf[n++] = (uint8_t)rng_below(&r, 256); continue; }
            const char *piece = PIECES[rng_below(&r, sizeof PIECES / sizeof PIECES[0])];
            size_t k = strlen(piece);
            if (n + k > sizeof buf) break;
            memcpy(buf + n, piece, k);
            n += k;
        }
        Prompt *p;
        char err[DATA_ERR_LEN];
        int count = prompts_split(buf, n, (int)(it & 1), "prompt", "fuzz", &p, err);
        if (count < 0) { failed++; continue; }
        ok++;
        prompts_free(p, count);
    }
    CHECK(ok > 0 && failed > 0, "fuzz: %d accepted, %d refused (both must occur)", ok, failed);
}

int main(void) {
    test_lines();
    test_jsonl();
    test_fuzz();
    return test_summary();
}
