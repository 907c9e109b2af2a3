// model/evaluate.cuh: evaluation of a GPU model on token rows: the mean loss, the loss by position in the row, and
// the recall accuracy by gap of the greedy predictions for the synthetic tasks (data/eval_stats.h,
// data/synthetic.h). train_sdm evaluates every checkpoint.eval_every steps; infer_sdm --eval any checkpoint.
//
//   EvalStats s;  eval_stats_init(&s, task, T);
//   for each batch of rows [B, T+1]:  eval_batch(g, rows, inputs, targets, &s);
//   eval_report(&s, step, dir, log);      prints the tables and appends dir/eval_positions.tsv, dir/eval_recall.tsv
//
// task (eval.task): auto scores every task whose answers are in the data, none scores no task (loss only), or the
// name of one task of EVAL_TASKS.
#ifndef SDM_MODEL_EVALUATE_CUH
#define SDM_MODEL_EVALUATE_CUH

#include "data/eval_stats.h"
#include "data/synthetic.h"
#include "model/gpu_model.cuh"

typedef struct {
    const char *task;                // eval.task
    int batches;                     // batches added
    double loss_sum;                 // sum over batches of the batch's mean loss
    PositionLoss pos;                // per-token losses by position in the row
    GapScore score[EVAL_NUM_TASKS];  // per task, answers by gap
} EvalStats;

// inputs[b, t] = rows[b][t], targets[b, t] = rows[b][t+1]; rows [B, T+1] -> inputs, targets [B, T]
static inline void batch_split(const int32_t *rows, int B, int T, int *inputs, int *targets) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            inputs[b * T + t] = rows[(size_t)b * (T + 1) + t];
            targets[b * T + t] = rows[(size_t)b * (T + 1) + t + 1];
        }
}

static inline void eval_stats_init(EvalStats *s, const char *task, int T) {
    memset(s, 0, sizeof *s);
    s->task = task;
    position_loss_init(&s->pos, T);
    for (int k = 0; k < EVAL_NUM_TASKS; k++) EVAL_TASKS[k].init(&s->score[k]);
}

// Whether task k is scored: asked for by name, or (auto) any task.
static inline int eval_scores_task(const EvalStats *s, int k) {
    return !strcmp(s->task, "auto") || !strcmp(s->task, EVAL_TASKS[k].name);
}

// One batch of rows [B, T+1] (B, T of the model): forward, per-token losses, greedy predictions scored, eagerly on
// the legacy stream (its copies wait for the results). inputs, targets: host scratch of B*T ints each.
static inline void eval_batch(GpuModel *g, const int32_t *rows, int *inputs, int *targets, EvalStats *s) {
    batch_split(rows, g->B, g->T, inputs, targets);
    gpu_model_forward(g, inputs, targets, 0.0f, 0);
    s->loss_sum += gpu_model_loss(g);
    s->batches++;
    float *losses = (float *)sdm_malloc(sizeof(float) * g->n);  // [B, T]
    cudaCheck(cudaMemcpy(losses, g->losses, sizeof(float) * g->n, cudaMemcpyDeviceToHost));
    position_loss_add(&s->pos, losses, g->B);
    free(losses);
    if (!strcmp(s->task, "none")) return;
    int *pred = (int *)sdm_malloc(sizeof(int) * g->n);  // [B, T]
    gpu_model_argmax(g);
    cudaCheck(cudaMemcpy(pred, g->pred, sizeof(int) * g->n, cudaMemcpyDeviceToHost));
    for (int k = 0; k < EVAL_NUM_TASKS; k++) {
        if (!eval_scores_task(s, k)) continue;
        for (int b = 0; b < g->B; b++)
            EVAL_TASKS[k].score_row(&s->score[k], rows + (size_t)b * (g->T + 1), pred + (size_t)b * g->T, g->T);
    }
    free(pred);
}

static inline double eval_mean_loss(const EvalStats *s) { return s->batches ? s->loss_sum / s->batches : 0.0; }

// dir/name opened for appending, or NULL with a warning (the tables are printed anyway); dir NULL: no file.
static inline FILE *eval_open_tsv(const char *dir, const char *name) {
    if (!dir) return NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "a");
    if (!f) fprintf(stderr, "warning: cannot append to %s\n", path);
    return f;
}

// The loss by position and every scored task's accuracy by gap: printed to stdout (and log, when not NULL) and
// appended, tagged with step, to dir/eval_positions.tsv and dir/eval_recall.tsv (dir NULL: printed only).
// A task is reported when asked for by name, or (auto) when the data held its queries.
static inline void eval_report(const EvalStats *s, long long step, const char *dir, FILE *log) {
    position_loss_print(&s->pos, stdout);
    if (log) position_loss_print(&s->pos, log);
    FILE *pos_tsv = eval_open_tsv(dir, "eval_positions.tsv"), *gap_tsv = NULL;
    if (pos_tsv) { position_loss_tsv(&s->pos, step, pos_tsv); fclose(pos_tsv); }
    for (int k = 0; k < EVAL_NUM_TASKS; k++) {
        const GapScore *sc = &s->score[k];
        uint64_t q, exact, tokens, right;
        gap_score_totals(sc, &q, &exact, &tokens, &right);
        if (!eval_scores_task(s, k) || !strcmp(s->task, "none") ||
            (!strcmp(s->task, "auto") && q == 0 && sc->unanswerable == 0))
            continue;
        char line[256];
        snprintf(line, sizeof line, "%s: %llu queries, token acc %.4f, exact %.4f\n", EVAL_TASKS[k].name,
                 (unsigned long long)q, tokens ? (double)right / tokens : 0.0, q ? (double)exact / q : 0.0);
        fputs(line, stdout);
        gap_score_print(sc, EVAL_TASKS[k].name, stdout);
        if (log) { fputs(line, log); gap_score_print(sc, EVAL_TASKS[k].name, log); }
        if (!gap_tsv) gap_tsv = eval_open_tsv(dir, "eval_recall.tsv");
        if (gap_tsv) gap_score_tsv(sc, step, EVAL_TASKS[k].name, gap_tsv);
    }
    if (gap_tsv) fclose(gap_tsv);
    fflush(stdout);
    if (log) fflush(log);
}

#endif  // SDM_MODEL_EVALUATE_CUH
