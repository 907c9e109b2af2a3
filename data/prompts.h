// data/prompts.h: the prompts of `infer_sdm --prompts FILE`: one per non-empty line of the file, or, for a FILE whose
// name ends in .jsonl, one per non-empty line holding a JSON object whose string member FIELD is the prompt (its
// escapes decoded to UTF-8 bytes, data/jsonl.h). A bad line is refused with the file, line and column; nothing is
// half-read. Lines end at '\n' (a '\r' before it stays in a plain-text prompt).
#ifndef SDM_DATA_PROMPTS_H
#define SDM_DATA_PROMPTS_H

#include "data/jsonl.h"

typedef struct {
    uint8_t *bytes; // [n], malloc'ed (a 1-byte buffer when empty)
    size_t n;
} Prompt;

// Whether a prompts file is JSONL (by its name).
static inline int prompts_is_jsonl(const char *path) {
    size_t n = strlen(path);
    return n >= 6 && !strcmp(path + n - 6, ".jsonl");
}

// Appends a copy of bytes[0..n) to the growing list (*list)[*count] of capacity *cap.
static inline void prompts_push(Prompt **list, int *count, int *cap, const uint8_t *bytes, size_t n) {
    if (*count == *cap) {
        Prompt *grown = (Prompt *)realloc(*list, sizeof(Prompt) * (size_t)(*cap *= 2));
        if (!grown) sdm_die("out of host memory for %d prompts", *cap);
        *list = grown;
    }
    Prompt *p = &(*list)[(*count)++];
    p->bytes = (uint8_t *)sdm_malloc(n ? n : 1);
    if (n) memcpy(p->bytes, bytes, n);
    p->n = n;
}

static inline void prompts_free(Prompt *list, int count) {
    for (int i = 0; i < count; i++) free(list[i].bytes);
    free(list);
}

// The prompts of text[n] (the file `name`), JSONL (member `field`) or plain lines, into *out (malloc'ed; free with
// prompts_free). Returns their count, or -1 with err (DATA_ERR_LEN) naming the file, the line and the reason (and
// *out NULL). No prompt at all is an error too.
static inline int prompts_split(const uint8_t *text, size_t n, int jsonl, const char *field, const char *name,
                                Prompt **out, char *err) {
    int count = 0, cap = 16, line = 0;
    Prompt *list = (Prompt *)sdm_malloc(sizeof(Prompt) * (size_t)cap);
    JsonlParser jp;
    memset(&jp, 0, sizeof jp);
    char why[DATA_ERR_LEN];
    for (size_t start = 0; start < n; line++) {
        const uint8_t *nl = (const uint8_t *)memchr(text + start, '\n', n - start);
        size_t end = nl ? (size_t)(nl - text) : n;
        int blank = end == start;
        if (jsonl) { // a line of spaces only counts as empty too
            blank = 1;
            for (size_t i = start; i < end && blank; i++)
                blank = text[i] == ' ' || text[i] == '\t' || text[i] == '\r';
        }
        if (!blank && !jsonl) prompts_push(&list, &count, &cap, text + start, end - start);
        if (!blank && jsonl) {
            if (jsonl_parse_line(&jp, text + start, end - start, field, why)) {
                data_fail(err, "%s: line %d: %s", name, line + 1, why);
                jsonl_parser_free(&jp);
                prompts_free(list, count);
                *out = NULL;
                return -1;
            }
            prompts_push(&list, &count, &cap, jp.text.data, jp.text.len);
        }
        start = end + 1;
    }
    jsonl_parser_free(&jp);
    if (count == 0) {
        prompts_free(list, count);
        *out = NULL;
        return data_fail(err, "%s: no prompt (every line is empty)", name);
    }
    *out = list;
    return count;
}

#endif
