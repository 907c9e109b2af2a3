// infer_sdm.cu: generates text from a checkpoint of a model trained by train_sdm (docs/MODEL.md#generation).
//
//   ./infer_sdm CHECKPOINT [--prompt TEXT | --prompt-file F | --prompts F [--prompt-field NAME]] [--max-new N]
//               [--temperature T]
//               [--top-p P] [--top-k K] [--seed S] [--batch B] [--no-graph] [--no-pdl] [--fp32]
//               [--bench]
//   ./infer_sdm CHECKPOINT --eval SHARDS [--eval-batches N] [--eval-task T] [--out DIR] [--fp32]
//
// CHECKPOINT is a model.bin or a run folder (its newest complete checkpoint). A prompt is BOS + its bytes, cut
// from the left to leave room for N new tokens in the model's context (data.seq_len of its config). temperature 0
// is greedy; otherwise top-p, if given, takes precedence over top-k. Generation stops at EOS or after N tokens.
// With --prompts, every non-empty line of F is a prompt (of a F.jsonl, the string member NAME, default "prompt", of
// the JSON object on the line: data/prompts.h), generated B at a time (model/generate.cuh gen_batch). The generated
// bytes are printed with non-printables escaped as they come (one prompt: token by token; several: each prompt's
// text when it stops), then the speed. --bench times prefill and decode instead.
// --eval scores the checkpoint on token shards as train_sdm's evaluation does (model/evaluate.cuh): mean loss, loss
// by position in the row and recall accuracy by gap, on rows of the training shape (data.batch_size x data.seq_len).
#include <cuda_profiler_api.h>
#include <sys/stat.h>

#include "core/config.h"
#include "data/dataloader.h"
#include "data/prompts.h"
#include "model/checkpoint.h"
#include "model/evaluate.cuh"
#include "model/generate.cuh"

typedef struct {
    const char *checkpoint;                           // the one positional argument
    const char *prompt, *prompt_file, *prompts_file;  // taken as given: a prompt may hold any byte
    const char *prompt_field;                         // --prompts F.jsonl: the member holding the prompt
    const char *eval, *eval_task, *out;               // eval_task is checked as the key eval.task of the config
    int max_new, top_k, batch, eval_batches, seed;    // numbers and switches: parsed by core/config.h (INFER_FLAGS)
    int fp32, no_graph, no_pdl, bench;
    double temperature, top_p;
} Options;

#define INFER_OFF(field) offsetof(Options, field)
// The numeric options and switches, parsed and range-checked like config keys (a switch takes no value).
static const CfgField INFER_FLAGS[] = {
    {"--max-new", CFG_INT, INFER_OFF(max_new), "256", 1, 1 << 24, NULL, "generate at most N tokens"},
    {"--temperature", CFG_FLOAT, INFER_OFF(temperature), "0.8", 0, 100, NULL, "0 = greedy"},
    {"--top-p", CFG_FLOAT, INFER_OFF(top_p), "", 1e-12, 1, NULL,
     "nucleus sampling, 0 < P <= 1 (takes precedence over --top-k)"},
    {"--top-k", CFG_INT, INFER_OFF(top_k), "", 1, 1 << 30, NULL, "sample among the K most probable tokens"},
    {"--seed", CFG_INT, INFER_OFF(seed), "1", 0, 2147483647, NULL,
     "sampling seed (the i-th prompt of --prompts uses S + i)"},
    {"--batch", CFG_INT, INFER_OFF(batch), "32", 1, 4096, NULL, "streams generating at once with --prompts"},
    {"--eval-batches", CFG_INT, INFER_OFF(eval_batches), "", 1, 2147483647, NULL,
     "--eval: batches of data.batch_size x data.seq_len rows (empty: all)"},
    {"--fp32", CFG_BOOL, INFER_OFF(fp32), "false", 1, 0, NULL,
     "all-fp32 mode (otherwise bf16, unless the model was trained in fp32)"},
    {"--no-graph", CFG_BOOL, INFER_OFF(no_graph), "false", 1, 0, NULL,
     "launch every decode kernel per token instead of replaying a CUDA graph"},
    {"--no-pdl", CFG_BOOL, INFER_OFF(no_pdl), "false", 1, 0, NULL,
     "no programmatic dependent launch (each kernel waits for the one before to finish before it starts)"},
    {"--bench", CFG_BOOL, INFER_OFF(bench), "false", 1, 0, NULL,
     "time prefill (one prompt of the whole context) and decode at batch 1, 8, 32"},
};
#define INFER_N_FLAGS ((int)(sizeof INFER_FLAGS / sizeof INFER_FLAGS[0]))

static void usage(FILE *f) {
    fprintf(f, "usage: infer_sdm CHECKPOINT [--prompt TEXT | --prompt-file F | --prompts F] [options]\n"
               "       infer_sdm CHECKPOINT --eval SHARDS [--eval-batches N] [--eval-task T] [--out DIR] [--fp32]\n"
               "  CHECKPOINT                         a model.bin, or a run folder (its newest complete checkpoint)\n"
               "  --prompt TEXT                      the prompt (default: empty, i.e. BOS alone)\n"
               "  --prompt-file F                    the prompt is the bytes of file F\n"
               "  --prompts F                        one prompt per line of F (empty lines skipped), in batches;\n"
               "                                     F.jsonl: one JSON object per line, the prompt its string member\n"
               "  --prompt-field NAME                --prompts F.jsonl: that member (default: prompt)\n"
               "  --eval SHARDS                      no generation: loss, loss by position and recall accuracy by\n"
               "                                     gap on the token shards SHARDS (globs separated by commas)\n"
               "  --eval-task T                      auto|recall|mqar|copy|none (default: the checkpoint's eval.task)\n"
               "  --out DIR                          --eval: also append the scores to DIR/eval_*.tsv\n");
    cfg_print_fields(f, INFER_FLAGS, INFER_N_FLAGS);
}

// The slot of a string option (taken as given), or NULL.
static const char **string_option(Options *o, const char *name) {
    if (!strcmp(name, "--prompt")) return &o->prompt;
    if (!strcmp(name, "--prompt-file")) return &o->prompt_file;
    if (!strcmp(name, "--prompts")) return &o->prompts_file;
    if (!strcmp(name, "--prompt-field")) return &o->prompt_field;
    if (!strcmp(name, "--eval")) return &o->eval;
    if (!strcmp(name, "--eval-task")) return &o->eval_task;
    if (!strcmp(name, "--out")) return &o->out;
    return NULL;
}

static Options parse_args(int argc, char **argv) {
    Options o;
    memset(&o, 0, sizeof o);
    char err[CFG_ERR], where[96];
    for (int k = 0; k < INFER_N_FLAGS; k++)
        if (INFER_FLAGS[k].def[0] && !cfg_set(&o, &INFER_FLAGS[k], INFER_FLAGS[k].def, err)) sdm_die("%s", err);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); exit(0); }
        if (a[0] != '-') {
            if (o.checkpoint) sdm_die("unexpected argument '%s' (the checkpoint is already '%s')", a, o.checkpoint);
            o.checkpoint = a;
            continue;
        }
        const CfgField *f = NULL;
        for (int k = 0; k < INFER_N_FLAGS && !f; k++)
            if (!strcmp(a, INFER_FLAGS[k].key)) f = &INFER_FLAGS[k];
        const char **slot = f ? NULL : string_option(&o, a);
        if (!f && !slot) sdm_die("unknown option '%s' (see --help)", a);
        if (f && f->type == CFG_BOOL) { cfg_set(&o, f, "true", err); continue; }
        if (i + 1 >= argc) sdm_die("%s needs a value (see --help)", a);
        const char *v = argv[++i];
        snprintf(where, sizeof where, "argument '%.40s %.40s'", a, v);
        if (slot) *slot = v;
        else if (!cfg_set(&o, f, v, err)) sdm_die("%s: %s", where, err);
    }
    if (!o.checkpoint) { usage(stderr); sdm_die("no CHECKPOINT given"); }
    if (!!o.prompt + !!o.prompt_file + !!o.prompts_file > 1)
        sdm_die("give one of --prompt, --prompt-file and --prompts, not several");
    if (o.eval && (o.prompt || o.prompt_file || o.prompts_file || o.bench))
        sdm_die("--eval scores shards: it takes no prompt and no --bench");
    if (!o.eval && (o.eval_batches || o.eval_task || o.out))
        sdm_die("--eval-batches, --eval-task and --out need --eval");
    if (o.prompt_field && !(o.prompts_file && prompts_is_jsonl(o.prompts_file)))
        sdm_die("--prompt-field names the member of a --prompts file ending in .jsonl");
    if (!o.prompt_field) o.prompt_field = "prompt";
    return o;
}

// A run folder's newest complete checkpoint, or the path itself (a model.bin).
static void resolve_checkpoint(const char *arg, char *path, size_t size) {
    struct stat sb;
    if (stat(arg, &sb) != 0) sdm_die("%s: no such file or folder", arg);
    if (!S_ISDIR(sb.st_mode)) { snprintf(path, size, "%s", arg); return; }
    uint64_t step = 0;
    if (!ckpt_newest(arg, &step))
        sdm_die("%s: no complete checkpoint (step_<8 digits>/ with DONE, model.bin, state.bin) in this folder", arg);
    char dir[1024];
    ckpt_step_dir(dir, sizeof dir, arg, step, "");
    snprintf(path, size, "%s/model.bin", dir);
}

// The bytes of file `path` (malloc'ed, named by `flag` in errors) and their count.
static uint8_t *read_file(const char *path, const char *flag, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) sdm_die("%s %s: cannot open: %s", flag, path, strerror(errno));
    size_t cap = 4096, len = 0, got;
    uint8_t *b = (uint8_t *)sdm_malloc(cap);
    while ((got = fread(b + len, 1, cap - len, f)) > 0)
        if ((len += got) == cap) {
            uint8_t *grown = (uint8_t *)realloc(b, cap *= 2);
            if (!grown) sdm_die("%s %s: out of memory after %zu bytes", flag, path, len);
            b = grown;
        }
    if (ferror(f)) sdm_die("%s %s: read error", flag, path);
    fclose(f);
    *n = len;
    return b;
}

// The prompts (malloc'ed; prompts_free): those of the --prompts file (data/prompts.h), or the one of --prompt or
// --prompt-file (empty: BOS alone). Returns their count; a bad file stops the program with its line and reason.
static int read_prompts(const Options *o, Prompt **out) {
    size_t n = 0;
    uint8_t *text = NULL;
    if (o->prompts_file) text = read_file(o->prompts_file, "--prompts", &n);
    else if (o->prompt_file) text = read_file(o->prompt_file, "--prompt-file", &n);
    if (o->prompts_file) {
        char err[DATA_ERR_LEN];
        int count = prompts_split(text, n, prompts_is_jsonl(o->prompts_file), o->prompt_field, o->prompts_file, out,
                                  err);
        if (count < 0) sdm_die("--prompts %s", err);
        free(text);
        return count;
    }
    *out = (Prompt *)sdm_malloc(sizeof(Prompt));
    if (!text) { // --prompt TEXT, or none
        const char *p = o->prompt ? o->prompt : "";
        n = strlen(p);
        text = (uint8_t *)sdm_malloc(n ? n : 1);
        memcpy(text, p, n);
    }
    (*out)[0].bytes = text;
    (*out)[0].n = n;
    return 1;
}

// The requests of prompts[count], each as tokens of at most max_tokens (gen_prompt_tokens) with room for max_new
// outputs; everything is malloc'ed.
static GenRequest *make_requests(const Prompt *prompts, int count, int max_tokens, int max_new) {
    GenRequest *req = (GenRequest *)sdm_calloc((size_t)count, sizeof(GenRequest));
    for (int i = 0; i < count; i++) {
        GenRequest *r = &req[i];
        int *tokens = (int *)sdm_malloc(sizeof(int) * (size_t)max_tokens);
        r->P = gen_prompt_tokens(prompts[i].bytes, prompts[i].n, max_tokens, tokens);
        r->prompt = tokens;
        r->max_new = max_new;
        r->out = (int *)sdm_malloc(sizeof(int) * (size_t)max_new);
        if ((size_t)r->P < prompts[i].n + 1)
            printf("prompt %d: cut from %zu to its last %d tokens\n", i, prompts[i].n + 1, r->P);
    }
    return req;
}

#define BENCH_PROMPT 16 // tokens prefilled into each stream (the same prompt, its own seed) before decoding
#define BENCH_REPS 3    // timed prefills after a warm-up

// Kernels in a decode step of B streams: the step captured once more into a graph of its own and its kernel nodes
// counted (the dependent kernels a step runs in a chain: at batch 1 each costs ~2.3 us even when it moves few bytes).
static size_t bench_step_kernels(GpuInferState *I, int B) {
    cudaGraph_t graph = gpu_infer_capture_decode(I, B);
    size_t n = 0, kernels = 0;
    cudaCheck(cudaGraphGetNodes(graph, NULL, &n));
    cudaGraphNode_t *nodes = (cudaGraphNode_t *)sdm_malloc(n * sizeof *nodes);
    cudaCheck(cudaGraphGetNodes(graph, nodes, &n));
    for (size_t i = 0; i < n; i++) {
        cudaGraphNodeType type;
        cudaCheck(cudaGraphNodeGetType(nodes[i], &type));
        kernels += type == cudaGraphNodeTypeKernel;
    }
    free(nodes);
    cudaCheck(cudaGraphDestroy(graph));
    return kernels;
}

// --bench: a prefill of one prompt of the whole context, then decode steps of 1, 8 and 32 streams (sampling on the
// device, the graph unless use_graph is 0, a step ahead as generation runs them), on random bytes. Prints tokens/s
// and ms per token (per step), the rate at which a step reads the weights against hbm_tbps (TB/s,
// logging.hbm_tbps), and the same steps one at a time.
static void bench(GpuInferState *I, int context, int max_new, const SamplingParams *sp, uint64_t seed,
                  int use_graph, double hbm_tbps) {
    Rng r = rng_make(seed);
    int *prompt = (int *)sdm_malloc(sizeof(int) * (size_t)context);
    prompt[0] = TOK_BOS;
    for (int i = 1; i < context; i++) prompt[i] = (int)rng_below(&r, 256);
    double best = 1e30;
    for (int rep = 0; rep <= BENCH_REPS; rep++) { // rep 0 warms up (module loading, cuBLASLt heuristics)
        gpu_infer_reset(I, 0);
        if (rep == 1) cudaCheck(cudaProfilerStart()); // a profiler started with --profile-from-start off sees one
        double t0 = sdm_now_s();                          // prefill, then the decode steps
        gpu_infer_prefill_device(I, 0, prompt, context); // ends by synchronising
        if (rep > 0) best = SDM_MIN(best, sdm_now_s() - t0);
        if (rep == 1) cudaCheck(cudaProfilerStop());
    }
    printf("prefill: %d tokens in %.2f ms = %.0f tokens/s (best of %d)\n", context, 1e3 * best, context / best,
           BENCH_REPS);
    // the weights a step reads whatever its batch, its floor at the bus: the matrices every token is multiplied by
    // (not the banks M0, of which a step reads a few rows, nor the token embedding's lookup)
    const double wbytes = (double)model_matmul_params(I->g->m) * I->g->es;
    printf("decode reads %.3f GB of weights a step: %.1f us at %.2f TB/s\n", wbytes / 1e9, wbytes / (hbm_tbps * 1e6),
           hbm_tbps);
    gpu_infer_set_sampling(I, sp);
    int steps = SDM_MIN(max_new, context - BENCH_PROMPT);
    const int batches[] = {1, 8, 32};
    for (int k = 0; k < 3 && batches[k] <= I->streams && steps > 1; k++) {
        int B = batches[k];
        for (int b = 0; b < B; b++) {
            gpu_infer_reset(I, b);
            gpu_infer_seed(I, b, seed + (uint64_t)b);
            gpu_infer_prefill_device(I, b, prompt, BENCH_PROMPT);
            gpu_infer_sample(I, b);
        }
        gpu_infer_step(I, B, use_graph); // warm-up: captures the graph of B streams
        cudaCheck(cudaProfilerStart());
        double t0 = sdm_now_s();
        gpu_infer_steps_ahead(I, B, use_graph, steps - 1); // as generation runs them: a step ahead
        double step_s = (sdm_now_s() - t0) / (steps - 1);
        cudaCheck(cudaProfilerStop());
        printf("decode batch %2d: %d steps, %.3f ms/token, %.0f tokens/s (%s), weights at %.2f TB/s (%.0f%%), %zu "
               "kernels a step\n", B, steps - 1, 1e3 * step_s, B / step_s, use_graph ? "CUDA graph" : "eager",
               wbytes / step_s / 1e12, 100 * wbytes / step_s / (hbm_tbps * 1e12), bench_step_kernels(I, B));
        // the same steps one at a time, each waited for before the next is launched: what the step ahead hides. The
        // positions go back to where the steps above started, so that attention spans the same lengths (the caches'
        // contents do not change the time).
        for (int b = 0; b < B; b++) gpu_infer_set_pos(I, b, BENCH_PROMPT + 1);
        t0 = sdm_now_s();
        for (int i = 1; i < steps; i++) gpu_infer_step(I, B, use_graph);
        double alone_s = (sdm_now_s() - t0) / (steps - 1);
        printf("decode batch %2d one step at a time: %.3f ms/step, the host's wait and launch %.1f us a step\n", B,
               1e3 * alone_s, 1e6 * (alone_s - step_s));
    }
    free(prompt);
}

// --eval: the checkpoint's scores on the shards o->eval, over rows of its training shape (model/evaluate.cuh).
static void eval_shards(const Options *o, const Config *cfg, const ModelDesc *m, const float *params, Dtype dt,
                        uint64_t step) {
    int B = cfg->batch_size, T = cfg->seq_len;
    DataLoader dl;
    char err[DATA_ERR_LEN];
    if (dataloader_open(&dl, o->eval, B, T, 0, 1, (uint64_t)cfg->seed, 0, (uint32_t)m->vocab, err))
        sdm_die("--eval: %s", err);
    int batches = (int)dataloader_batches_per_epoch(&dl);
    if (o->eval_batches) batches = SDM_MIN(batches, o->eval_batches);
    if (batches < 1) sdm_die("--eval %s: fewer tokens than one batch of %d x %d", o->eval, B, T + 1);
    GpuModel g;
    gpu_model_create(&g, m, B, T, dt, 1, 0, NULL);
    gpu_model_set_params(&g, params);
    int32_t *rows = (int32_t *)sdm_malloc(sizeof(int32_t) * B * (T + 1));
    int *inputs = (int *)sdm_malloc(sizeof(int) * B * T), *targets = (int *)sdm_malloc(sizeof(int) * B * T);
    EvalStats s;
    eval_stats_init(&s, cfg->eval_task, T);
    for (int k = 0; k < batches; k++) {
        if (dataloader_next_batch(&dl, rows, err)) sdm_die("--eval: %s", err);
        eval_batch(&g, rows, inputs, targets, &s);
    }
    printf("eval step %llu | val loss %.4f over %d batches of %d x %d tokens\n", (unsigned long long)step,
           eval_mean_loss(&s), batches, B, T);
    eval_report(&s, (long long)step, o->out, NULL);
    free(rows);
    free(inputs);
    free(targets);
    gpu_model_destroy(&g);
    dataloader_close(&dl);
}

int main(int argc, char **argv) {
    // 1. options, the prompts, and the checkpoint: its config rebuilds the model description; its parameters are
    //    fp32
    Options o = parse_args(argc, argv);
    Prompt *prompts = NULL;
    int count = o.eval ? 0 : read_prompts(&o, &prompts);
    char path[1200], err[CKPT_ERR];
    resolve_checkpoint(o.checkpoint, path, sizeof path);
    Config cfg;
    ModelDesc *m = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    float *params = NULL;
    uint64_t step;
    if (!ckpt_load_model(path, &cfg, m, &params, &step, err)) sdm_die("%s", err);
    if (m->vocab < TOK_BYTES_VOCAB)
        sdm_die("%s: the model's vocabulary (%d) is smaller than the bytes tokenizer's %d", path, m->vocab,
                TOK_BYTES_VOCAB);
    int fp32 = o.fp32 || !strcmp(cfg.model_dtype, "fp32");
    if (fp32 && strcmp(cfg.model_dtype, "fp32")) { // all-fp32 mode keeps the SDM bank in fp32 too
        if (!cfg_apply_line(&cfg, "distributed.model_dtype = fp32", "--fp32", err)) sdm_die("%s", err);
        model_build(m, &cfg);
    }
    printf("checkpoint: %s (step %llu), %lld parameters, %s\n", path, (unsigned long long)step, m->storage,
           fp32 ? "all-fp32" : "bf16");
    if (o.eval) {
        char line[CFG_STR + 32];
        snprintf(line, sizeof line, "eval.task = %s", o.eval_task ? o.eval_task : cfg.eval_task);
        if (!cfg_apply_line(&cfg, line, "--eval-task", err)) sdm_die("%s", err);
        cuda_require_gpu();
        eval_shards(&o, &cfg, m, params, fp32 ? DT_FP32 : DT_BF16, step);
        free(params);
        free(m);
        return 0;
    }
    int context = cfg.seq_len;
    if (o.max_new >= context)
        sdm_die("--max-new %d leaves no room for a prompt in the model's context of %d tokens (data.seq_len)",
                o.max_new, context);

    cuda_require_gpu();
    g_pdl = !o.no_pdl;
    // 2. the prompts (BOS + bytes, cut from the left to context - max_new tokens), the model on the GPU and an
    //    inference state of one stream per prompt (at most --batch; 32 for --bench) sized for the context
    GenRequest *req = make_requests(prompts, count, context - o.max_new, o.max_new);
    prompts_free(prompts, count);
    GpuModel g;
    gpu_model_create(&g, m, 1, 1, fp32 ? DT_FP32 : DT_BF16, 1, 0, NULL);
    gpu_model_set_params(&g, params);
    free(params);
    GpuInferState st;
    gpu_infer_create(&st, &g, o.bench ? 32 : SDM_MIN(o.batch, count), context);

    // 3. generate and print, or time
    SamplingParams sp = {o.temperature, o.top_p, o.top_k};
    if (o.bench) {
        bench(&st, context, o.max_new, &sp, (uint64_t)o.seed, !o.no_graph, cfg.hbm_tbps);
    } else {
        GenStats gs = gen_batch(&st, req, count, &sp, o.seed, !o.no_graph, 1, stdout); // prints as it goes
        printf("%d tokens from %d prompts (%d stopped at EOS); prefill %lld tokens in %.1f ms (%.0f tokens/s); "
               "decode %d steps, %lld tokens at %.1f tokens/s (%.3f ms/step)\n", gs.n_new, count, gs.n_eos,
               gs.n_prefill, 1e3 * gs.prefill_s, gs.n_prefill / gs.prefill_s, gs.n_steps, gs.n_decoded,
               gs.n_steps ? gs.n_decoded / gs.decode_s : 0.0, gs.n_steps ? 1e3 * gs.decode_s / gs.n_steps : 0.0);
    }

    for (int i = 0; i < count; i++) {
        free((void *)req[i].prompt);
        free(req[i].out);
    }
    free(req);
    gpu_infer_destroy(&st);
    gpu_model_destroy(&g);
    free(m);
    return 0;
}
