// train_sdm.cu: trains a hybrid language model of sliding-window attention, full attention and Sparse Delta Memory
// layers (docs/MODEL.md) on one or many GPUs.
//
//   ./train_sdm -c configs/sdm_flagship.cfg [key=value ...]
//   scripts/launch_local.sh 8 ./train_sdm -c configs/sdm_flagship.cfg      (8 GPUs of one node; see scripts/)
//   ./train_sdm -c configs/sdm_flagship.cfg --memory=8      per-GPU memory of 8 ranks, without a GPU (dry run)
//
// Read top to bottom: the run (config, data, the model of model/gpu_model.cuh), one optimizer step (micro-batches,
// ZeRO-1 over NCCL, clipping, AdamW), evaluation with recall scoring, checkpoints, and main. Without data.train the
// embedded recall dataset is generated on first use. A run resumes from the newest complete checkpoint in its run_dir.
#include <sys/stat.h>
#include <time.h>

#include "model/adamw.cuh"
#include "model/checkpoint.h"
#include "core/config.h"
#include "core/dist.cuh"
#include "model/gpu_model.cuh"
#include "core/optim.h"
#include "data/dataloader.h"
#include "data/dataset.h"
#include "data/synthetic.h"

// ------------------------------------------------------------------------------------------------------------------
// The training loop

typedef struct {
    Config cfg;
    ModelDesc *m;
    Dist dist;
    GpuModel g;
    DataLoader train, val;
    int32_t *batch;          // host [B, T+1]
    int *inputs, *targets;   // host [B*T]
    long long step;          // optimizer steps done
    FILE *log;               // run_dir/train.log (rank 0)
} Run;

// inputs[b, t] = row[b][t], targets[b, t] = row[b][t+1]
static inline void split_batch(const Run *r) {
    int B = r->g.B, T = r->g.T;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            r->inputs[b * T + t] = r->batch[(size_t)b * (T + 1) + t];
            r->targets[b * T + t] = r->batch[(size_t)b * (T + 1) + t + 1];
        }
}

static inline void next_batch(Run *r, DataLoader *dl) {
    char err[DATA_ERR_LEN];
    if (dataloader_next_batch(dl, r->batch, err)) sdm_die("%s", err);
    split_batch(r);
}

static inline void say(const Run *r, const char *fmt, ...) {
    if (r->dist.rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    char line[2048];
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fputs(line, stdout);
    fflush(stdout);
    if (r->log) { fputs(line, r->log); fflush(r->log); }
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static inline void open_data(Run *r) {
    char err[DATA_ERR_LEN], train[CFG_STR + 64], val[CFG_STR + 64];
    const Config *c = &r->cfg;
    if (!c->train_data[0] || !c->val_data[0]) {
        if (dataset_ensure_default(DATASET_DEFAULT_DIR, err)) sdm_die("%s", err);
        snprintf(train, sizeof train, "%s/%s", DATASET_DEFAULT_DIR, DATASET_TRAIN_PATTERN);
        snprintf(val, sizeof val, "%s/%s", DATASET_DEFAULT_DIR, DATASET_VAL_PATTERN);
    }
    if (c->train_data[0]) snprintf(train, sizeof train, "%s", c->train_data);
    if (c->val_data[0]) snprintf(val, sizeof val, "%s", c->val_data);
    if (dataloader_open(&r->train, train, c->batch_size, c->seq_len, r->dist.rank, r->dist.world, (uint64_t)c->seed, 1,
                        err))
        sdm_die("%s", err);
    if (dataloader_open(&r->val, val, c->batch_size, c->seq_len, r->dist.rank, r->dist.world, (uint64_t)c->seed, 0,
                        err))
        sdm_die("%s", err);
    if ((int)r->train.vocab > c->vocab_size || (int)r->val.vocab > c->vocab_size)
        sdm_die("%s: the shards' vocabulary (%u) exceeds model.vocab_size %d", train, r->train.vocab, c->vocab_size);
}

// Initial weights (docs/MODEL.md#initialisation), the same on every rank.
static inline void init_params(Run *r) {
    const ModelDesc *m = r->m;
    float *host = (float *)sdm_malloc(sizeof(float) * (size_t)m->storage);
    model_init_all(m, (unsigned long long)r->cfg.seed, host, (int)sysconf(_SC_NPROCESSORS_ONLN));
    gpu_model_set_params(&r->g, host);
    free(host);
}

// One optimizer step: grad_acc_steps micro-batches forward and backward, gradients reduce-scattered over ranks,
// the global norm clipped, AdamW on this rank's shard, the updated weights all-gathered. Returns the mean loss.
static inline float train_step(Run *r) {
    GpuModel *g = &r->g;
    const Config *c = &r->cfg;
    Dist *d = &r->dist;
    int acc = c->grad_acc_steps;
    cudaCheck(cudaMemset(g->grads, 0, sizeof(float) * g->padded));
    float loss = 0;
    for (int k = 0; k < acc; k++) {
        next_batch(r, &r->train);
        gpu_model_forward(g, r->inputs, r->targets, 1.0f / ((float)g->n * acc * d->world));
        gpu_model_backward(g, r->inputs);
        loss += gpu_model_loss(g) / acc;
    }
    dist_reduce_scatter_grads(d, g->grads, 0);
    long long lo = d->rank * d->shard, hi = SDM_MIN(lo + d->shard, r->m->storage);
    grad_sumsq(g->clip_sumsq, g->norm_scratch2, g->grads + lo, SDM_MAX(hi - lo, 0LL), 0);
    dist_all_reduce_sum(d, g->clip_sumsq, 1, 0);
    grad_clip_scale(g->clip_norm, g->clip_scale, g->clip_sumsq, (float)c->clip, 0);
    AdamWHyper hyper = {c->lr * lr_schedule(lr_scheduler_from_name(c->scheduler), r->step, c->warmup, c->steps,
                                            c->lr_min_ratio),
                        c->weight_decay, c->beta1, c->beta2, c->adam_eps, r->step + 1};
    if (hi > lo)
        adamw_update_model(r->m, lo, hi, g->master + lo, (char *)g->work + lo * g->es, g->ctype, g->grads + lo,
                           g->adam_m + lo, g->adam_v + lo, &hyper, g->clip_scale, 0);
    dist_all_gather(d, g->work, g->es, 0);
    r->step++;
    return loss;
}

// Mean loss over ranks of a host value, through the device.
static inline float mean_over_ranks(Run *r, float x) {
    if (r->dist.world == 1) return x;
    cudaCheck(cudaMemcpy(r->g.clip_sumsq, &x, sizeof x, cudaMemcpyHostToDevice));
    dist_all_reduce_sum(&r->dist, r->g.clip_sumsq, 1, 0);
    cudaCheck(cudaMemcpy(&x, r->g.clip_sumsq, sizeof x, cudaMemcpyDeviceToHost));
    return x / r->dist.world;
}

// run_dir/name opened for appending, or NULL with a warning (the evaluation is printed anyway).
static inline FILE *open_run_file(const Run *r, const char *name) {
    char path[CFG_STR + 32];
    snprintf(path, sizeof path, "%s/%s", r->cfg.run_dir, name);
    FILE *f = fopen(path, "a");
    if (!f) fprintf(stderr, "warning: cannot append to %s\n", path);
    return f;
}

// Validation loss over eval.steps batches; on rank 0's batches also the loss by position and the recall accuracy
// by gap of the greedy predictions, for eval.task (auto: every task whose answers are in the data), printed and
// appended to run_dir/eval_positions.tsv and run_dir/eval_recall.tsv (data/eval_stats.h).
static inline void evaluate(Run *r) {
    GpuModel *g = &r->g;
    const char *want = r->cfg.eval_task;
    GapScore score[EVAL_NUM_TASKS];
    for (int k = 0; k < EVAL_NUM_TASKS; k++) EVAL_TASKS[k].init(&score[k]);
    PositionLoss pl;
    position_loss_init(&pl, g->T);
    int *pred = (int *)sdm_malloc(sizeof(int) * g->n);
    float *losses = (float *)sdm_malloc(sizeof(float) * g->n);  // [B, T]
    dataloader_reset(&r->val);
    int batches = (int)SDM_MIN((uint64_t)r->cfg.eval_steps, dataloader_batches_per_epoch(&r->val));
    double loss = 0;
    for (int k = 0; k < batches; k++) {
        next_batch(r, &r->val);
        gpu_model_forward(g, r->inputs, r->targets, 0.0f);
        loss += gpu_model_loss(g);
        cudaCheck(cudaMemcpy(losses, g->losses, sizeof(float) * g->n, cudaMemcpyDeviceToHost));
        position_loss_add(&pl, losses, g->B);
        if (!strcmp(want, "none")) continue;
        gpu_model_argmax(g);
        cudaCheck(cudaMemcpy(pred, g->pred, sizeof(int) * g->n, cudaMemcpyDeviceToHost));
        for (int t = 0; t < EVAL_NUM_TASKS; t++) {
            if (strcmp(want, "auto") && strcmp(want, EVAL_TASKS[t].name)) continue;
            for (int b = 0; b < g->B; b++)
                EVAL_TASKS[t].score_row(&score[t], r->batch + (size_t)b * (g->T + 1), pred + (size_t)b * g->T, g->T);
        }
    }
    float val = mean_over_ranks(r, batches ? (float)(loss / batches) : 0.0f);
    say(r, "eval step %lld | val loss %.4f over %d batches\n", r->step, val, batches);
    if (r->dist.rank == 0) {
        position_loss_print(&pl, stdout);
        if (r->log) position_loss_print(&pl, r->log);
        FILE *pos_tsv = open_run_file(r, "eval_positions.tsv"), *gap_tsv = NULL;
        if (pos_tsv) { position_loss_tsv(&pl, r->step, pos_tsv); fclose(pos_tsv); }
        for (int t = 0; t < EVAL_NUM_TASKS; t++) {
            uint64_t q, exact, tokens, right;
            gap_score_totals(&score[t], &q, &exact, &tokens, &right);
            if (strcmp(want, "auto") ? strcmp(want, EVAL_TASKS[t].name) != 0 : q == 0 && score[t].unanswerable == 0)
                continue;  // not asked for, or (auto) not in the data
            say(r, "%s (rank 0): %llu queries, token acc %.4f, exact %.4f\n", EVAL_TASKS[t].name,
                (unsigned long long)q, tokens ? (double)right / tokens : 0.0, q ? (double)exact / q : 0.0);
            gap_score_print(&score[t], EVAL_TASKS[t].name, stdout);
            if (r->log) gap_score_print(&score[t], EVAL_TASKS[t].name, r->log);
            if (!gap_tsv) gap_tsv = open_run_file(r, "eval_recall.tsv");
            if (gap_tsv) gap_score_tsv(&score[t], r->step, EVAL_TASKS[t].name, gap_tsv);
        }
        if (gap_tsv) fclose(gap_tsv);
    }
    free(pred);
    free(losses);
}

// Gather the sharded state to rank 0 and write a checkpoint there.
static inline void save_checkpoint(Run *r) {
    GpuModel *g = &r->g;
    dist_all_gather(&r->dist, g->master, 4, 0);
    dist_all_gather(&r->dist, g->adam_m, 4, 0);
    dist_all_gather(&r->dist, g->adam_v, 4, 0);
    if (r->dist.rank != 0) return;
    size_t n = (size_t)r->m->storage;
    float *p = (float *)sdm_malloc(4 * n), *mm = (float *)sdm_malloc(4 * n), *vv = (float *)sdm_malloc(4 * n);
    cudaCheck(cudaMemcpy(p, g->master, 4 * n, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(mm, g->adam_m, 4 * n, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(vv, g->adam_v, 4 * n, cudaMemcpyDeviceToHost));
    DataLoaderState ls;
    dataloader_get_state(&r->train, &ls);
    CkptTrainState st = {(uint64_t)r->step, 0, mm, vv, &ls, sizeof ls};
    char err[CKPT_ERR];
    if (!ckpt_save(r->cfg.run_dir, r->m, &r->cfg, p, &st, r->cfg.keep_checkpoints, err)) sdm_die("%s", err);
    say(r, "checkpoint: %s/step_%08lld\n", r->cfg.run_dir, r->step);
    free(p);
    free(mm);
    free(vv);
}

// Continue from the newest complete checkpoint of run_dir, if any. The stored model must match this config's.
static inline void resume(Run *r) {
    uint64_t steps[1];
    if (ckpt_list(r->cfg.run_dir, steps, 1) == 0) return;
    char dir[1024], path[1100], err[CKPT_ERR];
    ckpt_step_dir(dir, sizeof dir, r->cfg.run_dir, steps[0], "");
    Config stored;
    ModelDesc *sm = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    float *params = NULL;
    uint64_t step, rng;
    snprintf(path, sizeof path, "%s/model.bin", dir);
    if (!ckpt_load_model(path, &stored, sm, &params, &step, err)) sdm_die("%s", err);
    if (sm->storage != r->m->storage || sm->n_params != r->m->n_params)
        sdm_die("%s: the checkpoint's model differs from the configured one (delete run_dir or fix the config)", path);
    size_t n = (size_t)r->m->storage;
    float *mm = (float *)sdm_malloc(4 * n), *vv = (float *)sdm_malloc(4 * n);
    DataLoaderState ls;
    snprintf(path, sizeof path, "%s/state.bin", dir);
    if (!ckpt_load_state(path, n, mm, vv, &ls, sizeof ls, &step, &rng, err)) sdm_die("%s", err);
    char derr[DATA_ERR_LEN];
    if (dataloader_set_state(&r->train, &ls, derr)) sdm_die("%s: %s", path, derr);
    gpu_model_set_params(&r->g, params);
    cudaCheck(cudaMemcpy(r->g.adam_m, mm, 4 * n, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(r->g.adam_v, vv, 4 * n, cudaMemcpyHostToDevice));
    r->step = (long long)step;
    say(r, "resumed from %s at step %lld\n", dir, r->step);
    free(params);
    free(mm);
    free(vv);
    free(sm);
}

static void usage(void) {
    printf("usage: train_sdm -c CONFIG.cfg [key=value ...] [--memory[=WORLD]]\n"
           "  -c FILE     config file (see configs/); later key=value arguments override it\n"
           "  --memory    print the per-GPU device memory by category for WORLD ranks (default 1) and exit;\n"
           "              a dry run of the allocations, no GPU needed\n"
           "  --help      this text and every config key\n"
           "Multi-GPU: rank, world size and local rank come from RANK/WORLD_SIZE/LOCAL_RANK or SLURM_PROCID/\n"
           "SLURM_NTASKS/SLURM_LOCALID; rank 0 serves the NCCL id on MASTER_ADDR:MASTER_PORT (see scripts/).\n\n");
    cfg_print_help(stdout);
}

static inline Dtype compute_dtype(const Config *c) { return !strcmp(c->model_dtype, "fp32") ? DT_FP32 : DT_BF16; }

// --memory: the ledger of a dry-run model (every allocation recorded, none made) for `world` ranks.
static int print_memory(const Config *c, const ModelDesc *m, int world) {
    g_mem.dry_run = 1;
    GpuModel g;
    gpu_model_create(&g, m, c->batch_size, c->seq_len, compute_dtype(c), world, c->selective_act_ckpt);
    char title[3 * CFG_STR];
    snprintf(title, sizeof title, "device memory per GPU: %s, micro-batch %d x %d, %s, %d rank%s, recompute %s",
             c->name, c->batch_size, c->seq_len, c->model_dtype, world, world > 1 ? "s" : "",
             c->selective_act_ckpt ? "on" : "off");
    mem_print(stdout, title);
    printf("  (not in a dry run: the CUDA context and NCCL's buffers, measured at start-up of a real run)\n");
    if (world > 1) // ZeRO-1 shards the optimizer update; the arrays themselves are whole on every rank
        printf("  (master weights and AdamW m, v are whole on every rank: sharding them would save %.3f GiB per GPU)\n",
               mem_gib((g_mem.bytes[MEM_MASTER] + g_mem.bytes[MEM_ADAMW]) / world * (world - 1)));
    return 0;
}

int main(int argc, char **argv) {
    int memory_world = 0; // --memory[=WORLD]: print the breakdown and exit
    int kept = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { usage(); return 0; }
        if (!strcmp(argv[i], "--memory")) memory_world = 1;
        else if (!strncmp(argv[i], "--memory=", 9)) {
            memory_world = atoi(argv[i] + 9);
            if (memory_world < 1) sdm_die("argument '%s': the world size must be a positive integer", argv[i]);
        } else argv[kept++] = argv[i];
    }
    argc = kept;

    // 1. configuration, the process layout, the model description
    Run r;
    memset(&r, 0, sizeof r);
    char err[CFG_ERR];
    if (!cfg_from_args(&r.cfg, argc, argv, err)) sdm_die("%s", err);
    const Config *c = &r.cfg;
    r.m = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    model_build(r.m, c);
    if (memory_world) return print_memory(c, r.m, memory_world);
    BootConfig boot = boot_from_env();
    dist_init(&r.dist, &boot, r.m->storage);
    if (r.dist.rank == 0) {
        mkdir(c->run_dir, 0755);
        char path[CFG_STR + 32];
        snprintf(path, sizeof path, "%s/train.log", c->run_dir);
        r.log = fopen(path, "a");
        snprintf(path, sizeof path, "%s/config.cfg", c->run_dir);
        FILE *fp = fopen(path, "w");
        if (fp) { cfg_dump(c, fp); fclose(fp); }
        model_print_summary(r.m, c, stdout);
    }
    char unimplemented[512];
    cfg_unimplemented(c, unimplemented, sizeof unimplemented);
    if (unimplemented[0]) say(&r, "note: accepted but not implemented yet (no effect on results): %s\n", unimplemented);
    say(&r, "ranks %d | micro-batch %d x %d tokens | %s\n", r.dist.world, c->batch_size, c->seq_len, c->model_dtype);

    // 2. data, the model on the GPU, its initial or resumed state
    open_data(&r);
    r.batch = (int32_t *)sdm_malloc(sizeof(int32_t) * c->batch_size * (c->seq_len + 1));
    r.inputs = (int *)sdm_malloc(sizeof(int) * c->batch_size * c->seq_len);
    r.targets = (int *)sdm_malloc(sizeof(int) * c->batch_size * c->seq_len);
    gpu_model_create(&r.g, r.m, c->batch_size, c->seq_len, compute_dtype(c), r.dist.world, c->selective_act_ckpt);
    if (r.dist.rank == 0) {
        const char *title = "device memory per GPU (ledger; the step line shows the measured peak):";
        mem_print(stdout, title);
        if (r.log) mem_print(r.log, title);
    }
    init_params(&r);
    resume(&r);

    // 3. train
    double t0 = now_s(), t_log = t0;
    long long first_step = r.step;
    long long tokens_per_step = (long long)c->batch_size * c->seq_len * c->grad_acc_steps * r.dist.world;
    size_t peak_used = 0; // device bytes in use after a step, the highest so far (allocation is static after step 1)
    while (r.step < c->steps) {
        float loss = mean_over_ranks(&r, train_step(&r));
        peak_used = SDM_MAX(peak_used, device_used_bytes());
        if (!isfinite(loss)) sdm_die("step %lld: loss is %f; stopping (the last checkpoint is intact)", r.step, loss);
        if (r.step % c->log_freq == 0 || r.step == c->steps) {
            float norm;
            cudaCheck(cudaMemcpy(&norm, r.g.clip_norm, sizeof norm, cudaMemcpyDeviceToHost));
            double t = now_s(), per_step = (t - t_log) / (r.step % c->log_freq ? r.step % c->log_freq : c->log_freq);
            t_log = t;
            say(&r, "step %6lld/%d | loss %.4f | lr %.3e | grad norm %.3f | %.1f ms/step | %.0f tok/s | "
                "peak %.2f GiB\n", r.step, c->steps, loss,
                c->lr * lr_schedule(lr_scheduler_from_name(c->scheduler), r.step - 1, c->warmup, c->steps,
                                    c->lr_min_ratio),
                norm, 1e3 * per_step, tokens_per_step / per_step, mem_gib(peak_used));
        }
        if ((c->eval_every && r.step % c->eval_every == 0) || (c->probe_freq && r.step % c->probe_freq == 0))
            evaluate(&r);
        if (c->dump_every && r.step % c->dump_every == 0) save_checkpoint(&r);
    }
    if (r.step > first_step && c->dump_every && r.step % c->dump_every) save_checkpoint(&r); // the final state
    say(&r, "done: %lld steps in %.1f s\n", r.step, now_s() - t0);

    gpu_model_destroy(&r.g);
    dataloader_close(&r.train);
    dataloader_close(&r.val);
    dist_destroy(&r.dist);
    if (r.log) fclose(r.log);
    free(r.batch);
    free(r.inputs);
    free(r.targets);
    free(r.m);
    return 0;
}
