// tests/gpu_test_train.cu: train_sdm end to end on a tiny model, as a user runs it (README.md#checkpoints):
//   (a) SIGTERM during training: the step under way finishes, its checkpoint is written, the exit status is 0;
//   (b) a restart with the same run_dir resumes from that checkpoint and goes on;
//   (c) a restart with another architecture key is refused, naming the key with both values;
//   (d) with bf16 AdamW moments (optim.moment_dtype) the checkpoint holds them in fp32, every one a bf16 value; a run
//       resumed from it continues bit for bit as the uninterrupted run, and one with fp32 moments resumes from it too;
//   (e) distributed.compile: on a hybrid of full attention, SWA and SDM, with 1 and 2 micro-batches a step and
//       evaluations between the steps, the run whose step is replayed from a CUDA graph (captured at step 2, or after
//       the profiled steps) prints the eager run's losses and writes its checkpoint bit for bit.
// (A second signal's immediate exit is tested in tests/test_stop_signal.c: here it would race the checkpoint.)
// Needs ./train_sdm (make train_sdm); run from the repository root. The embedded dataset is generated on first use.
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "model/checkpoint.h"
#include "tests/test.h"

static const char *TINY = "model.dim=128 model.n_layers=2 model.n_heads=2 model.multiple_of=32 model.attn_at=0 "
                          "model.sdm_at=1 sdm.num_heads=2 sdm.slots_per_head=64 sdm.num_writes=4 sdm.num_reads=3 "
                          "sdm.chunk_size=8 data.seq_len=32 data.batch_size=2 checkpoint.eval_every=0 "
                          "logging.freq=1 optim.warmup=10";

// (e)'s model: a layer of each mixer kind (TINY's attention and SDM layers moved, an SWA layer between them).
static const char *HYBRID = "model.n_layers=3 model.attn_at=0 model.swa_at=1 model.sdm_at=2 model.swa_window=8 "
                            "model.swa_n_heads=2 model.swa_n_kv_heads=1 model.swa_head_dim=64";

// A started train_sdm: its pid, and its wait status once it has ended.
typedef struct { pid_t pid; int ended, status; } Proc;

// ./train_sdm with TINY, run_dir and extra arguments, output into log (exec'ed by the shell: the pid is its own).
static Proc start(const char *run_dir, const char *extra, const char *log) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "exec ./train_sdm %s run_dir=%s %s > %s 2>&1", TINY, run_dir, extra, log);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    Proc p = {pid, 0, 0};
    return p;
}

// The whole file (malloc'ed, NUL-terminated; empty when missing).
static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    size_t cap = 1 << 20, len = 0;
    char *buf = (char *)sdm_malloc(cap);
    if (f) {
        len = fread(buf, 1, cap - 1, f);
        fclose(f);
    }
    buf[len] = 0;
    return buf;
}

// Wait until log contains text (1) or the process ends or timeout_s seconds pass (0).
static int wait_for(Proc *p, const char *log, const char *text, int timeout_s) {
    for (int i = 0; i < timeout_s * 10; i++) {
        char *s = slurp(log);
        int found = strstr(s, text) != NULL;
        free(s);
        if (found) return 1;
        if (waitpid(p->pid, &p->status, WNOHANG) == p->pid) { p->ended = 1; return 0; }
        usleep(100000);
    }
    return 0;
}

static int exit_status(Proc *p) {
    if (!p->ended) waitpid(p->pid, &p->status, 0);
    p->ended = 1;
    return WIFEXITED(p->status) ? WEXITSTATUS(p->status) : 1000 + WTERMSIG(p->status);
}

// Run to completion; returns the exit status, the output in *out (malloc'ed).
static int run(const char *run_dir, const char *extra, const char *log, char **out) {
    Proc p = start(run_dir, extra, log);
    int status = exit_status(&p);
    *out = slurp(log);
    return status;
}

// Counts the AdamW moments of a checkpoint's state.bin (model/checkpoint.h: header, m, v, loader record) that are not
// 0 and those that are not bf16 values (fp32 bits below bf16's set); 0 when the file cannot be read.
static int count_moments(const char *step_dir, long long *nonzero, long long *not_bf16) {
    char path[256];
    snprintf(path, sizeof path, "%s/state.bin", step_dir);
    FILE *f = fopen(path, "rb");
    CkptHeader h;
    int ok = f && fread(&h, sizeof h, 1, f) == 1;
    *nonzero = *not_bf16 = 0;
    for (uint64_t i = 0; ok && i < 2 * h.n_params; i++) {
        uint32_t bits;
        ok = fread(&bits, sizeof bits, 1, f) == 1;
        *nonzero += (bits & 0x7FFFFFFFu) != 0;
        *not_bf16 += (bits & 0xFFFFu) != 0;
    }
    if (f) fclose(f);
    return ok;
}

// The two files exist and have the same bytes.
static int same_file(const char *a, const char *b) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "cmp -s %s %s", a, b);
    return system(cmd) == 0;
}

// The lines of a run's output that must not depend on how its step runs, one per line (malloc'ed): every step line
// up to its timing (step, loss, lr, grad norm) and every evaluation's loss line. *steps: how many step lines.
static char *result_lines(const char *out, int *steps) {
    char *res = (char *)sdm_calloc(strlen(out) + 1, 1), *at = res;
    *steps = 0;
    for (const char *line = out; *line;) {
        const char *end = strchr(line, '\n');
        if (!end) end = line + strlen(line);
        const char *keep = line;
        if (!strncmp(line, "step ", 5)) {
            for (int bars = 0; keep < end && bars < 4; keep++) bars += *keep == '|';
            ++*steps;
        } else if (!strncmp(line, "eval step ", 10)) {
            keep = end;
        }
        memcpy(at, line, (size_t)(keep - line));
        at += keep - line;
        if (keep > line) *at++ = '\n';
        line = *end ? end + 1 : end;
    }
    return res;
}

// The parameters of two model.bin files are equal, bit for bit (the files differ in their config text).
static int same_params(const char *a, const char *b) {
    Config ca, cb;
    ModelDesc *ma = (ModelDesc *)sdm_malloc(sizeof(ModelDesc)), *mb = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    float *pa = NULL, *pb = NULL;
    uint64_t sa, sb;
    char err[CKPT_ERR];
    int same = ckpt_load_model(a, &ca, ma, &pa, &sa, err) && ckpt_load_model(b, &cb, mb, &pb, &sb, err) &&
               ma->storage == mb->storage && !memcmp(pa, pb, sizeof(float) * (size_t)ma->storage);
    free(pa);
    free(pb);
    free(ma);
    free(mb);
    return same;
}

// (e) at acc micro-batches a step: six steps eager, with the step captured at step 2, and captured after the two
// profiled steps that follow PROFILE_WARMUP's two (at step 5); evaluations at steps 2, 4 and 6 (between replays).
static void check_compile(const char *dir, const char *log, int acc) {
    const char *how[3] = {"distributed.compile=false", "distributed.compile=true",
                          "distributed.compile=true logging.profile=2"};
    const char *captured_at[3] = {NULL, "at step 2,", "at step 5,"};
    char run_dir[3][128], extra[512], path[2][160], *out[3], *lines[3];
    int status[3], steps[3];
    for (int k = 0; k < 3; k++) {
        snprintf(run_dir[k], sizeof run_dir[k], "%s/compile%d_acc%d", dir, k, acc);
        snprintf(extra, sizeof extra, "%s steps=6 checkpoint.dump_every=6 checkpoint.eval_every=2 eval.steps=2 "
                 "optim.grad_acc_steps=%d %s", HYBRID, acc, how[k]);
        status[k] = run(run_dir[k], extra, log, &out[k]);
        lines[k] = result_lines(out[k], &steps[k]);
    }
    for (int k = 1; k < 3; k++) {
        const char *capture = strstr(out[k], "the training step is captured as a CUDA graph");
        int captured = capture && strstr(capture, captured_at[k]) && !strstr(out[0], "captured as a CUDA graph");
        int same_lines = !strcmp(lines[0], lines[k]);
        snprintf(path[0], sizeof path[0], "%s/step_00000006/state.bin", run_dir[0]);
        snprintf(path[1], sizeof path[1], "%s/step_00000006/state.bin", run_dir[k]);
        int same_state = same_file(path[0], path[1]);
        snprintf(path[0], sizeof path[0], "%s/step_00000006/model.bin", run_dir[0]);
        snprintf(path[1], sizeof path[1], "%s/step_00000006/model.bin", run_dir[k]);
        int same_model = same_params(path[0], path[1]);
        printf("(e) %d micro-batch%s, %s: exit %d and %d, %s, %d and %d step lines %s, state.bin %s, weights %s\n",
               acc, acc > 1 ? "es" : "", how[k], status[0], status[k], captured ? "captured" : "NOT CAPTURED",
               steps[0], steps[k], same_lines ? "the same" : "DIFFER", same_state ? "the same" : "DIFFERS",
               same_model ? "the same" : "DIFFER");
        CHECK(status[0] == 0 && status[k] == 0 && captured && steps[0] == 6 && same_lines && same_state && same_model,
              "(e) %d micro-batches, %s against eager:\n%s\n--- eager:\n%s", acc, how[k], out[k], out[0]);
    }
    for (int k = 0; k < 3; k++) {
        free(out[k]);
        free(lines[k]);
    }
}

int main(void) {
    if (access("./train_sdm", X_OK) != 0) {
        CHECK(0, "./train_sdm not found: run `make train_sdm` and this test from the repository root");
        return test_summary();
    }
    char dir[] = "/tmp/gpu_test_train_XXXXXX", run_dir[128], log[128], extra[256];
    if (!mkdtemp(dir)) sdm_die("mkdtemp failed");
    snprintf(run_dir, sizeof run_dir, "%s/run", dir);
    snprintf(log, sizeof log, "%s/log", dir);

    // (a) SIGTERM after a few steps
    Proc p = start(run_dir, "steps=100000 checkpoint.dump_every=100000", log);
    int started = wait_for(&p, log, "step      3/", 300);
    CHECK(started, "(a) no third step line within 300 s");
    if (started) kill(p.pid, SIGTERM);
    int status = exit_status(&p);
    char *out = slurp(log), *stop = strstr(out, "stop signal: stopping after step ");
    long long n = stop ? atoll(stop + strlen("stop signal: stopping after step ")) : -1;
    uint64_t newest = 0;
    printf("(a) SIGTERM: exit %d, stopped after step %lld\n", status, n);
    CHECK(status == 0 && n >= 3, "(a) exit %d, stop line %s:\n%s", status, stop ? "found" : "missing", out);
    CHECK(ckpt_newest(run_dir, &newest) && (long long)newest == n, "(a) newest checkpoint %llu, want step %lld",
          (unsigned long long)newest, n);
    free(out);

    // (b) resume and go on two steps
    snprintf(extra, sizeof extra, "steps=%lld checkpoint.dump_every=100000", n + 2);
    status = run(run_dir, extra, log, &out);
    char want[128];
    snprintf(want, sizeof want, "at step %lld", n);
    printf("(b) resume: exit %d\n", status);
    CHECK(status == 0 && strstr(out, "resumed from") && strstr(out, want), "(b) exit %d:\n%s", status, out);
    CHECK(ckpt_newest(run_dir, &newest) && (long long)newest == n + 2, "(b) newest checkpoint %llu, want %lld",
          (unsigned long long)newest, n + 2);
    free(out);

    // (c) another architecture
    snprintf(extra, sizeof extra, "steps=%lld model.rope_theta=500000", n + 4);
    status = run(run_dir, extra, log, &out);
    printf("(c) another architecture: exit %d\n", status);
    CHECK(status == 1 && strstr(out, "model.rope_theta: saved 10000 vs requested 500000"), "(c) exit %d:\n%s", status,
          out);
    free(out);

    // (d) bf16 moments: 4 steps with checkpoints at 2 and 4; the same from a copy of step 2, under bf16 and fp32
    char bf16[128], again[128], fp32[128], ck[192], ck_again[192], cmd[1024];
    long long nonzero, not_bf16;
    snprintf(bf16, sizeof bf16, "%s/bf16", dir);
    snprintf(again, sizeof again, "%s/bf16_resumed", dir);
    snprintf(fp32, sizeof fp32, "%s/fp32_resumed", dir);
    status = run(bf16, "steps=4 checkpoint.dump_every=2 optim.moment_dtype=bf16", log, &out);
    snprintf(ck, sizeof ck, "%s/step_00000004", bf16);
    int readable = count_moments(ck, &nonzero, &not_bf16);
    printf("(d) bf16 moments: exit %d; step 4 holds %lld moments not 0, %lld not bf16 values\n", status, nonzero,
           not_bf16);
    CHECK(status == 0 && readable && nonzero > 0 && not_bf16 == 0,
          "(d) bf16 run: exit %d, %lld moments not 0, %lld not bf16 values:\n%s", status, nonzero, not_bf16, out);
    free(out);
    snprintf(cmd, sizeof cmd, "mkdir -p %s %s && cp -r %s/step_00000002 %s && cp -r %s/step_00000002 %s", again, fp32,
             bf16, again, bf16, fp32);
    CHECK(system(cmd) == 0, "(d) %s failed", cmd);
    status = run(again, "steps=4 checkpoint.dump_every=2 optim.moment_dtype=bf16", log, &out);
    snprintf(ck, sizeof ck, "%s/step_00000004/state.bin", bf16);
    snprintf(ck_again, sizeof ck_again, "%s/step_00000004/state.bin", again);
    int same = same_file(ck, ck_again);
    printf("(d) resumed at step 2 with bf16 moments: exit %d, step 4 state.bin %s\n", status,
           same ? "the same" : "DIFFERS");
    CHECK(status == 0 && strstr(out, "at step 2") && same, "(d) bf16 resume: exit %d, state %s:\n%s", status,
          same ? "same" : "differs", out);
    free(out);
    status = run(fp32, "steps=4 checkpoint.dump_every=2 optim.moment_dtype=fp32", log, &out);
    snprintf(ck, sizeof ck, "%s/step_00000004", fp32);
    readable = count_moments(ck, &nonzero, &not_bf16);
    printf("(d) resumed at step 2 with fp32 moments: exit %d; step 4 holds %lld moments not bf16 values\n", status,
           not_bf16);
    CHECK(status == 0 && strstr(out, "at step 2") && readable && not_bf16 > 0, "(d) fp32 resume: exit %d, %lld moments "
          "not bf16 values:\n%s", status, not_bf16, out);
    free(out);

    check_compile(dir, log, 1);
    check_compile(dir, log, 2);

    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) printf("note: could not remove %s\n", dir);
    return test_summary();
}
