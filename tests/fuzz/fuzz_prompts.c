// tests/fuzz/fuzz_prompts.c: data/prompts.h's prompts_split (infer_sdm --prompts FILE). The first byte's bit 0 picks
// JSONL (member "text") or plain lines; the rest is the file. Promises checked: plain prompts are exactly the
// non-empty lines, in order; a JSONL prompt is a line's decoded "text" member (data/jsonl.h, checked again on the
// line alone); a refusal names the file and a line that exists, or says that no line holds a prompt.
#include "data/prompts.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int jsonl = data[0] & 1;
    size_t n = size - 1;
    uint8_t *text = (uint8_t *)malloc(n ? n : 1); // exactly n bytes, no terminator: ASan sees reads past the end
    if (n) memcpy(text, data + 1, n);
    char err[DATA_ERR_LEN] = "";
    Prompt *list = NULL;
    int count = prompts_split(text, n, jsonl, "text", "fuzz.txt", &list, err);
    int lines = 0;
    for (size_t i = 0; i < n; i++) lines += text[i] == '\n';
    lines += n > 0 && text[n - 1] != '\n';
    if (count < 0) {
        FUZZ_ASSERT(!list, "a refusal left a list");
        int line = 0;
        int named = sscanf(err, "fuzz.txt: line %d:", &line) == 1 && line >= 1 && line <= lines;
        FUZZ_ASSERT(named || !strcmp(err, "fuzz.txt: no prompt (every line is empty)"), "unclear refusal: '%s'", err);
    } else {
        FUZZ_ASSERT(count > 0 && list, "accepted without a prompt");
        JsonlParser jp;
        memset(&jp, 0, sizeof jp);
        int k = 0;
        for (size_t start = 0; start < n;) { // every line again, on its own
            const uint8_t *nl = (const uint8_t *)memchr(text + start, '\n', n - start);
            size_t end = nl ? (size_t)(nl - text) : n, len = end - start;
            int blank = 1;
            for (size_t i = start; i < end && blank; i++)
                blank = jsonl ? text[i] == ' ' || text[i] == '\t' || text[i] == '\r' : 0;
            if (!blank) {
                FUZZ_ASSERT(k < count, "fewer prompts than non-empty lines");
                if (jsonl) {
                    FUZZ_ASSERT(jsonl_parse_line(&jp, text + start, len, "text", err) == 0, "line re-parse: %s", err);
                    FUZZ_ASSERT(list[k].n == jp.text.len && (!list[k].n || !memcmp(list[k].bytes, jp.text.data,
                                list[k].n)), "prompt %d is not its line's text", k);
                } else {
                    FUZZ_ASSERT(list[k].n == len && !memcmp(list[k].bytes, text + start, len), "prompt %d is not its "
                                "line", k);
                }
                k++;
            }
            start = end + 1;
        }
        FUZZ_ASSERT(k == count, "%d prompts for %d non-empty lines", count, k);
        jsonl_parser_free(&jp);
        prompts_free(list, count);
    }
    free(text);
    return 0;
}
