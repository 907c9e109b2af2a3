// tests/test_config_fuzz.c: random mutations of valid config texts (the shipped configs and a resolved dump) through
// cfg_parse_text, and some through cfg_load_file. Each must be accepted or refused, never crash (ASan/UBSan); a
// refusal names name:line with a line that exists; an accepted text's resolved dump loads back to the same Config.
//
//     build/test_config_fuzz                 # the short budget of `make test`
//     build/test_config_fuzz 1000000 [SEED]  # a long run by hand
#include <stdlib.h>

#include "core/config.h"
#include "core/rng.h"
#include "tests/test.h"

#define FUZZ_TEXT_CAP (4 * CFG_LINE)

static const char *const SEEDS[] = {"configs/debug_sdm.cfg", "configs/debug_hybrid.cfg", "configs/sdm_flagship.cfg",
                                    "configs/recall_sdm.cfg", "configs/baseline_7B.cfg"};
#define NUM_SEEDS ((int)(sizeof SEEDS / sizeof SEEDS[0]))

// Fragments that sit at the edges of what the parser accepts.
static const char *const PIECES[] = {"=", "#", "\n", ",", " ", "2147483648", "-2147483649", "1e309", "nan", "-0",
                                     "inf", "0x10", "all", "1e-13", "4294967296", "true", "\t", "\r\n", "\x7f", "é",
                                     "model.dim = 8\n", "steps = 7\n", "data.seq_len = 16777216\n", ",,,"};
#define NUM_PIECES ((int)(sizeof PIECES / sizeof PIECES[0]))

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) sdm_die("cannot open %s", path);
    char *text = (char *)sdm_calloc(FUZZ_TEXT_CAP, 1);
    size_t n = fread(text, 1, FUZZ_TEXT_CAP - 1, f);
    fclose(f);
    text[n] = 0;
    return text;
}

static void insert(char *text, size_t at, const char *piece, size_t n) {
    size_t len = strlen(text);
    if (len + n >= FUZZ_TEXT_CAP) return;
    memmove(text + at + n, text + at, len - at + 1);
    memcpy(text + at, piece, n);
}

// One random edit of text (NUL-terminated, FUZZ_TEXT_CAP bytes).
static void mutate(Rng *r, char *text) {
    size_t len = strlen(text), at = len ? rng_below(r, (uint32_t)len) : 0;
    switch (rng_below(r, 6)) {
    case 0: if (len) text[at] = (char)(1 + rng_below(r, 255)); break;                         // any byte but NUL
    case 1: { const char *p = PIECES[rng_below(r, NUM_PIECES)]; insert(text, at, p, strlen(p)); break; }
    case 2: { // a deletion
        size_t want = rng_below(r, 40), n = SDM_MIN(len - at, want);
        memmove(text + at, text + at + n, len - at - n + 1);
        break;
    }
    case 3: { // a copy of a line elsewhere (duplicate keys)
        char line[256];
        const char *s = text + at, *e = strchr(s, '\n');
        size_t n = SDM_MIN(e ? (size_t)(e - s) + 1 : strlen(s), sizeof line);
        memcpy(line, s, n);
        insert(text, rng_below(r, (uint32_t)len + 1), line, n);
        break;
    }
    case 4: { // a long run of one character (long comments, long values)
        char run[CFG_LINE + 64];
        size_t n = 1 + rng_below(r, sizeof run);
        memset(run, " #x9,"[rng_below(r, 5)], n);
        insert(text, at, run, n);
        break;
    }
    default: text[at] = 0; break;  // truncation
    }
}

// The line number in a refusal "name:LINE: ...", or 0 when the message does not start that way.
static int refusal_line(const char *err, const char *name) {
    size_t n = strlen(name);
    if (strncmp(err, name, n) != 0 || err[n] != ':') return 0;
    return atoi(err + n + 1);
}

static int count_lines(const char *text) {
    int lines = 1;
    for (const char *p = text; *p; p++) lines += *p == '\n' && p[1];
    return lines;
}

// The dump of an accepted config loads back to the same Config (the dump is the checkpoint's config text).
static int dump_round_trips(const Config *c) {
    char *text = NULL, err[CFG_ERR];
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    if (!mem) sdm_die("open_memstream");
    cfg_dump(c, mem);
    fclose(mem);
    Config back;
    cfg_defaults(&back);
    int ok = cfg_parse_text(&back, text, "dump", err) && memcmp(c, &back, sizeof back) == 0;
    free(text);
    return ok;
}

typedef struct { long accepted, valid, refused, unnamed, bad_round_trip; } FuzzStats;

static void fuzz_one(const char *text, FuzzStats *s) {
    char err[CFG_ERR] = "";
    Config c;
    cfg_defaults(&c);
    if (!cfg_parse_text(&c, text, "fuzz.cfg", err)) {
        int line = refusal_line(err, "fuzz.cfg");
        s->refused++;
        if (line < 1 || line > count_lines(text)) {
            if (s->unnamed++ < 5) printf("refusal without a valid fuzz.cfg:line: %s\n", err);
        }
        return;
    }
    s->accepted++;
    s->valid += cfg_validate(&c, err);
    if (!dump_round_trips(&c) && s->bad_round_trip++ < 5) printf("dump does not round-trip:\n%s\n", text);
}

// Some mutants through a real file and cfg_load_file: its messages name the path.
static void fuzz_file(const char *text, long *unnamed) {
    const char *path = "build/test_config_fuzz.cfg";
    FILE *f = fopen(path, "wb");
    if (!f) sdm_die("cannot write %s", path);
    fputs(text, f);
    fclose(f);
    char err[CFG_ERR] = "";
    Config c;
    cfg_defaults(&c);
    if (!cfg_load_file(&c, path, err) && refusal_line(err, path) < 1 && (*unnamed)++ < 5)
        printf("file refusal without %s:line: %s\n", path, err);
}

int main(int argc, char **argv) {
    long iterations = argc > 1 ? atol(argv[1]) : 20000;
    uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
    char *seeds[NUM_SEEDS], *text = (char *)sdm_malloc(FUZZ_TEXT_CAP);
    for (int i = 0; i < NUM_SEEDS; i++) seeds[i] = read_text(SEEDS[i]);
    Rng r = rng_make(seed);
    FuzzStats s = {0, 0, 0, 0, 0};
    long file_unnamed = 0;
    for (long it = 0; it < iterations; it++) {
        memcpy(text, seeds[rng_below(&r, NUM_SEEDS)], FUZZ_TEXT_CAP);
        for (int k = 1 + (int)rng_below(&r, 4); k > 0; k--) mutate(&r, text);
        fuzz_one(text, &s);
        if (it % 20 == 0) fuzz_file(text, &file_unnamed);
    }
    remove("build/test_config_fuzz.cfg");
    printf("config fuzz (seed %llu): %ld mutants, %ld accepted (%ld valid), %ld refused\n", (unsigned long long)seed,
           iterations, s.accepted, s.valid, s.refused);
    CHECK(s.unnamed == 0, "%ld refusals do not name fuzz.cfg and an existing line", s.unnamed);
    CHECK(file_unnamed == 0, "%ld file refusals do not name the file and a line", file_unnamed);
    CHECK(s.bad_round_trip == 0, "%ld accepted configs whose dump does not load back the same", s.bad_round_trip);
    CHECK(s.accepted > iterations / 20 && s.refused > iterations / 4, "fuzzing explored too little");
    for (int i = 0; i < NUM_SEEDS; i++) free(seeds[i]);
    free(text);
    return test_summary();
}
