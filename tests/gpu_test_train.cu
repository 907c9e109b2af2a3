// tests/gpu_test_train.cu: train_sdm end to end on a tiny model, as a user runs it (README.md#checkpoints):
//   (a) SIGTERM during training: the step under way finishes, its checkpoint is written, the exit status is 0;
//   (b) a restart with the same run_dir resumes from that checkpoint and goes on;
//   (c) a restart with another architecture key is refused, naming the key with both values.
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

    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) printf("note: could not remove %s\n", dir);
    return test_summary();
}
