// tests/fuzz/fuzz_config.c: core/config.h's parsers. The first byte picks the entry point, the rest is the input:
//   0: cfg_parse_text (a .cfg text) then cfg_validate
//   1: cfg_from_args (the text's lines as command-line arguments; `-c` dropped, so no file is opened)
//   2: cfg_load_file (the raw bytes as a file: NUL bytes, size)
// Promises checked: a refusal of a text names fuzz.cfg and one of its lines (a file: its path and a line); an
// accepted config's resolved dump (the checkpoint's config text) loads back to the same dump.
#include "core/config.h"
#include "tests/fuzz/fuzz.h"

static int count_lines(const char *text) {
    int lines = 1;
    for (const char *p = text; *p; p++) lines += *p == '\n' && p[1];
    return lines;
}

static char *dump_text(const Config *c) {
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    if (!mem) abort();
    cfg_dump(c, mem);
    fclose(mem);
    return text;
}

// The dump of c loads back (cfg_parse_text on the defaults) to a config with the same dump.
static void check_round_trip(const Config *c) {
    char err[CFG_ERR] = "", *text = dump_text(c);
    Config back;
    cfg_defaults(&back);
    int ok = cfg_parse_text(&back, text, "dump", err);
    FUZZ_ASSERT(ok, "the dump of an accepted config is refused: %s", err);
    char *again = dump_text(&back);
    FUZZ_ASSERT(!strcmp(text, again), "the dump does not load back the same:\n%s\nvs\n%s", text, again);
    free(text);
    free(again);
}

// "name:LINE: ..." -> LINE, else 0.
static int refusal_line(const char *err, const char *name) {
    size_t n = strlen(name);
    return strncmp(err, name, n) == 0 && err[n] == ':' ? atoi(err + n + 1) : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int mode = data[0] % 3;
    char *text = fuzz_cstring(data + 1, size - 1), err[CFG_ERR] = "";
    Config c;
    cfg_defaults(&c);
    if (mode == 0) {
        if (cfg_parse_text(&c, text, "fuzz.cfg", err)) {
            FUZZ_ASSERT(memchr(err, 0, sizeof err), "unterminated message");
            check_round_trip(&c);
            cfg_validate(&c, err);
        } else {
            int line = refusal_line(err, "fuzz.cfg");
            FUZZ_ASSERT(line >= 1 && line <= count_lines(text), "refusal without fuzz.cfg:LINE: '%s'", err);
        }
    } else if (mode == 1) {
        char *argv[65] = {"fuzz"};
        int argc = 1;
        for (char *p = text; p && argc < 65;) {
            char *nl = strchr(p, '\n');
            if (nl) *nl = 0;
            if (strcmp(p, "-c") != 0) argv[argc++] = p;
            p = nl ? nl + 1 : NULL;
        }
        if (cfg_from_args(&c, argc, argv, err)) {
            check_round_trip(&c);
            FUZZ_ASSERT(cfg_validate(&c, err), "cfg_from_args accepted a config cfg_validate refuses: %s", err);
        } else {
            FUZZ_ASSERT(err[0] && memchr(err, 0, sizeof err), "refusal without a message");
        }
    } else {
        const char *path = fuzz_path("config.cfg");
        fuzz_write_file(path, data + 1, size - 1);
        if (cfg_load_file(&c, path, err)) check_round_trip(&c);
        else FUZZ_ASSERT(refusal_line(err, path) >= 1, "file refusal without %s:LINE: '%s'", path, err);
    }
    free(text);
    return 0;
}
