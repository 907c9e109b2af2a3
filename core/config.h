// core/config.h: the run configuration. One descriptor table (key, type, default, range, help) drives parsing of
// `key = value` .cfg files and command-line overrides, validation, --help, and the resolved-config dump.
//
// Format: one `key = value` per line, `#` starts a comment, lists are comma separated (`3,7,11`), layer lists are
// also `all` or empty; a key at most once per file, string values without control characters or `#` (so the dump
// loads back). cfg_load_file reads a file, cfg_parse_text a text in memory (checkpoints, tests). Errors name
// file:line (or the command-line argument) and the key.
#ifndef SDM_CORE_CONFIG_H
#define SDM_CORE_CONFIG_H

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/common.h"
#include "core/file.h"

#define CFG_MAX_LAYERS 256
#define CFG_MAX_LIST 8
#define CFG_STR 256
#define CFG_ERR 512
#define CFG_LINE 4096          // longest setting (a line without its comment)
#define CFG_MAX_FILE (1 << 20) // a config file is at most this many bytes

// A layer list: `all`, empty, or indices. all = 1 means every layer.
typedef struct { int all; int n; int idx[CFG_MAX_LAYERS]; } LayerList;
// A short list of numbers (product-key factor widths, the A_log init range).
typedef struct { int n; double v[CFG_MAX_LIST]; } NumList;

typedef struct {
    // run
    char name[CFG_STR];
    char run_dir[CFG_STR];
    int steps, seed, probe_freq;
    // optim (docs/MODEL.md#optimizer)
    double lr, lr_min_ratio, clip, weight_decay, beta1, beta2, adam_eps;
    int warmup, grad_acc_steps;
    char scheduler[CFG_STR], moment_dtype[CFG_STR];
    // distributed / precision (docs/MODEL.md#precision)
    char model_dtype[CFG_STR];
    char fsdp_type[CFG_STR];
    int matmul_allow_tf32, selective_act_ckpt, recompute_ffn, compile, tp_size, dist_timeout;
    // model (docs/MODEL.md#config-keys)
    int dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, multiple_of, weight_tying;
    double rope_theta, norm_eps, ffn_dim_multiplier, init_base_std;
    char init_std_factor[CFG_STR];
    int attn_gate, full_attn_gate;
    LayerList attn_at, swa_at, sdm_at;
    int swa_window, swa_n_heads, swa_n_kv_heads, swa_head_dim;
    // sdm (docs/SDM.md#hyper-parameters)
    int sdm_heads, sdm_slots, sdm_writes, sdm_reads, sdm_chunk;
    NumList sdm_factors;
    char write_act[CFG_STR], read_act[CFG_STR];
    double write_act_scale, read_act_scale, sdm_norm_eps;
    NumList A_init_range;
    int key_weighted_decay, backprop_on_memory, normalize_readings, output_gate, cuda_graph;
    char snapshot_quant[CFG_STR], bank_dtype[CFG_STR], grad_bank_dtype[CFG_STR];
    // data (docs/MODEL.md#top-level)
    int batch_size, seq_len, n_views;
    char tokenizer[CFG_STR], train_data[CFG_STR], val_data[CFG_STR];
    // checkpoint / eval / logging
    int dump_every, eval_every, keep_checkpoints, eval_steps, log_freq, profile_steps;
    double peak_tflops, hbm_tbps;
    char eval_task[CFG_STR];
} Config;

typedef enum { CFG_INT, CFG_FLOAT, CFG_BOOL, CFG_STRING, CFG_CHOICE, CFG_LAYERS, CFG_NUMS } CfgType;

typedef struct {
    const char *key;
    CfgType type;
    size_t offset;
    const char *def;     // default, in the file syntax
    double lo, hi;       // inclusive range for numbers (lo > hi: unbounded)
    const char *choices; // CFG_CHOICE: values separated by '|'
    const char *help;
} CfgField;

// AdamW divides by sqrt(v) + eps: eps = 0 makes 0/0 for every zero gradient, and below 1e-12 a gradient whose fp32
// square underflows (|g| < 1e-19) would step by g/eps, far beyond the learning rate.
#define CFG_MIN_ADAM_EPS 1e-12
#define CFG_OFF(f) offsetof(Config, f)
#define CFG_ANY 1, 0
static const CfgField CFG_FIELDS[] = {
    {"name", CFG_STRING, CFG_OFF(name), "sdm", CFG_ANY, NULL, "run name"},
    {"run_dir", CFG_STRING, CFG_OFF(run_dir), "runs/sdm", CFG_ANY, NULL, "folder for logs and checkpoints"},
    {"steps", CFG_INT, CFG_OFF(steps), "1000", 1, 1e9, NULL, "optimizer steps"},
    {"seed", CFG_INT, CFG_OFF(seed), "777", 0, 2147483647, NULL, "seed of init, data order and sampling"},
    {"probe_freq", CFG_INT, CFG_OFF(probe_freq), "0", 0, 1e9, NULL, "steps between recall probes (0: off)"},

    {"optim.lr", CFG_FLOAT, CFG_OFF(lr), "3e-4", 0, 10, NULL, "peak learning rate"},
    {"optim.warmup", CFG_INT, CFG_OFF(warmup), "200", 0, 1e9, NULL, "linear warmup steps"},
    {"optim.scheduler", CFG_CHOICE, CFG_OFF(scheduler), "cosine", CFG_ANY, "cosine|constant|linear",
     "learning-rate schedule after warmup"},
    {"optim.lr_min_ratio", CFG_FLOAT, CFG_OFF(lr_min_ratio), "1e-6", 0, 1, NULL, "final lr / peak lr"},
    {"optim.clip", CFG_FLOAT, CFG_OFF(clip), "1.0", 0, 1e9, NULL, "global gradient-norm clip (0: off)"},
    {"optim.weight_decay", CFG_FLOAT, CFG_OFF(weight_decay), "0.1", 0, 10, NULL, "AdamW decoupled weight decay"},
    {"optim.beta1", CFG_FLOAT, CFG_OFF(beta1), "0.9", 0, 0.999999, NULL, "AdamW beta1"},
    {"optim.beta2", CFG_FLOAT, CFG_OFF(beta2), "0.95", 0, 0.999999, NULL, "AdamW beta2"},
    {"optim.eps", CFG_FLOAT, CFG_OFF(adam_eps), "1e-8", CFG_MIN_ADAM_EPS, 1, NULL, "AdamW epsilon"},
    {"optim.grad_acc_steps", CFG_INT, CFG_OFF(grad_acc_steps), "1", 1, 1024, NULL, "micro-batches per step"},
    {"optim.moment_dtype", CFG_CHOICE, CFG_OFF(moment_dtype), "fp32", CFG_ANY, "fp32|bf16",
     "storage of AdamW m, v (bf16: half the memory, rounded to nearest even; checkpoints hold fp32 either way)"},

    {"distributed.model_dtype", CFG_CHOICE, CFG_OFF(model_dtype), "bf16", CFG_ANY, "bf16|fp32",
     "compute dtype of weights and activations (fp32: exact comparison mode)"},
    {"distributed.fsdp_type", CFG_CHOICE, CFG_OFF(fsdp_type), "full_shard", CFG_ANY, "full_shard|no_shard",
     "full_shard: gradients and optimizer state sharded over ranks (ZeRO-2); no_shard: gradients whole (ZeRO-1)"},
    {"distributed.matmul_allow_tf32", CFG_BOOL, CFG_OFF(matmul_allow_tf32), "false", 0, 0, NULL,
     "allow TF32 in fp32 matmuls (refused: sdm.c never uses TF32)"},
    {"distributed.selective_act_ckpt", CFG_BOOL, CFG_OFF(selective_act_ckpt), "false", CFG_ANY, NULL,
     "recompute cheap activations in the backward (memory knob, same results)"},
    {"distributed.recompute_ffn", CFG_BOOL, CFG_OFF(recompute_ffn), "false", CFG_ANY, NULL,
     "also recompute the FFN's W1|W3 product in the backward: one layer's [n, 2F] kept instead of every layer's, "
     "for one more GEMM per layer (memory knob, same results)"},
    {"distributed.compile", CFG_BOOL, CFG_OFF(compile), "false", CFG_ANY, NULL,
     "capture the training step in a CUDA graph after its first step and replay it (speed knob, same results; one "
     "GPU: eager with several ranks)"},
    {"distributed.tp_size", CFG_INT, CFG_OFF(tp_size), "1", 1, 1, NULL, "tensor parallelism (refused: must be 1)"},
    {"distributed.timeout", CFG_INT, CFG_OFF(dist_timeout), "1800", 0, 1e7, NULL,
     "seconds a rank may go without reaching its next collective (waiting on a dead or hung peer) before it aborts "
     "NCCL and exits 1; longer than any wait on rank 0's checkpoint reading or writing (0: only NCCL's own errors "
     "end the run; several ranks only)"},

    {"model.dim", CFG_INT, CFG_OFF(dim), "1024", 8, 65536, NULL, "model width D"},
    {"model.n_layers", CFG_INT, CFG_OFF(n_layers), "8", 1, CFG_MAX_LAYERS, NULL, "number of blocks"},
    {"model.n_heads", CFG_INT, CFG_OFF(n_heads), "8", 1, 1024, NULL, "full-attention query heads"},
    {"model.n_kv_heads", CFG_INT, CFG_OFF(n_kv_heads), "0", 0, 1024, NULL,
     "full-attention kv heads (0: n_heads)"},
    {"model.head_dim", CFG_INT, CFG_OFF(head_dim), "0", 0, 1024, NULL, "full-attention head dim (0: dim/n_heads)"},
    {"model.vocab_size", CFG_INT, CFG_OFF(vocab_size), "258", 2, 1 << 30, NULL, "vocabulary (bytes: 258)"},
    {"model.multiple_of", CFG_INT, CFG_OFF(multiple_of), "256", 1, 65536, NULL, "FFN hidden rounded up to this"},
    {"model.ffn_dim_multiplier", CFG_FLOAT, CFG_OFF(ffn_dim_multiplier), "0", 0, 64, NULL,
     "FFN hidden multiplier (0: none)"},
    {"model.weight_tying", CFG_BOOL, CFG_OFF(weight_tying), "false", CFG_ANY, NULL,
     "LM head reuses the token embedding"},
    {"model.rope_theta", CFG_FLOAT, CFG_OFF(rope_theta), "10000", 1, 1e12, NULL, "RoPE base"},
    {"model.norm_eps", CFG_FLOAT, CFG_OFF(norm_eps), "1e-5", 0, 1, NULL, "RMSNorm epsilon"},
    {"model.init_base_std", CFG_FLOAT, CFG_OFF(init_base_std), "0", 0, 10, NULL, "init std (0: dim^-1/2)"},
    {"model.init_std_factor", CFG_CHOICE, CFG_OFF(init_std_factor), "disabled", CFG_ANY,
     "disabled|global_depth|current_depth|dim_ratio", "depth scaling of output-projection init"},
    {"model.attn_gate", CFG_BOOL, CFG_OFF(attn_gate), "false", CFG_ANY, NULL,
     "sigmoid output gate on every attention layer"},
    {"model.full_attn_gate", CFG_BOOL, CFG_OFF(full_attn_gate), "false", CFG_ANY, NULL,
     "sigmoid output gate on full-attention layers"},
    {"model.attn_at", CFG_LAYERS, CFG_OFF(attn_at), "", CFG_ANY, NULL, "full-attention layers: all, or indices"},
    {"model.swa_at", CFG_LAYERS, CFG_OFF(swa_at), "", CFG_ANY, NULL, "sliding-window layers: all, or indices"},
    {"model.sdm_at", CFG_LAYERS, CFG_OFF(sdm_at), "", CFG_ANY, NULL, "SDM layers: all, or indices"},
    {"model.swa_window", CFG_INT, CFG_OFF(swa_window), "0", 0, 1 << 30, NULL,
     "SWA window w: the query and its w-1 predecessors"},
    {"model.swa_n_heads", CFG_INT, CFG_OFF(swa_n_heads), "0", 0, 1024, NULL, "SWA query heads (0: n_heads)"},
    {"model.swa_n_kv_heads", CFG_INT, CFG_OFF(swa_n_kv_heads), "0", 0, 1024, NULL,
     "SWA kv heads (0: swa_n_heads if set, else n_kv_heads)"},
    {"model.swa_head_dim", CFG_INT, CFG_OFF(swa_head_dim), "0", 0, 1024, NULL, "SWA head dim (0: dim/heads)"},

    {"sdm.num_heads", CFG_INT, CFG_OFF(sdm_heads), "1", 1, 64, NULL, "SDM heads H (d = dim/H)"},
    {"sdm.slots_per_head", CFG_INT, CFG_OFF(sdm_slots), "0", 0, 1 << 30, NULL,
     "slots N per head (required with SDM layers)"},
    {"sdm.product_key_factor_dims", CFG_NUMS, CFG_OFF(sdm_factors), "", CFG_ANY, NULL,
     "product-key factor widths, product = N (empty: two of sqrt N)"},
    {"sdm.num_writes", CFG_INT, CFG_OFF(sdm_writes), "64", 1, 4096, NULL, "slots W written per token and head"},
    {"sdm.num_reads", CFG_INT, CFG_OFF(sdm_reads), "64", 1, 4096, NULL, "slots R read per token and head"},
    {"sdm.chunk_size", CFG_INT, CFG_OFF(sdm_chunk), "64", 1, 1024, NULL, "chunk length C (speed knob)"},
    {"sdm.write_act", CFG_CHOICE, CFG_OFF(write_act), "softmax", CFG_ANY, "softmax|l2_normalize|identity|sigmoid",
     "write weight activation"},
    {"sdm.read_act", CFG_CHOICE, CFG_OFF(read_act), "softmax", CFG_ANY, "softmax|l2_normalize|identity|sigmoid",
     "read weight activation"},
    {"sdm.write_act_scale", CFG_FLOAT, CFG_OFF(write_act_scale), "1.0", 0, 1e6, NULL, "write softmax temperature"},
    {"sdm.read_act_scale", CFG_FLOAT, CFG_OFF(read_act_scale), "1.0", 0, 1e6, NULL, "read softmax temperature"},
    {"sdm.key_weighted_decay", CFG_BOOL, CFG_OFF(key_weighted_decay), "false", CFG_ANY, NULL,
     "per-write decay exp(g * kappa)"},
    {"sdm.backprop_on_memory", CFG_BOOL, CFG_OFF(backprop_on_memory), "true", CFG_ANY, NULL,
     "learned initial bank M0 (else zeros)"},
    {"sdm.normalize_readings", CFG_BOOL, CFG_OFF(normalize_readings), "false", CFG_ANY, NULL,
     "per-head LayerNorm on the readings"},
    {"sdm.norm_eps", CFG_FLOAT, CFG_OFF(sdm_norm_eps), "1e-6", 0, 1, NULL, "epsilon of the readings LayerNorm"},
    {"sdm.output_gate", CFG_BOOL, CFG_OFF(output_gate), "false", CFG_ANY, NULL, "sigmoid gate on the readings"},
    {"sdm.A_init_range", CFG_NUMS, CFG_OFF(A_init_range), "0,16", CFG_ANY, NULL, "U(lo,hi) range of A at init"},
    {"sdm.snapshot_quant", CFG_CHOICE, CFG_OFF(snapshot_quant), "none", CFG_ANY, "none|bf16|fp8|int4",
     "storage of backward snapshots of touched bank rows"},
    {"sdm.bank_dtype", CFG_CHOICE, CFG_OFF(bank_dtype), "bf16", CFG_ANY, "bf16|fp32",
     "dtype of the bank copy (always fp32 when model_dtype is fp32)"},
    {"sdm.grad_bank_dtype", CFG_CHOICE, CFG_OFF(grad_bank_dtype), "fp32", CFG_ANY, "fp32|bf16",
     "dtype of the bank gradient between backward chunks (bf16 halves its bytes; fp32 when model_dtype is fp32)"},
    {"sdm.cuda_graph", CFG_BOOL, CFG_OFF(cuda_graph), "true", CFG_ANY, NULL,
     "replay the SDM op from CUDA graphs (speed knob; done by distributed.compile, which captures the whole step)"},

    {"data.batch_size", CFG_INT, CFG_OFF(batch_size), "8", 1, 1 << 20, NULL, "sequences B per micro-batch per GPU"},
    {"data.seq_len", CFG_INT, CFG_OFF(seq_len), "2048", 1, 1 << 24, NULL, "tokens T per sequence"},
    {"data.n_views", CFG_INT, CFG_OFF(n_views), "2", 2, 2, NULL, "input/target views (must be 2)"},
    {"data.tokenizer", CFG_CHOICE, CFG_OFF(tokenizer), "bytes", CFG_ANY, "bytes", "tokenizer"},
    {"data.train", CFG_STRING, CFG_OFF(train_data), "", CFG_ANY, NULL,
     "training shards (glob; empty: the embedded recall dataset)"},
    {"data.val", CFG_STRING, CFG_OFF(val_data), "", CFG_ANY, NULL, "validation shards (glob; empty: embedded)"},

    {"checkpoint.dump_every", CFG_INT, CFG_OFF(dump_every), "500", 0, 1e9, NULL,
     "steps between checkpoints, and one at the end (0: none)"},
    {"checkpoint.eval_every", CFG_INT, CFG_OFF(eval_every), "500", 0, 1e9, NULL, "steps between evaluations"},
    {"checkpoint.keep", CFG_INT, CFG_OFF(keep_checkpoints), "2", 1, 1000, NULL, "checkpoints kept"},
    {"eval.steps", CFG_INT, CFG_OFF(eval_steps), "20", 1, 1e9, NULL, "validation batches per evaluation"},
    {"eval.task", CFG_CHOICE, CFG_OFF(eval_task), "auto", CFG_ANY, "auto|recall|mqar|copy|none",
     "recall scoring of validation batches (data/synthetic.h; auto: every task whose answers are found)"},
    {"logging.freq", CFG_INT, CFG_OFF(log_freq), "10", 1, 1e9, NULL, "steps between log lines"},
    {"logging.profile", CFG_INT, CFG_OFF(profile_steps), "0", 0, 1e6, NULL,
     "time this many steps by part after 2 warm-up steps and print the table (0: off; same results)"},
    {"logging.peak_tflops", CFG_FLOAT, CFG_OFF(peak_tflops), "989", 1e-3, 1e9, NULL,
     "peak TFLOP/s per GPU for MFU and the profile's floors (default: dense bf16 of the H100/H200)"},
    {"logging.hbm_tbps", CFG_FLOAT, CFG_OFF(hbm_tbps), "4.8", 1e-3, 1e6, NULL,
     "HBM bandwidth in TB/s for the profile's floors (default: the H200's)"},
};
#undef CFG_ANY
#define CFG_N_FIELDS ((int)(sizeof(CFG_FIELDS) / sizeof(CFG_FIELDS[0])))

static inline const CfgField *cfg_find(const char *key) {
    for (int i = 0; i < CFG_N_FIELDS; i++)
        if (strcmp(CFG_FIELDS[i].key, key) == 0) return &CFG_FIELDS[i];
    return NULL;
}

static inline char *cfg_trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
    return s;
}

// strtod/strtol that reject empty strings, trailing garbage and out-of-range values
static inline int cfg_parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *cfg_trim(end) != 0 || errno == ERANGE || !isfinite(v)) return 0;
    *out = v;
    return 1;
}

static inline int cfg_parse_int(const char *s, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *cfg_trim(end) != 0 || errno == ERANGE) return 0;
    *out = v;
    return 1;
}

static inline int cfg_in_range(const CfgField *f, double v) { return f->lo > f->hi || (v >= f->lo && v <= f->hi); }

// Parse a comma-separated list of numbers into out[0..max); returns the count or -1 on a bad entry.
static inline int cfg_parse_numbers(const char *value, double *out, int max, char *err) {
    char buf[CFG_LINE];
    snprintf(buf, sizeof buf, "%s", value);
    if (*cfg_trim(buf) == 0) return 0;
    int n = 0;
    for (char *tok = buf; tok; n++) { // split on commas by hand: strtok would clobber a caller's strtok
        char *comma = strchr(tok, ',');
        if (comma) *comma = 0;
        char *t = cfg_trim(tok);
        if (n == max) { snprintf(err, CFG_ERR, "more than %d entries", max); return -1; }
        if (!cfg_parse_double(t, &out[n])) { snprintf(err, CFG_ERR, "'%.100s' is not a number", t); return -1; }
        tok = comma ? comma + 1 : NULL;
    }
    return n;
}

// Set field f of the struct at obj (a Config, or any struct a CfgField table describes, such as infer_sdm's options)
// from its text value; on error write a message (without location) to err and return 0.
static inline int cfg_set(void *obj, const CfgField *f, const char *value, char *err) {
    char *base = (char *)obj + f->offset;
    double d;
    long long i;
    switch (f->type) {
    case CFG_INT:
        if (!cfg_parse_int(value, &i)) { snprintf(err, CFG_ERR, "'%s' is not an integer", value); return 0; }
        if (!cfg_in_range(f, (double)i)) {
            snprintf(err, CFG_ERR, "%lld is out of range [%g, %g]", i, f->lo, f->hi);
            return 0;
        }
        *(int *)base = (int)i;
        return 1;
    case CFG_FLOAT:
        if (!cfg_parse_double(value, &d)) { snprintf(err, CFG_ERR, "'%s' is not a number", value); return 0; }
        if (!cfg_in_range(f, d)) { snprintf(err, CFG_ERR, "%g is out of range [%g, %g]", d, f->lo, f->hi); return 0; }
        *(double *)base = d;
        return 1;
    case CFG_BOOL: {
        int b = !strcmp(value, "true") || !strcmp(value, "1");
        if (!b && strcmp(value, "false") && strcmp(value, "0")) {
            snprintf(err, CFG_ERR, "'%s' is not a boolean (true/false)", value);
            return 0;
        }
        if (!cfg_in_range(f, b)) { snprintf(err, CFG_ERR, "%s is not supported (%s)", value, f->help); return 0; }
        *(int *)base = b;
        return 1;
    }
    case CFG_STRING:
        if (strlen(value) >= CFG_STR) {
            snprintf(err, CFG_ERR, "value longer than %d characters", CFG_STR - 1);
            return 0;
        }
        for (const char *q = value; *q; q++)  // the dump must load back: no line break, no comment start
            if (iscntrl((unsigned char)*q) || *q == '#') {
                snprintf(err, CFG_ERR, "a control character or '#' at position %d of the value", (int)(q - value));
                return 0;
            }
        strcpy(base, value);
        return 1;
    case CFG_CHOICE: {
        size_t n = strlen(value);
        for (const char *p = f->choices; *p;) {
            const char *bar = strchr(p, '|');
            size_t len = bar ? (size_t)(bar - p) : strlen(p);
            if (len == n && strncmp(p, value, n) == 0) { strcpy(base, value); return 1; }
            p += len + (bar ? 1 : 0);
        }
        snprintf(err, CFG_ERR, "'%s' is not one of %s", value, f->choices);
        return 0;
    }
    case CFG_NUMS: {
        NumList *l = (NumList *)base;
        int n = cfg_parse_numbers(value, l->v, CFG_MAX_LIST, err);
        if (n < 0) return 0;
        l->n = n;
        return 1;
    }
    case CFG_LAYERS: {
        LayerList *l = (LayerList *)base;
        memset(l, 0, sizeof *l);
        if (!strcmp(value, "all")) { l->all = 1; return 1; }
        double v[CFG_MAX_LAYERS];
        int n = cfg_parse_numbers(value, v, CFG_MAX_LAYERS, err);
        if (n < 0) return 0;
        for (int k = 0; k < n; k++) {
            if (v[k] != floor(v[k]) || v[k] < 0 || v[k] >= CFG_MAX_LAYERS) {
                snprintf(err, CFG_ERR, "layer index '%g' is not an integer in [0, %d)", v[k], CFG_MAX_LAYERS);
                return 0;
            }
            l->idx[k] = (int)v[k];
        }
        l->n = n;
        return 1;
    }
    }
    return 0;
}

static inline void cfg_defaults(Config *c) {
    char err[CFG_ERR];
    memset(c, 0, sizeof *c);
    for (int i = 0; i < CFG_N_FIELDS; i++)
        if (!cfg_set(c, &CFG_FIELDS[i], CFG_FIELDS[i].def, err))
            sdm_die("internal: default of %s: %s", CFG_FIELDS[i].key, err);
}

// Split `key = value` (line is modified) and find the key; NULL with err set (naming where) when malformed or unknown.
static inline const CfgField *cfg_split(char *line, char **value, const char *where, char *err) {
    char *eq = strchr(line, '=');
    if (!eq) { snprintf(err, CFG_ERR, "%.400s: expected 'key = value'", where); return NULL; }
    *eq = 0;
    char *key = cfg_trim(line);
    *value = cfg_trim(eq + 1);
    const CfgField *f = cfg_find(key);
    if (!f) snprintf(err, CFG_ERR, "%.200s: unknown key '%.200s' (see --help)", where, key);
    return f;
}

static inline int cfg_set_at(Config *c, const CfgField *f, const char *value, const char *where, char *err) {
    char msg[CFG_ERR];
    if (cfg_set(c, f, value, msg)) return 1;
    snprintf(err, CFG_ERR, "%.200s: key '%.64s': %.200s", where, f->key, msg);
    return 0;
}

// Apply one `key = value` (or `key=value`) text; `where` names its origin for messages ("file:line", "argument 'x'").
static inline int cfg_apply_line(Config *c, const char *line, const char *where, char *err) {
    char buf[CFG_LINE], *value;
    if (strlen(line) >= sizeof buf) { snprintf(err, CFG_ERR, "%.400s: line too long", where); return 0; }
    strcpy(buf, line);
    const CfgField *f = cfg_split(buf, &value, where, err);
    return f && cfg_set_at(c, f, value, where, err);
}

// Apply a config text (one `key = value` per line, `#` comments, blank lines) on top of what c holds; messages name
// `name:line`. A key set twice in one text is refused with both lines (a later command-line argument still
// overrides). Lines are read whole, so a long comment never spills into a setting. Returns 0 with err set.
static inline int cfg_parse_text(Config *c, const char *text, const char *name, char *err) {
    int first_line[CFG_N_FIELDS] = {0};
    char line[CFG_LINE], where[256], *value;
    int lineno = 0;
    for (const char *p = text; *p;) {
        const char *nl = strchr(p, '\n'), *next = nl ? nl + 1 : p + strlen(p);
        const char *hash = (const char *)memchr(p, '#', (size_t)(next - p));
        size_t len = (size_t)((hash ? hash : nl ? nl : next) - p);
        snprintf(where, sizeof where, "%.240s:%d", name, ++lineno);
        if (len >= sizeof line) {
            snprintf(err, CFG_ERR, "%s: setting longer than %d characters", where, CFG_LINE - 1);
            return 0;
        }
        memcpy(line, p, len);
        line[len] = 0;
        p = next;
        if (*cfg_trim(line) == 0) continue;
        const CfgField *f = cfg_split(line, &value, where, err);
        if (!f) return 0;
        int *first = &first_line[f - CFG_FIELDS];
        if (*first) {
            snprintf(err, CFG_ERR, "%s: key '%s' is set twice (first at %.180s:%d)", where, f->key, name, *first);
            return 0;
        }
        *first = lineno;
        if (!cfg_set_at(c, f, value, where, err)) return 0;
    }
    return 1;
}

// Read a .cfg file into c (on top of what c holds). Only a regular file is read (a FIFO would block forever), at
// most CFG_MAX_FILE bytes, no NUL byte. Returns 0 with err set on the first problem.
static inline int cfg_load_file(Config *c, const char *path, char *err) {
    char why[160];
    FILE *fp = sdm_fopen_regular(path, why, sizeof why);
    if (!fp) { snprintf(err, CFG_ERR, "%.300s: %s", path, why); return 0; }
    char *text = (char *)sdm_malloc(CFG_MAX_FILE + 1);
    size_t n = fread(text, 1, CFG_MAX_FILE + 1, fp);
    int ok = !ferror(fp);
    fclose(fp);
    text[SDM_MIN(n, (size_t)CFG_MAX_FILE)] = 0;
    const char *nul = (const char *)memchr(text, 0, n);
    if (!ok) snprintf(err, CFG_ERR, "%.300s: read error", path);
    else if (n > CFG_MAX_FILE) snprintf(err, CFG_ERR, "%.300s: larger than %d bytes", path, CFG_MAX_FILE);
    else if (nul) {
        int line = 1;
        for (const char *q = text; q < nul; q++) line += *q == '\n';
        snprintf(err, CFG_ERR, "%.300s:%d: NUL byte", path, line);
    }
    ok = ok && n <= CFG_MAX_FILE && !nul && cfg_parse_text(c, text, path, err);
    free(text);
    return ok;
}

// ---------------------------------------------------------------------------------------------------------------
// Validation of the whole configuration (cross-field rules of docs/MODEL.md#config-keys).

static inline int cfg_layer_in(const LayerList *l, int layer) {
    if (l->all) return 1;
    for (int k = 0; k < l->n; k++)
        if (l->idx[k] == layer) return 1;
    return 0;
}

// Every layer in exactly one of attn_at, swa_at, sdm_at; no duplicates, no out-of-range indices.
static inline int cfg_check_layers(const Config *c, char *err) {
    const LayerList *lists[3] = {&c->attn_at, &c->swa_at, &c->sdm_at};
    const char *names[3] = {"model.attn_at", "model.swa_at", "model.sdm_at"};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < lists[k]->n; i++) {
            if (lists[k]->idx[i] >= c->n_layers) {
                snprintf(err, CFG_ERR, "key '%s': layer %d out of range (n_layers = %d)", names[k], lists[k]->idx[i],
                         c->n_layers);
                return 0;
            }
            for (int j = 0; j < i; j++)
                if (lists[k]->idx[j] == lists[k]->idx[i]) {
                    snprintf(err, CFG_ERR, "key '%s': layer %d listed twice", names[k], lists[k]->idx[i]);
                    return 0;
                }
        }
    for (int layer = 0; layer < c->n_layers; layer++) {
        int count = 0;
        for (int k = 0; k < 3; k++) count += cfg_layer_in(lists[k], layer);
        if (count != 1) {
            snprintf(err, CFG_ERR, "layer %d is assigned %s (attn_at, swa_at and sdm_at must cover every layer once)",
                     layer, count ? "more than once" : "no type");
            return 0;
        }
    }
    return 1;
}

static inline int cfg_any_layer(const Config *c, const LayerList *l) {
    for (int layer = 0; layer < c->n_layers; layer++)
        if (cfg_layer_in(l, layer)) return 1;
    return 0;
}

static inline int cfg_check_sdm(const Config *c, char *err) {
    if (c->sdm_slots <= 0) { snprintf(err, CFG_ERR, "key 'sdm.slots_per_head': required with SDM layers"); return 0; }
    if (c->dim % c->sdm_heads) {
        snprintf(err, CFG_ERR, "key 'sdm.num_heads': %d does not divide model.dim %d", c->sdm_heads, c->dim);
        return 0;
    }
    if (c->sdm_factors.n == 0) {
        int r = (int)llround(sqrt((double)c->sdm_slots));
        if ((long long)r * r != c->sdm_slots) {
            snprintf(err, CFG_ERR, "key 'sdm.slots_per_head': %d is not a perfect square (set product_key_factor_dims)",
                     c->sdm_slots);
            return 0;
        }
    } else {
        if (c->sdm_factors.n > 4) {
            snprintf(err, CFG_ERR, "key 'sdm.product_key_factor_dims': at most 4 factors");
            return 0;
        }
        long long prod = 1;
        for (int f = 0; f < c->sdm_factors.n; f++) {
            double v = c->sdm_factors.v[f];
            if (v != floor(v) || v < 1 || v > (1 << 30)) {
                snprintf(err, CFG_ERR, "key 'sdm.product_key_factor_dims': '%g' is not a positive integer", v);
                return 0;
            }
            prod *= (long long)v;
            if (prod > (1 << 30)) break;
        }
        if (prod != c->sdm_slots) {
            snprintf(err, CFG_ERR, "key 'sdm.product_key_factor_dims': product %lld != slots_per_head %d", prod,
                     c->sdm_slots);
            return 0;
        }
    }
    if (c->sdm_writes > c->sdm_slots || c->sdm_reads > c->sdm_slots) {
        snprintf(err, CFG_ERR, "key 'sdm.num_%s': %d exceeds slots_per_head %d",
                 c->sdm_writes > c->sdm_slots ? "writes" : "reads",
                 c->sdm_writes > c->sdm_slots ? c->sdm_writes : c->sdm_reads, c->sdm_slots);
        return 0;
    }
    if (c->A_init_range.n != 2 || c->A_init_range.v[0] < 0 || c->A_init_range.v[1] < c->A_init_range.v[0]) {
        snprintf(err, CFG_ERR, "key 'sdm.A_init_range': expected 'lo,hi' with 0 <= lo <= hi");
        return 0;
    }
    return 1;
}

static inline int cfg_check_attention(const Config *c, char *err) {
    int any_attn = cfg_any_layer(c, &c->attn_at), any_swa = cfg_any_layer(c, &c->swa_at);
    if (any_swa && c->swa_window <= 0) {
        snprintf(err, CFG_ERR, "key 'model.swa_window': must be > 0 with SWA layers (got %d)", c->swa_window);
        return 0;
    }
    if (any_attn || any_swa) {
        int hd = c->head_dim ? c->head_dim : c->dim / c->n_heads;
        int kv = c->n_kv_heads ? c->n_kv_heads : c->n_heads;
        if (c->n_heads % kv) {
            snprintf(err, CFG_ERR, "key 'model.n_kv_heads': %d does not divide n_heads %d", kv, c->n_heads);
            return 0;
        }
        if (any_attn && (hd % 2 || hd <= 0)) {
            snprintf(err, CFG_ERR, "key 'model.head_dim': full-attention head dim %d must be even", hd);
            return 0;
        }
    }
    if (any_swa) {
        int nh = c->swa_n_heads ? c->swa_n_heads : c->n_heads;
        int kv = c->swa_n_kv_heads ? c->swa_n_kv_heads
                                   : (c->swa_n_heads ? nh : (c->n_kv_heads ? c->n_kv_heads : nh));
        int hd = c->swa_head_dim ? c->swa_head_dim : c->dim / nh;
        if (nh % kv) {
            snprintf(err, CFG_ERR, "key 'model.swa_n_kv_heads': %d does not divide swa heads %d", kv, nh);
            return 0;
        }
        if (hd % 2 || hd <= 0) {
            snprintf(err, CFG_ERR, "key 'model.swa_head_dim': SWA head dim %d must be even", hd);
            return 0;
        }
    }
    return 1;
}

// bf16 AdamW moments (docs/MODEL.md#optimizer) keep 8 significant bits: a step's decay of a moment by beta changes
// every bf16 value only while 1 - beta >= 2^-8; closer to 1 rounding to nearest undoes it for some values, which stall.
#define CFG_BF16_MOMENT_MAX_BETA (1.0 - 1.0 / 256)

static inline int cfg_check_moments(const Config *c, char *err) {
    if (strcmp(c->moment_dtype, "bf16")) return 1;
    const char *key = c->beta2 > c->beta1 ? "optim.beta2" : "optim.beta1";
    double beta = SDM_MAX(c->beta1, c->beta2);
    if (beta <= CFG_BF16_MOMENT_MAX_BETA) return 1;
    snprintf(err, CFG_ERR, "key '%s': %g is above %.8g with optim.moment_dtype = bf16 (1 - beta below 2^-8: bf16 "
             "rounding would undo the moment's decay)", key, beta, CFG_BF16_MOMENT_MAX_BETA);
    return 0;
}

static inline int cfg_validate(const Config *c, char *err) {
    if (!cfg_check_layers(c, err)) return 0;
    if (!cfg_check_moments(c, err)) return 0;
    if ((long long)c->batch_size * (c->seq_len + 1) > INT_MAX) {  // a batch of B rows of T+1 tokens is int-indexed
        snprintf(err, CFG_ERR, "keys 'data.batch_size', 'data.seq_len': B*(T+1) = %lld exceeds %d",
                 (long long)c->batch_size * (c->seq_len + 1), INT_MAX);
        return 0;
    }
    if (!cfg_check_attention(c, err)) return 0;
    if (cfg_any_layer(c, &c->sdm_at) && !cfg_check_sdm(c, err)) return 0;
    if (c->vocab_size > 65535 && !strcmp(c->tokenizer, "bytes")) {
        snprintf(err, CFG_ERR, "key 'model.vocab_size': the bytes tokenizer has 258 tokens");
        return 0;
    }
    return 1;
}

// ---------------------------------------------------------------------------------------------------------------
// Output: the value of a field in the file syntax, the resolved dump, and --help.

static inline void cfg_format(const Config *c, const CfgField *f, char *out, size_t size) {
    const char *base = (const char *)c + f->offset;
    switch (f->type) {
    case CFG_INT: snprintf(out, size, "%d", *(const int *)base); break;
    case CFG_FLOAT: snprintf(out, size, "%.17g", *(const double *)base); break;
    case CFG_BOOL: snprintf(out, size, "%s", *(const int *)base ? "true" : "false"); break;
    case CFG_STRING:
    case CFG_CHOICE: snprintf(out, size, "%s", base); break;
    case CFG_NUMS: {
        const NumList *l = (const NumList *)base;
        size_t pos = 0;
        out[0] = 0;
        for (int k = 0; k < l->n && pos < size; k++)
            pos += snprintf(out + pos, size - pos, "%s%.17g", k ? "," : "", l->v[k]);
        break;
    }
    case CFG_LAYERS: {
        const LayerList *l = (const LayerList *)base;
        size_t pos = 0;
        out[0] = 0;
        if (l->all) { snprintf(out, size, "all"); break; }
        for (int k = 0; k < l->n && pos < size; k++)
            pos += snprintf(out + pos, size - pos, "%s%d", k ? "," : "", l->idx[k]);
        break;
    }
    }
}

// The resolved configuration in the .cfg syntax (re-loadable): written into run folders and checkpoints.
static inline void cfg_dump(const Config *c, FILE *fp) {
    char v[4096];
    for (int i = 0; i < CFG_N_FIELDS; i++) {
        cfg_format(c, &CFG_FIELDS[i], v, sizeof v);
        fprintf(fp, "%s = %s\n", CFG_FIELDS[i].key, v);
    }
}

// One line per field of a table: key, help, default, choices or range.
static inline void cfg_print_fields(FILE *fp, const CfgField *fields, int n) {
    for (int i = 0; i < n; i++) {
        const CfgField *f = &fields[i];
        fprintf(fp, "  %-34s %s (default: %s", f->key, f->help, f->def[0] ? f->def : "empty");
        if (f->choices) fprintf(fp, "; one of %s", f->choices);
        else if (f->lo <= f->hi) fprintf(fp, "; range %.10g..%.10g", f->lo, f->hi);
        fprintf(fp, ")\n");
    }
}

static inline void cfg_print_help(FILE *fp) {
    fprintf(fp, "config keys (set in a .cfg file as 'key = value', or on the command line as key=value):\n");
    cfg_print_fields(fp, CFG_FIELDS, CFG_N_FIELDS);
}

// Speed and memory knobs of the reference that sdm.c accepts (so its configs load unchanged) but does not implement
// yet; none of them changes results. Writes their names, comma separated, into out (empty when none is set).
static inline void cfg_unimplemented(const Config *c, char *out, size_t size) {
    snprintf(out, size, "%s%s", c->cuda_graph && !c->compile ? "sdm.cuda_graph (the SDM op is replayed from a graph "
             "only inside distributed.compile's captured step) " : "",
             strcmp(c->fsdp_type, "no_shard") ? "" : "distributed.fsdp_type=no_shard (gradients whole, optimizer state "
             "still sharded: ZeRO-1) ");
}

// Architecture keys: those that change which tensors a model has or what it computes from them, so a checkpoint
// resumes only under the same values (model/checkpoint.h). They are the model.* and sdm.* keys except these, which
// only set the initial weights or how the same function is computed (speed, memory, precision knobs).
static const char *const CFG_NOT_ARCHITECTURE[] = {"model.init_base_std", "model.init_std_factor", "sdm.A_init_range",
                                                   "sdm.chunk_size", "sdm.snapshot_quant", "sdm.bank_dtype",
                                                   "sdm.grad_bank_dtype", "sdm.cuda_graph"};

static inline int cfg_is_architecture(const char *key) {
    if (strncmp(key, "model.", 6) != 0 && strncmp(key, "sdm.", 4) != 0) return 0;
    for (size_t i = 0; i < sizeof CFG_NOT_ARCHITECTURE / sizeof CFG_NOT_ARCHITECTURE[0]; i++)
        if (!strcmp(key, CFG_NOT_ARCHITECTURE[i])) return 0;
    return 1;
}

// Parse command-line arguments: `-c file.cfg` (loaded first), then `key=value` overrides in order.
// Returns 0 with err set on any problem; other flags are left to the caller via is_flag.
static inline int cfg_from_args(Config *c, int argc, char **argv, char *err) {
    cfg_defaults(c);
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-c")) {
            if (i + 1 >= argc) { snprintf(err, CFG_ERR, "argument '-c': missing config file"); return 0; }
            if (!cfg_load_file(c, argv[++i], err)) return 0;
        }
    char where[CFG_ERR];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-c")) { i++; continue; }
        snprintf(where, sizeof where, "argument '%.400s'", argv[i]);
        if (!strchr(argv[i], '=')) { snprintf(err, CFG_ERR, "%.400s: expected -c FILE or key=value", where); return 0; }
        if (!cfg_apply_line(c, argv[i], where, err)) return 0;
    }
    return cfg_validate(c, err);
}

#endif
