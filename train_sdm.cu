// train_sdm.cu: trains a hybrid language model of sliding-window attention, full attention and Sparse Delta Memory
// layers (docs/MODEL.md) on one or many GPUs.
//
//   ./train_sdm -c configs/sdm_flagship.cfg [key=value ...]
//   scripts/launch_local.sh 8 ./train_sdm -c configs/sdm_flagship.cfg      (8 GPUs of one node; see scripts/)
//   ./train_sdm -c configs/sdm_flagship.cfg --memory=8      per-GPU memory of 8 ranks, without a GPU (dry run)
//
// Read top to bottom: the run (config, data, the model of model/gpu_model.cuh), one optimizer step (micro-batches,
// ZeRO-2 or ZeRO-1 over NCCL, clipping, AdamW) on a stream of its own, eager or replayed as a CUDA graph
// (distributed.compile), evaluation with recall scoring, checkpoints, and main. Without data.train the embedded recall
// dataset is generated on first use. A run resumes from the newest complete checkpoint in its run_dir. SIGTERM or
// SIGINT stops it after the current step with a checkpoint (a second one at once); a non-finite loss or gradient norm
// stops it without one.
#include "core/config.h"
#include "core/dist.cuh"
#include "core/optim.h"
#include "core/profile.cuh"
#include "core/stop_signal.h"
#include "data/dataloader.h"
#include "data/dataset.h"
#include "model/adamw.cuh"
#include "model/checkpoint.h"
#include "model/evaluate.cuh"
#include "model/gpu_model.cuh"

// ------------------------------------------------------------------------------------------------------------------
// The training loop

// What a step reads from and writes to the host, in pinned memory at fixed addresses: the copies of a captured step
// are graph nodes that read and write the same addresses at every replay, so the host fills the inputs before each
// step (every micro-batch its own slot, since all are copied during the step) and reads the outputs after it.
typedef struct {
    int *tokens, *targets; // [grad_acc_steps][n]: each micro-batch's inputs and targets
    int *plan;             // [grad_acc_steps][gpu_model_plan_ints]: their plans for the backward
    AdamWCoeffs *coeffs;   // [ADAMW_COEFF_SETS]: the step's AdamW coefficients (the learning rate, bias corrections)
    float *loss;           // [grad_acc_steps]: each micro-batch's mean loss
    float *norm;           // the gradient norm
} StepIO;

typedef struct {
    Config cfg;
    ModelDesc *m;
    Dist dist;
    GpuModel g;
    AdamWState opt;          // fp32 master weights and AdamW moments of this rank's shard, clip scalars
    DataLoader train, val;
    int32_t *batch;          // host [B, T+1]
    int *inputs, *targets;   // host [B*T]: evaluation's
    StepIO io;               // the step's pinned inputs and outputs
    cudaStream_t stream;     // the step's: non-blocking, so a graph can capture it
    cudaEvent_t legacy_done; // the step's stream waits for the legacy stream's work through it
    cudaGraphExec_t graph;   // the captured step (distributed.compile), NULL while the step runs eagerly
    long long step;          // optimizer steps done
    double lr;               // learning rate of the last step
    float norm;              // gradient norm of the last step
    double flops_per_token;  // model FLOPs of a training token, the numerator of MFU
    Profiler *prof;          // the step profile while logging.profile is on (rank 0), else NULL
    FILE *log;               // run_dir/train.log (rank 0)
} Run;

static inline void *pinned_alloc(size_t bytes) {
    void *p = NULL;
    cudaCheck(cudaMallocHost(&p, bytes));
    return p;
}

// The step's stream, its event and pinned buffers, for micro-batches of the model r->g.
static inline void step_create(Run *r) {
    StepIO *io = &r->io;
    size_t acc = (size_t)r->cfg.grad_acc_steps, n = (size_t)r->g.n;
    io->tokens = (int *)pinned_alloc(sizeof(int) * acc * n);
    io->targets = (int *)pinned_alloc(sizeof(int) * acc * n);
    io->plan = (int *)pinned_alloc(sizeof(int) * acc * gpu_model_plan_ints(&r->g));
    io->coeffs = (AdamWCoeffs *)pinned_alloc(sizeof(AdamWCoeffs) * ADAMW_COEFF_SETS);
    io->loss = (float *)pinned_alloc(sizeof(float) * acc);
    io->norm = (float *)pinned_alloc(sizeof(float));
    cudaCheck(cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
    cudaCheck(cudaEventCreateWithFlags(&r->legacy_done, cudaEventDisableTiming));
}

static inline void step_destroy(Run *r) {
    if (r->graph) cudaCheck(cudaGraphExecDestroy(r->graph));
    cudaCheck(cudaEventDestroy(r->legacy_done));
    cudaCheck(cudaStreamDestroy(r->stream));
    void *bufs[] = {r->io.tokens, r->io.targets, r->io.plan, r->io.coeffs, r->io.loss, r->io.norm};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaCheck(cudaFreeHost(bufs[i]));
}

// The next training micro-batch into slot k of the step's inputs, with its plan for the backward.
static inline void next_micro_batch(Run *r, int k) {
    char err[DATA_ERR_LEN];
    if (dataloader_next_batch(&r->train, r->batch, err)) sdm_die("%s", err);
    size_t n = (size_t)r->g.n;
    int *tokens = r->io.tokens + k * n;
    batch_split(r->batch, r->g.B, r->g.T, tokens, r->io.targets + k * n);
    gpu_model_plan_backward(&r->g, tokens, r->io.plan + k * gpu_model_plan_ints(&r->g));
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
    // max_vocab: shards with a larger vocabulary are refused, so every token the GPU embedding reads is in range
    if (dataloader_open(&r->train, train, c->batch_size, c->seq_len, r->dist.rank, r->dist.world, (uint64_t)c->seed, 1,
                        (uint32_t)c->vocab_size, err))
        sdm_die("%s", err);
    if (dataloader_open(&r->val, val, c->batch_size, c->seq_len, r->dist.rank, r->dist.world, (uint64_t)c->seed, 0,
                        (uint32_t)c->vocab_size, err))
        sdm_die("%s", err);
}

// This rank's shard of a host fp32 array, host [hi - lo] holding elements [lo, hi) of the flat [m->storage] one
// (core/shard.h shard_range), into a device array of the optimizer [shard] of dtype t (its padding stays 0), piece by
// piece through the staging buffer, converted there (bf16 moments: rounded to nearest even, so a value that came
// from bf16 is restored exactly).
static inline void upload_shard(const Run *r, void *dev, Dtype t, const float *host) {
    long long lo, hi;
    shard_range(r->m->storage, r->dist.world, r->dist.rank, &lo, &hi);
    device_upload_fp32_as(dev, t, host, hi - lo, (long long)(MEM_STAGE_BYTES / sizeof(float)));
}

// The master weights of this rank's shard from host fp32 [m->storage], and the model's whole working copy from the
// same values.
static inline void set_params(Run *r, const float *host) {
    long long lo, hi;
    shard_range(r->m->storage, r->dist.world, r->dist.rank, &lo, &hi);
    upload_shard(r, r->opt.master, DT_FP32, host + lo);
    gpu_model_set_params(&r->g, host);
}

// The elements [lo, hi) of the model's working copy from host fp32 x [hi - lo] (hi <= m->storage), converted to its
// dtype through the staging buffer: a resume's pieces as they arrive (model/checkpoint.h CkptSink). The conversion is
// elementwise, so piece by piece gives the bits gpu_model_set_params gives; the padding beyond m->storage keeps the
// zeros init_params wrote.
static void take_params_piece(void *ctx, long long lo, long long hi, const float *x) {
    GpuModel *g = &((Run *)ctx)->g;
    device_upload_fp32_as((char *)g->work + lo * g->es, g->ctype, x, hi - lo, (long long)(MEM_STAGE_BYTES / 4));
}

// Initial weights (docs/MODEL.md#initialisation), the same on every rank.
static inline void init_params(Run *r) {
    const ModelDesc *m = r->m;
    float *host = (float *)sdm_malloc(sizeof(float) * (size_t)m->storage);
    model_init_all(m, (unsigned long long)r->cfg.seed, host, (int)sysconf(_SC_NPROCESSORS_ONLN));
    set_params(r, host);
    free(host);
}

// Parts of the step profile outside the model (model/gpu_model.cuh names the others). AdamW reads the fp32 weight and
// gradient and m, v (of `ms` bytes each) of a parameter and writes weight, m, v and the working copy.
#define STEP_PART_OPTIM "optimizer"
#define STEP_PART_COMM "communication"
#define ADAMW_BYTES_PER_PARAM(ms) (3 * 4 + 4 * (ms))

// The host's part of a step, before it runs: the next micro-batches with their plans, and this step's AdamW
// coefficients (core/optim.h adamw_hyper), into the pinned inputs.
static inline void prepare_step(Run *r) {
    for (int k = 0; k < r->cfg.grad_acc_steps; k++) next_micro_batch(r, k);
    AdamWHyper hyper = adamw_hyper(&r->cfg, r->step);
    adamw_coeffs_fill(r->io.coeffs, &hyper);
    r->lr = hyper.lr;
}

// One optimizer step on the step's stream, from its pinned inputs to its pinned outputs (r->io): grad_acc_steps
// micro-batches forward and backward, the gradients summed over ranks into each rank's shard (ZeRO-2: by the
// backward, block by block; ZeRO-1: reduce-scattered afterwards), the global norm clipped, AdamW on this rank's shard
// (the optimizer holds only that), the updated weights all-gathered. Launches and copies only, no host
// synchronisation: the eager step, and what distributed.compile captures.
static inline void enqueue_step(Run *r) {
    GpuModel *g = &r->g;
    AdamWState *o = &r->opt;
    StepIO *io = &r->io;
    Dist *d = &r->dist;
    cudaStream_t s = r->stream;
    int acc = r->cfg.grad_acc_steps;
    size_t n = (size_t)g->n, plan = gpu_model_plan_ints(g);
    prof_mark(r->prof, GM_PART_HOST, PROF_NA, PROF_NA, s); // since the step began: prepare_step on the host
    cudaCheck(cudaMemsetAsync(g->grads, 0, sizeof(float) * g->n_grads, s));
    prof_mark(r->prof, STEP_PART_OPTIM, 0, 4.0 * g->n_grads, s);
    for (int k = 0; k < acc; k++) {
        gpu_model_forward(g, io->tokens + k * n, io->targets + k * n, 1.0f / ((float)g->n * acc * d->world), s);
        gpu_model_backward(g, io->plan + k * plan, s);
        cudaCheck(cudaMemcpyAsync(io->loss + k, g->loss, sizeof(float), cudaMemcpyDeviceToHost, s));
    }
    long long lo, hi; // this rank's elements of the flat array: element lo is element 0 of the optimizer's arrays
    shard_range(r->m->storage, d->world, d->rank, &lo, &hi);
    const float *grad = g->grads; // element lo's gradient, summed over ranks
    if (!g->zero2.dist) {         // whole gradients
        dist_reduce_scatter_grads(d, g->grads, s);
        prof_mark(r->prof, STEP_PART_COMM, PROF_NA, PROF_NA, s);
        grad += lo;
    }
    adamw_grad_sumsq(o->sumsq, o->scratch, grad, hi - lo, s);
    prof_mark(r->prof, STEP_PART_OPTIM, 0, 4.0 * (hi - lo), s);
    dist_all_reduce_sum(d, o->sumsq, 1, s);
    prof_mark(r->prof, STEP_PART_COMM, PROF_NA, PROF_NA, s);
    adamw_clip_scale(o->norm, o->scale, o->sumsq, (float)r->cfg.clip, s);
    adamw_load_coeffs(o, io->coeffs, s);
    adamw_update_model(r->m, lo, hi, o->master, (char *)g->work + lo * g->es, g->ctype, grad, o->m, o->v,
                       o->moment_type, o->coeffs, o->scale, s);
    prof_mark(r->prof, STEP_PART_OPTIM, 0,
              (double)(hi - lo) * (ADAMW_BYTES_PER_PARAM(dtype_size(o->moment_type)) + g->es), s);
    dist_all_gather(d, g->work, g->es, s);
    prof_mark(r->prof, STEP_PART_COMM, PROF_NA, PROF_NA, s);
    cudaCheck(cudaMemcpyAsync(io->norm, o->norm, sizeof(float), cudaMemcpyDeviceToHost, s));
}

// distributed.compile captures the step on one rank. With several ranks it stays eager: capturing NCCL's collectives
// and ZeRO-2's bucket events, which link one step's reductions to the next step's backward, is not done (nor tested).
static inline int step_graph_wanted(const Run *r) { return r->cfg.compile && r->dist.world == 1; }

// How the step runs, for the start-up line.
static inline const char *step_mode(const Run *r) {
    if (!r->cfg.compile) return "eager step";
    if (!step_graph_wanted(r)) return "eager step (distributed.compile: not with several ranks yet)";
    return r->cfg.profile_steps ? "step as a CUDA graph after the profiled steps" : "step as a CUDA graph from step 2";
}

// Capture enqueue_step as a CUDA graph (relaxed mode, as infer's decode graph) to replay from now on.
static inline void capture_step(Run *r) {
    cudaGraph_t graph;
    cudaCheck(cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeRelaxed));
    enqueue_step(r);
    cudaCheck(cudaStreamEndCapture(r->stream, &graph));
    size_t nodes = 0;
    cudaCheck(cudaGraphGetNodes(graph, NULL, &nodes));
    cudaCheck(cudaGraphInstantiate(&r->graph, graph, 0));
    cudaCheck(cudaGraphDestroy(graph));
    say(r, "the training step is captured as a CUDA graph of %zu nodes at step %lld, replayed from here on\n", nodes,
        r->step + 1);
}

// One optimizer step (enqueue_step): eager, or a replay of its graph with distributed.compile, captured at the first
// step after one eager step of this run (cuBLASLt's first calls and every lazy allocation happen outside the capture)
// and after the profiled steps (the profiler records events, which a graph cannot time). Returns the mean loss and
// leaves the gradient norm in r->norm. `done`: steps this run has taken.
static inline float train_step(Run *r, long long done) {
    int acc = r->cfg.grad_acc_steps;
    prepare_step(r);
    // the step's stream is non-blocking: it waits for what the legacy stream has queued (weights uploaded at start or
    // resume, a checkpoint's gather of the optimizer state); the synchronisation at the end orders what comes after
    cudaCheck(cudaEventRecord(r->legacy_done, 0));
    cudaCheck(cudaStreamWaitEvent(r->stream, r->legacy_done, 0));
    if (!r->graph && step_graph_wanted(r) && done >= 1 && !r->prof) capture_step(r);
    if (r->graph) cudaCheck(cudaGraphLaunch(r->graph, r->stream));
    else enqueue_step(r);
    cudaCheck(cudaStreamSynchronize(r->stream));
    float loss = 0;
    for (int k = 0; k < acc; k++) loss += r->io.loss[k] / acc;
    r->norm = *r->io.norm;
    r->step++;
    return loss;
}

// The step profile (logging.profile = N, docs/MODEL.md#step-profile): the first PROFILE_WARMUP steps of the run
// are recorded and forgotten, the next N are timed by part; then the table is printed and the profiler removed.
#define PROFILE_WARMUP 2

static inline void profile_start(Run *r) {
    if (!r->cfg.profile_steps || r->dist.rank != 0) return;
    r->prof = prof_create(r->cfg.peak_tflops, r->cfg.hbm_tbps);
    gpu_model_set_profiler(&r->g, r->prof);
}

static inline void profile_finish(Run *r) {
    prof_print(&r->prof->table, stdout);
    if (r->log) prof_print(&r->prof->table, r->log);
    fflush(stdout);
    gpu_model_set_profiler(&r->g, NULL);
    prof_destroy(r->prof);
    r->prof = NULL;
}

// train_step, profiled while the run is in its profile window; `done`: steps this run has taken so far.
static inline float train_step_profiled(Run *r, long long done) {
    prof_step_begin(r->prof, r->stream);
    float loss = train_step(r, done);
    prof_step_end(r->prof, done >= PROFILE_WARMUP);
    if (r->prof && done + 1 == PROFILE_WARMUP + r->cfg.profile_steps) profile_finish(r);
    return loss;
}

// Model FLOPs utilisation at `tokens_per_s` over all ranks, against logging.peak_tflops per GPU.
static inline double mfu(const Run *r, double tokens_per_s) {
    return r->flops_per_token * tokens_per_s / (r->dist.world * r->cfg.peak_tflops * 1e12);
}

// Mean loss over ranks of a host value, through the device (the optimizer's sumsq scalar, free between steps).
static inline float mean_over_ranks(Run *r, float x) {
    if (r->dist.world == 1) return x;
    cudaCheck(cudaMemcpy(r->opt.sumsq, &x, sizeof x, cudaMemcpyHostToDevice));
    dist_all_reduce_sum(&r->dist, r->opt.sumsq, 1, 0);
    cudaCheck(cudaMemcpy(&x, r->opt.sumsq, sizeof x, cudaMemcpyDeviceToHost));
    return x / r->dist.world;
}

// Validation loss over eval.steps batches (mean over ranks); on rank 0's batches also the loss by position and the
// recall accuracy by gap of the greedy predictions for eval.task, printed and appended to run_dir/eval_*.tsv.
static inline void evaluate(Run *r) {
    EvalStats s;
    eval_stats_init(&s, r->cfg.eval_task, r->g.T);
    dataloader_reset(&r->val);
    int batches = (int)SDM_MIN((uint64_t)r->cfg.eval_steps, dataloader_batches_per_epoch(&r->val));
    char err[DATA_ERR_LEN];
    for (int k = 0; k < batches; k++) {
        if (dataloader_next_batch(&r->val, r->batch, err)) sdm_die("%s", err);
        eval_batch(&r->g, r->batch, r->inputs, r->targets, &s);
    }
    float val = mean_over_ranks(r, (float)eval_mean_loss(&s));
    say(r, "eval step %lld | val loss %.4f over %d batches\n", r->step, val, batches);
    if (r->dist.rank == 0) eval_report(&s, r->step, r->cfg.run_dir, r->log);
}

// An optimizer array, of which every rank holds its shard `dev` [shard] of dtype t, whole in fp32 on rank 0's host:
// returns the malloc'ed [m->storage] there, NULL on the other ranks. Piece by piece (core/shard.h) through a staging
// buffer, so no rank needs a whole-array device buffer: the piece's owner converts it to fp32 there (exact from bf16)
// and broadcasts it, rank 0 copies it out.
static inline float *gather_to_rank0(Run *r, const void *dev, Dtype t) {
    Dist *d = &r->dist;
    long long piece = SDM_MIN((long long)(MEM_STAGE_BYTES / sizeof(float)), d->shard);
    float *stage = (float *)device_alloc(MEM_STAGING, sizeof(float) * piece);
    float *host = d->rank == 0 ? (float *)sdm_malloc(sizeof(float) * (size_t)d->n) : NULL;
    ShardPiece p;
    for (long long lo = 0; lo < d->n; lo = p.hi) {
        p = shard_piece_at(d->n, d->world, piece, lo);
        size_t bytes = sizeof(float) * (size_t)(p.hi - p.lo);
        if (d->rank == p.owner) dtype_convert(stage, DT_FP32, dtype_elem_ptr(dev, p.at, t), t, p.hi - p.lo, 0);
        dist_broadcast(d, stage, bytes, p.owner, 0);
        if (host) cudaCheck(cudaMemcpy(host + p.lo, stage, bytes, cudaMemcpyDeviceToHost)); // waits for it
    }
    device_free(stage);
    return host;
}

// Gather the sharded state to rank 0 and write a checkpoint there (moments in fp32 whatever optim.moment_dtype, so
// a run resumes under either setting).
static inline void save_checkpoint(Run *r) {
    AdamWState *o = &r->opt;
    float *p = gather_to_rank0(r, o->master, DT_FP32), *mm = gather_to_rank0(r, o->m, o->moment_type);
    float *vv = gather_to_rank0(r, o->v, o->moment_type);
    if (r->dist.rank != 0) return;
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

// The collectives of model/checkpoint.h's CkptComm over this run's ranks, through the device (no-ops on one rank).
static void run_broadcast0(void *ctx, void *buf, size_t bytes) { dist_broadcast_host((Dist *)ctx, buf, bytes, 0); }

static void run_sum(void *ctx, float *x, size_t n) {
    Dist *d = (Dist *)ctx;
    if (d->world == 1) return;
    float *dev = (float *)device_alloc(MEM_SCRATCH, sizeof(float) * n);
    cudaCheck(cudaMemcpy(dev, x, sizeof(float) * n, cudaMemcpyHostToDevice));
    dist_all_reduce_sum(d, dev, n, 0);
    cudaCheck(cudaMemcpy(x, dev, sizeof(float) * n, cudaMemcpyDeviceToHost)); // legacy default stream: waits
    device_free(dev);
}

// Continue from the newest complete checkpoint of rank 0's run_dir, if any, on every rank: rank 0 loads it and sends
// it to the others; a rank configured for another model or another run (any key but the per-rank ones of
// model/checkpoint.h CKPT_RANK_LOCAL_KEYS, checked whether or not there is a checkpoint), or a checkpoint rank 0
// cannot load, stops every rank (model/checkpoint.h).
static inline void resume(Run *r) {
    CkptComm comm = {r->dist.rank, r->dist.world, &r->dist, run_broadcast0, run_sum, 0};
    CkptSink sink = {r, take_params_piece}; // the working copy, whole on every rank, as the pieces arrive
    CkptResume cr;
    DataLoaderState ls;
    char err[CKPT_ERR], derr[DATA_ERR_LEN];
    if (!ckpt_resume_all_ranks(r->cfg.run_dir, &r->cfg, r->m, &ls, sizeof ls, &comm, &sink, &cr, err))
        sdm_die("%s", err);
    if (!cr.id.found) return;
    int ok = dataloader_set_state(&r->train, &ls, derr) == 0;
    if (!ok)
        snprintf(err, sizeof err, "%.300s/step_%08llu/state.bin: %.300s", r->cfg.run_dir,
                 (unsigned long long)cr.id.step, derr);
    if (!ckpt_all_ranks_ok(&comm, ok, "cannot restore the dataloader position", err)) sdm_die("%s", err);
    upload_shard(r, r->opt.master, DT_FP32, cr.params); // the shards ckpt_resume_all_ranks kept
    upload_shard(r, r->opt.m, r->opt.moment_type, cr.adam_m);
    upload_shard(r, r->opt.v, r->opt.moment_type, cr.adam_v);
    r->step = (long long)cr.id.step;
    say(r, "resumed from %s/step_%08lld at step %lld\n", r->cfg.run_dir, r->step, r->step);
    ckpt_resume_free(&cr);
}

// Rank 0 prepares run_dir before anything else can fail late: the folder (checkpoint.h), train.log, config.cfg.
static inline void open_run_dir(Run *r) {
    const Config *c = &r->cfg;
    char path[CFG_STR + 32], err[CKPT_ERR];
    if (!ckpt_prepare_run_dir(c->run_dir, err)) sdm_die("%s", err);
    snprintf(path, sizeof path, "%s/train.log", c->run_dir);
    if (!(r->log = fopen(path, "a"))) sdm_die("%s: cannot append: %s", path, strerror(errno));
    snprintf(path, sizeof path, "%s/config.cfg", c->run_dir);
    FILE *fp = fopen(path, "w");
    int ok = fp != NULL;
    if (fp) {
        cfg_dump(c, fp);
        ok = !ferror(fp);
        ok &= fclose(fp) == 0;
    }
    if (!ok) sdm_die("%s: cannot write: %s", path, strerror(errno));
}

// A stop signal on any rank (core/stop_signal.h) stops every rank after the same step.
static inline int stop_requested(Run *r) {
    float stop = (float)(stop_signal_received() != 0);
    run_sum(&r->dist, &stop, 1);
    return stop > 0;
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
static inline Dtype moment_dtype(const Config *c) { return !strcmp(c->moment_dtype, "bf16") ? DT_BF16 : DT_FP32; }

// What the backward recomputes (model/gpu_model.cuh GM_RECOMPUTE flags).
static inline int recompute_flags(const Config *c) {
    return (c->selective_act_ckpt ? GM_RECOMPUTE : 0) | (c->recompute_ffn ? GM_RECOMPUTE_FFN : 0);
}

static inline const char *recompute_name(const Config *c) {
    return c->recompute_ffn ? (c->selective_act_ckpt ? "on, FFN W1|W3 too" : "FFN W1|W3 only")
                            : c->selective_act_ckpt ? "on" : "off";
}

// ZeRO-2 (sharded gradients) on several ranks unless distributed.fsdp_type = no_shard (ZeRO-1: whole gradients).
static inline int zero2(const Config *c, int world) { return world > 1 && strcmp(c->fsdp_type, "no_shard") != 0; }

// --memory: the ledger of a dry-run model (every allocation recorded, none made) for `world` ranks.
static int print_memory(const Config *c, const ModelDesc *m, int world) {
    g_mem.dry_run = 1;
    GpuModel g;
    Dist layout = dist_layout(0, world, m->storage);
    gpu_model_create(&g, m, c->batch_size, c->seq_len, compute_dtype(c), world, recompute_flags(c),
                     zero2(c, world) ? &layout : NULL);
    AdamWState opt;
    adamw_state_create(&opt, shard_size(m->storage, world), moment_dtype(c));
    char title[4 * CFG_STR];
    snprintf(title, sizeof title,
             "device memory per GPU: %s, micro-batch %d x %d, %s, %d rank%s, recompute %s, AdamW m, v %s", c->name,
             c->batch_size, c->seq_len, c->model_dtype, world, world > 1 ? "s" : "", recompute_name(c),
             c->moment_dtype);
    mem_print(stdout, title);
    printf("  (not in a dry run: the CUDA context and NCCL's buffers, measured at start-up of a real run)\n");
    if (zero2(c, world))
        printf("  (ZeRO-2: the fp32 master weights, AdamW m, v and gradients are each rank's shard, 1/%d of the\n"
               "   padded array; the gradients add the buckets the backward computes them in, model/grad_buckets.h)\n",
               world);
    else if (world > 1)
        printf("  (ZeRO-1: the fp32 master weights and AdamW m, v are each rank's shard, 1/%d of the padded array)\n",
               world);
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
    stop_signal_install();

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
    if (boot.rank == 0) open_run_dir(&r);
    cuda_require_gpu();
    dist_init(&r.dist, &boot, r.m->storage, c->dist_timeout);
    if (r.dist.rank == 0) model_print_summary(r.m, c, stdout);
    char unimplemented[512];
    cfg_unimplemented(c, unimplemented, sizeof unimplemented);
    if (unimplemented[0]) say(&r, "note: accepted but not implemented yet (no effect on results): %s\n", unimplemented);
    say(&r, "ranks %d | micro-batch %d x %d tokens | %s | %s\n", r.dist.world, c->batch_size, c->seq_len,
        c->model_dtype, step_mode(&r));
    if (r.dist.world > 1 && c->dist_timeout)
        say(&r, "watchdog: a lost NCCL peer, or a rank %d s without reaching a collective, ends the run\n",
            c->dist_timeout);
    else if (r.dist.world > 1)
        say(&r, "watchdog: a lost NCCL peer ends the run (distributed.timeout = 0: no time limit)\n");

    // 2. data, the model on the GPU, its initial or resumed state
    open_data(&r);
    r.batch = (int32_t *)sdm_malloc(sizeof(int32_t) * c->batch_size * (c->seq_len + 1));
    r.inputs = (int *)sdm_malloc(sizeof(int) * c->batch_size * c->seq_len);
    r.targets = (int *)sdm_malloc(sizeof(int) * c->batch_size * c->seq_len);
    gpu_model_create(&r.g, r.m, c->batch_size, c->seq_len, compute_dtype(c), r.dist.world, recompute_flags(c),
                     zero2(c, r.dist.world) ? &r.dist : NULL);
    adamw_state_create(&r.opt, r.dist.shard, moment_dtype(c));
    step_create(&r);
    if (r.dist.rank == 0) {
        const char *title = "device memory per GPU (ledger; the step line shows the measured peak):";
        mem_print(stdout, title);
        if (r.log) mem_print(r.log, title);
    }
    init_params(&r);
    resume(&r);
    r.flops_per_token = model_flops_per_token(r.m, c->seq_len);
    say(&r, "model FLOPs per token %.3f GFLOP (docs/MODEL.md#model-flops); MFU against %.0f TFLOP/s per GPU\n",
        r.flops_per_token / 1e9, c->peak_tflops);
    profile_start(&r);

    // 3. train
    double t0 = sdm_now_s(), t_log = t0;
    long long first_step = r.step;
    long long tokens_per_step = (long long)c->batch_size * c->seq_len * c->grad_acc_steps * r.dist.world;
    size_t peak_used = 0; // device bytes in use at a logged step: allocation is static after step 1, so the peak
    while (r.step < c->steps) {
        float loss = mean_over_ranks(&r, train_step_profiled(&r, r.step - first_step));
        dist_progress(&r.dist, "finished step", r.step);
        float norm = r.norm;
        if (!isfinite(loss) || !isfinite(norm)) // the same on every rank, so every rank stops here
            sdm_die("step %lld: the %s is %g; stopping without writing a checkpoint (those in %s are intact)", r.step,
                    isfinite(loss) ? "gradient norm" : "loss", isfinite(loss) ? norm : loss, c->run_dir);
        if (r.step % c->log_freq == 0 || r.step == c->steps) {
            double t = sdm_now_s(), per_step = (t - t_log) / (r.step % c->log_freq ? r.step % c->log_freq : c->log_freq);
            t_log = t;
            peak_used = SDM_MAX(peak_used, device_used_bytes()); // measured at log steps only: off the hot path
            double tokens_per_s = tokens_per_step / per_step;
            say(&r, "step %6lld/%d | loss %.4f | lr %.3e | grad norm %.3f | %.1f ms/step | %.0f tok/s | MFU %.1f%% | "
                "peak %.2f GiB\n", r.step, c->steps, loss, r.lr, norm, 1e3 * per_step, tokens_per_s,
                100 * mfu(&r, tokens_per_s), mem_gib(peak_used));
        }
        if ((c->eval_every && r.step % c->eval_every == 0) || (c->probe_freq && r.step % c->probe_freq == 0))
            evaluate(&r);
        if (c->dump_every && r.step % c->dump_every == 0) save_checkpoint(&r);
        if (r.step < c->steps && stop_requested(&r)) {
            say(&r, "stop signal: stopping after step %lld%s\n", r.step,
                c->dump_every ? "" : " (checkpoint.dump_every = 0: no checkpoint)");
            break;
        }
    }
    if (r.prof) profile_finish(&r); // the run ended inside the profile window: the steps profiled so far
    if (r.step > first_step && c->dump_every && r.step % c->dump_every) save_checkpoint(&r); // the final state
    say(&r, "done: %lld steps in %.1f s\n", r.step, sdm_now_s() - t0);

    step_destroy(&r);
    adamw_state_destroy(&r.opt);
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
