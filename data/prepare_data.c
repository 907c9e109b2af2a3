// prepare_data: text or JSONL files -> bytes-tokenized train/validation shards (data/README.md), or the
// generated recall tasks with --task recall|mqar|copy (data/recall.h, data/synthetic.h). Exits non-zero with a
// file:line (or file and offset) message on bad input.
#define _POSIX_C_SOURCE 200809L  // clock_gettime
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "data/prepare.h"
#include "data/synthetic.h"

static void usage(void) {
    fputs("usage: prepare_data [options] -o DIR INPUT...     text or JSONL files (- reads standard input)\n"
          "       prepare_data --task recall|mqar|copy [task options] -o DIR   a generated recall task\n"
          "options:\n"
          "  --format auto|text|jsonl  input format (auto: .jsonl/.json/.ndjson are JSONL, anything else text)\n"
          "  --unit file|para|line     documents of a text input: the whole file (default), blank-line separated\n"
          "                            paragraphs, or single lines\n"
          "  --field NAME              JSONL member holding the text (default text)\n"
          "  --val-every K             every K-th document goes to validation (default 100, 0: none)\n"
          "  --shard-tokens N          tokens per shard (default 100000000)\n"
          "  --skip-bad                report and skip invalid UTF-8 and malformed JSONL lines (default: refuse)\n"
          "  --quiet                   no progress line\n"
          "task options (data/README.md; --recall is --task recall):\n"
          "  all:    --seed S --train-tokens N --val-tokens N --min-gap G --max-gap G\n"
          "  recall: --min-facts F --max-facts F --queries-per-fact Q   (defaults: the embedded default dataset)\n"
          "  mqar:   --seq-len T --pairs P        copy: --seq-len T --copy-len L\n"
          "          (documents of exactly T tokens = data.seq_len; --max-gap 0: as far as the row allows)\n"
          "outputs: DIR/train_000000.bin ... and DIR/val_000000.bin ... (tasks: DIR/TASK_train_*, TASK_val_*), and\n"
          "         their manifests (DIR/train.manifest ...), written last: the loader takes only listed shards\n",
          stderr);
    exit(2);
}

// Decimal digits only (no sign, no spaces: strtoull would take "+5", " 5" and "-1"), within 64 bits.
static unsigned long long parse_count(const char *opt, const char *s) {
    unsigned long long v = 0;
    if (!*s) sdm_die("%s: expected a non-negative integer, got \"\"", opt);
    for (const char *c = s; *c; c++) {
        if (*c < '0' || *c > '9') sdm_die("%s: expected a non-negative integer, got \"%s\"", opt, s);
        if (v > (ULLONG_MAX - (unsigned)(*c - '0')) / 10) sdm_die("%s: %s is too large", opt, s);
        v = v * 10 + (unsigned)(*c - '0');
    }
    return v;
}

static int parse_int(const char *opt, const char *s) {
    unsigned long long v = parse_count(opt, s);
    if (v > 1000000000ull) sdm_die("%s: %s is too large", opt, s);
    return (int)v;
}

static double g_start;
static int g_progress_shown;  // a progress line without its newline is on stderr

static void print_progress(const Preparer *pp) {
    static uint64_t next = 64u << 20;
    if (pp->bytes_read < next) return;
    next = pp->bytes_read + (64u << 20);
    double mb = (double)pp->bytes_read / 1e6;
    fprintf(stderr, "\rprepare_data: %.0f MB read, %llu documents, %llu tokens, %.0f MB/s", mb,
            (unsigned long long)pp->docs, (unsigned long long)(pp->train.total_tokens + pp->val.total_tokens),
            mb / SDM_MAX(sdm_now_s() - g_start, 1e-9));
    g_progress_shown = 1;
}

static void end_progress_line(void) {
    if (g_progress_shown) fputc('\n', stderr);
    g_progress_shown = 0;
}

static void fail(const char *err) {
    end_progress_line();
    sdm_die("%s", err);
}

static PrepUnit input_unit(const char *path, const char *format, PrepUnit text_unit) {
    if (strcmp(format, "jsonl") == 0) return PREP_JSONL;
    if (strcmp(format, "text") == 0) return text_unit;
    const char *dot = strrchr(path, '.');
    if (dot && (!strcmp(dot, ".jsonl") || !strcmp(dot, ".json") || !strcmp(dot, ".ndjson"))) return PREP_JSONL;
    return text_unit;
}

static void run_task(const char *dir, const char *task, const RecallConfig *rc, SynConfig *sc) {
    char err[DATA_ERR_LEN];
    double t0 = sdm_now_s();
    uint64_t dropped = 0;
    if (!strcmp(task, "recall")) {
        if (recall_dataset_write(dir, rc, err)) sdm_die("%s", err);
    } else {
        if (strcmp(task, "mqar") && strcmp(task, "copy"))
            sdm_die("--task: expected recall, mqar or copy, got \"%s\"", task);
        sc->task = !strcmp(task, "mqar") ? SYN_MQAR : SYN_COPY;
        if (syn_dataset_write(dir, sc, &dropped, err)) sdm_die("%s", err);
    }
    fprintf(stderr, "prepare_data: %s dataset in %s (%.1f s)\n", task, dir, sdm_now_s() - t0);
    if (dropped)
        fprintf(stderr, "prepare_data: %llu facts left unqueried (no room at a drawn gap)\n",
                (unsigned long long)dropped);
}

int main(int argc, char **argv) {
    const char *dir = NULL, *format = "auto";
    PrepUnit text_unit = PREP_TEXT_FILE;
    int val_every = 100, skip_bad = 0, quiet = 0, num_inputs = 0;
    unsigned long long shard_tokens = 100000000ull;
    const char *field = "text", *task = NULL;
    const char **inputs = (const char **)sdm_calloc((size_t)argc, sizeof(char *));
    RecallConfig rc = recall_default_config();
    SynConfig sc = syn_default_config(SYN_MQAR);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_value = i + 1 < argc;
        if (!strcmp(a, "--skip-bad")) skip_bad = 1;
        else if (!strcmp(a, "--quiet")) quiet = 1;
        else if (!strcmp(a, "--recall")) task = "recall";
        else if (a[0] != '-' || !strcmp(a, "-")) inputs[num_inputs++] = a;
        else if (!has_value) usage();
        else if (!strcmp(a, "-o")) dir = argv[++i];
        else if (!strcmp(a, "--format")) format = argv[++i];
        else if (!strcmp(a, "--field")) field = argv[++i];
        else if (!strcmp(a, "--val-every")) val_every = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--shard-tokens")) shard_tokens = parse_count(a, argv[++i]);
        else if (!strcmp(a, "--task")) task = argv[++i];
        else if (!strcmp(a, "--seed")) rc.seed = sc.seed = parse_count(a, argv[++i]);
        else if (!strcmp(a, "--train-tokens")) rc.train_tokens = sc.train_tokens = parse_count(a, argv[++i]);
        else if (!strcmp(a, "--val-tokens")) rc.val_tokens = sc.val_tokens = parse_count(a, argv[++i]);
        else if (!strcmp(a, "--min-gap")) rc.min_gap = sc.min_gap = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--max-gap")) rc.max_gap = sc.max_gap = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--seq-len")) sc.seq_len = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--pairs")) sc.pairs = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--copy-len")) sc.copy_len = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--min-facts")) rc.min_facts = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--max-facts")) rc.max_facts = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--queries-per-fact")) rc.queries_per_fact = parse_int(a, argv[++i]);
        else if (!strcmp(a, "--unit")) {
            const char *u = argv[++i];
            if (!strcmp(u, "file")) text_unit = PREP_TEXT_FILE;
            else if (!strcmp(u, "para")) text_unit = PREP_TEXT_PARA;
            else if (!strcmp(u, "line")) text_unit = PREP_TEXT_LINE;
            else sdm_die("--unit: expected file, para or line, got \"%s\"", u);
        } else usage();
    }
    if (!dir) usage();
    if (strcmp(format, "auto") && strcmp(format, "text") && strcmp(format, "jsonl"))
        sdm_die("--format: expected auto, text or jsonl, got \"%s\"", format);
    if (task && num_inputs > 0) sdm_die("--task %s takes no input files", task);
    if (!task && num_inputs == 0) sdm_die("no input files (see prepare_data with no arguments for usage)");
    char err[DATA_ERR_LEN];
    int lock;  // one writer at a time in dir; released when the process ends
    if (dataset_make_dir(dir, err) || dataset_lock(dir, &lock, err)) sdm_die("%s", err);
    if (task) {
        run_task(dir, task, &rc, &sc);
        return 0;
    }

    Preparer pp;
    g_start = sdm_now_s();
    if (preparer_open(&pp, dir, shard_tokens, err)) fail(err);
    pp.val_every = val_every;
    pp.skip_bad = skip_bad;
    pp.field = field;
    pp.progress = quiet ? NULL : print_progress;
    for (int i = 0; i < num_inputs; i++)
        if (preparer_add_file(&pp, inputs[i], input_unit(inputs[i], format, text_unit), err)) {
            preparer_abort(&pp);
            fail(err);
        }
    uint64_t train_tokens = pp.train.total_tokens, val_tokens = pp.val.total_tokens;
    int train_shards = pp.train.num_shards + (pp.train.f != NULL), val_shards = pp.val.num_shards + (pp.val.f != NULL);
    uint64_t docs = pp.docs, val_docs = pp.val_docs, skipped = pp.skipped, bytes = pp.bytes_read;
    if (preparer_close(&pp, err)) fail(err);
    double secs = sdm_now_s() - g_start;
    end_progress_line();
    free(inputs);
    printf("prepare_data: %llu documents (%llu train, %llu validation), %llu skipped\n", (unsigned long long)docs,
           (unsigned long long)(docs - val_docs), (unsigned long long)val_docs, (unsigned long long)skipped);
    printf("prepare_data: %llu train tokens in %d shard(s), %llu validation tokens in %d shard(s), in %s\n",
           (unsigned long long)train_tokens, train_shards, (unsigned long long)val_tokens, val_shards, dir);
    printf("prepare_data: %.1f MB in %.2f s = %.0f MB/s\n", (double)bytes / 1e6, secs,
           (double)bytes / 1e6 / SDM_MAX(secs, 1e-9));
    if (val_docs == 0) fprintf(stderr, "prepare_data: warning: no validation documents (see --val-every)\n");
    return 0;
}
