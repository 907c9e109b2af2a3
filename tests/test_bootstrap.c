// tests/test_bootstrap.c: the NCCL-id exchange between processes, over TCP and through a file; its refusals of
// hostile or mistaken peers (garbage, silence, resets, wrong secret, world size or rank), its deadlines, and the strict
// parsing of the environment. Loopback only, small timeouts: the whole test takes about 10 s.
#include <signal.h>
#include <sys/wait.h>

#include "core/bootstrap.h"
#include "core/rng.h"
#include "tests/test.h"

static const char *SECRET = "0123456789abcdef0123456789abcdef";
static unsigned char g_id[BOOT_ID_BYTES]; // rank 0's id

typedef struct {
    int ok;
    char err[BOOT_ERR];
    unsigned char id[BOOT_ID_BYTES];
} Result;

typedef struct {
    pid_t pid;
    int fd;
} Proc;

static BootConfig config(int rank, int world, int port, const char *init_file) {
    BootConfig c;
    memset(&c, 0, sizeof c);
    c.rank = rank;
    c.world = world;
    c.master_port = port;
    c.timeout_s = 3;
    snprintf(c.master_addr, sizeof c.master_addr, "127.0.0.1");
    snprintf(c.init_file, sizeof c.init_file, "%s", init_file);
    snprintf(c.secret, sizeof c.secret, "%s", SECRET);
    return c;
}

// Run boot_exchange_id in a child; rank 0 offers g_id.
static Proc spawn(BootConfig c) {
    int p[2];
    if (pipe(p) != 0) sdm_die("pipe failed");
    pid_t pid = fork();
    if (pid == 0) {
        Result r;
        memset(&r, 0, sizeof r);
        if (c.rank == 0) memcpy(r.id, g_id, BOOT_ID_BYTES);
        r.ok = boot_exchange_id(&c, r.id, r.err);
        _exit(write(p[1], &r, sizeof r) == (ssize_t)sizeof r ? 0 : 3);
    }
    close(p[1]);
    Proc pr = {pid, p[0]};
    return pr;
}

static Result collect(Proc p) {
    Result r;
    memset(&r, 0, sizeof r);
    if (read(p.fd, &r, sizeof r) != (ssize_t)sizeof r) snprintf(r.err, sizeof r.err, "the child crashed");
    close(p.fd);
    waitpid(p.pid, NULL, 0);
    return r;
}

static int got_id(const Result *r) { return r->ok && memcmp(r->id, g_id, BOOT_ID_BYTES) == 0; }

// A raw client of rank 0, with `tries` connection attempts 100 ms apart: connect, send `n` bytes of msg (n < 0:
// reset the connection at once), and read what comes back within 5 s. Returns the number of bytes received (0:
// dropped without an answer), -1 if it cannot connect.
static int raw_client_tries(const char *ip, int port, const unsigned char *msg, int n, unsigned char *reply,
                            int tries) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    inet_pton(AF_INET, ip, &a.sin_addr);
    for (int i = 0; connect(fd, (struct sockaddr *)&a, sizeof a) != 0; i++) {
        close(fd);
        if (i + 1 == tries) return -1;
        fd = socket(AF_INET, SOCK_STREAM, 0);
        nanosleep(&BOOT_POLL, NULL);
    }
    if (n < 0) {
        struct linger l = {1, 0}; // close() sends RST
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        close(fd);
        return 0;
    }
    if (n > 0 && send(fd, msg, (size_t)n, MSG_NOSIGNAL) != n) { close(fd); return 0; }
    unsigned char buf[BOOT_MSG_BYTES];
    int got = boot_io(fd, reply ? reply : buf, 0, sdm_now_s() + 5) ? BOOT_MSG_BYTES : 0;
    close(fd);
    return got;
}

// Rank 0 may still be starting: 3 s of attempts.
static int raw_client(const char *ip, int port, const unsigned char *msg, int n, unsigned char *reply) {
    return raw_client_tries(ip, port, msg, n, reply, 30);
}

static int hello(unsigned char *out, int rank, int world, const char *secret) {
    BootConfig c = config(rank, world, 0, "");
    snprintf(c.secret, sizeof c.secret, "%s", secret);
    BootMsg m = boot_msg(&c, rank, NULL);
    boot_encode(&m, out);
    return BOOT_MSG_BYTES;
}

static void test_tcp(int port) {
    Proc p[4];
    for (int r = 0; r < 4; r++) p[r] = spawn(config(r, 4, port, ""));
    for (int r = 0; r < 4; r++) {
        Result res = collect(p[r]);
        CHECK(got_id(&res), "TCP world 4: rank %d has no id (%s)", r, res.err);
    }
}

// Hostile and mistaken clients against a rank 0 of world 3; then the real ranks 1 and 2 still join.
static void test_tcp_hostile(int port) {
    BootConfig c0 = config(0, 3, port, "");
    c0.timeout_s = 10; // the silent client alone takes BOOT_HELLO_S
    Proc root = spawn(c0);
    unsigned char msg[BOOT_MSG_BYTES], reply[BOOT_MSG_BYTES];
    memset(msg, 'x', sizeof msg);
    CHECK(raw_client("127.0.0.1", port, msg, sizeof msg, NULL) == 0, "garbage got an answer");
    CHECK(raw_client_tries("127.0.0.2", port, msg, 0, NULL, 1) == -1, "rank 0 listens beyond MASTER_ADDR 127.0.0.1");
    CHECK(raw_client("127.0.0.1", port, msg, -1, NULL) == 0, "reset");
    double t = sdm_now_s();
    CHECK(raw_client("127.0.0.1", port, msg, 0, NULL) == 0, "silence got an answer");
    CHECK(sdm_now_s() - t < BOOT_HELLO_S + 1.5, "a silent client held rank 0 for %.1f s", sdm_now_s() - t);
    CHECK(raw_client("127.0.0.1", port, msg, 10, NULL) == 0, "a short hello got an answer");
    CHECK(raw_client("127.0.0.1", port, msg, hello(msg, 1, 3, "another-run-secret-0000"), NULL) == 0,
          "a wrong secret got an answer");
    BootMsg m;
    const unsigned char zero[BOOT_ID_BYTES] = {0};
    int n = raw_client("127.0.0.1", port, msg, hello(msg, 1, 2, SECRET), reply);
    CHECK(n > 0 && boot_decode(&m, reply) && m.code == BOOT_BAD_WORLD && !memcmp(m.id, zero, sizeof zero),
          "another world size: no refusal, or an id");
    n = raw_client("127.0.0.1", port, msg, hello(msg, 7, 3, SECRET), reply);
    CHECK(n > 0 && boot_decode(&m, reply) && m.code == BOOT_BAD_RANK && !memcmp(m.id, zero, sizeof zero),
          "rank out of range: no refusal, or an id");
    Result r1 = collect(spawn(config(1, 3, port, "")));
    CHECK(got_id(&r1), "rank 1 after the hostile clients: %s", r1.err);
    n = raw_client("127.0.0.1", port, msg, hello(msg, 1, 3, SECRET), reply);
    CHECK(n > 0 && boot_decode(&m, reply) && m.code == BOOT_RANK_TAKEN && !memcmp(m.id, zero, sizeof zero),
          "a second rank 1: no refusal, or an id");
    Result r2 = collect(spawn(config(2, 3, port, "")));
    CHECK(got_id(&r2), "rank 2 after the hostile clients: %s", r2.err);
    Result r0 = collect(root);
    CHECK(r0.ok, "rank 0 did not survive the hostile clients: %s", r0.err);
}

static void test_tcp_refusals(int port) {
    // A rank started with another world size learns it; rank 0 names the rank that never joined.
    BootConfig c0 = config(0, 2, port, "");
    c0.timeout_s = 2;
    Proc p0 = spawn(c0), p1 = spawn(config(1, 3, port, ""));
    Result r1 = collect(p1), r0 = collect(p0);
    CHECK(!r1.ok && strstr(r1.err, "world size 3, rank 0 with 2"), "world size mismatch, rank 1: %s", r1.err);
    CHECK(!r0.ok && strstr(r0.err, "rank(s) 1 did not join") && strstr(r0.err, "world size 3"),
          "world size mismatch, rank 0: %s", r0.err);

    // Two runs on one port: the other run's rank 1 neither joins nor gets the id; ours still does.
    BootConfig other = config(1, 2, port + 1, "");
    other.timeout_s = 1;
    snprintf(other.secret, sizeof other.secret, "another-run-secret-0000");
    Proc a0 = spawn(config(0, 2, port + 1, ""));
    Result b1 = collect(spawn(other));
    CHECK(!b1.ok && strstr(b1.err, "no id from 127.0.0.1") && memcmp(b1.id, g_id, BOOT_ID_BYTES),
          "another run's rank 1: %s", b1.err);
    Result a1 = collect(spawn(config(1, 2, port + 1, ""))), ra0 = collect(a0);
    CHECK(got_id(&a1) && ra0.ok, "our rank 1 after another run's: %s / %s", a1.err, ra0.err);

    // No rank 0; and a listener that never answers: both bounded by the timeout.
    BootConfig c = config(1, 2, port + 2, "");
    c.timeout_s = 1;
    Result none = collect(spawn(c));
    CHECK(!none.ok && strstr(none.err, "within 1 s"), "missing rank 0 not reported: %s", none.err);
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a;
    boot_resolve(&c, &a, none.err);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, 4) == 0, "test listener");
    double t = sdm_now_s();
    Result mute = collect(spawn(c));
    CHECK(!mute.ok && sdm_now_s() - t < 3, "a mute listener held rank 1 for %.1f s: %s", sdm_now_s() - t, mute.err);
    close(fd);
}

static void test_file(const char *dir) {
    char file[256], ack[600];
    snprintf(file, sizeof file, "%s/run.id", dir);
    BootConfig stale = config(0, 3, 1, file); // an earlier run's file: another secret
    snprintf(stale.secret, sizeof stale.secret, "an-earlier-run-secret");
    BootMsg m = boot_msg(&stale, BOOT_OK, NULL);
    CHECK(boot_file_write(file, &m), "write the stale file");
    struct stat st;
    CHECK(stat(file, &st) == 0 && (st.st_mode & 0777) == 0600, "init file mode %o, not 0600", st.st_mode & 0777);
    BootConfig c = config(1, 3, 1, file);
    c.timeout_s = 1;
    Result r = collect(spawn(c));
    CHECK(!r.ok && strstr(r.err, "no init file of this run"), "a stale file was taken: %s", r.err);

    Proc p[3];
    for (int rank = 2; rank >= 0; rank--) p[rank] = spawn(config(rank, 3, 1, file)); // rank 0 last: the stale file
    for (int rank = 0; rank < 3; rank++) {                                            // is still there at first
        r = collect(p[rank]);
        CHECK(got_id(&r), "file world 3: rank %d has no id (%s)", rank, r.err);
    }
    boot_ack_path(&c, 1, ack, sizeof ack);
    CHECK(access(file, F_OK) != 0 && access(ack, F_OK) != 0, "the init file or an ack is left behind");

    // Rank 2 never comes: rank 0 names it and removes the file anyway; a world-size mismatch is named.
    BootConfig c0 = config(0, 3, 1, file);
    c0.timeout_s = 1;
    Proc q0 = spawn(c0), q1 = spawn(config(1, 3, 1, file));
    Result s1 = collect(q1), s0 = collect(q0);
    CHECK(got_id(&s1) && !s0.ok && strstr(s0.err, "rank(s) 2 did not read"), "missing rank 2: %s", s0.err);
    CHECK(access(file, F_OK) != 0, "the init file is left behind after a timeout");
    q0 = spawn(c0);
    Result w = collect(spawn(config(1, 2, 1, file)));
    collect(q0);
    CHECK(!w.ok && strstr(w.err, "world size 2, rank 0 with 3"), "file: world size mismatch: %s", w.err);
}

// boot_parse_env with the variables given as "NAME=value" strings (everything else unset).
static int parse(const char *a, const char *b, const char *c, char *err) {
    const char *names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                           "MASTER_ADDR", "MASTER_PORT", "SDM_INIT_FILE", "SDM_BOOT_TIMEOUT", "SDM_RUN_SECRET"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) unsetenv(names[i]);
    const char *set[] = {a, b, c};
    for (int i = 0; i < 3; i++) {
        if (!set[i]) continue;
        char name[64];
        const char *eq = strchr(set[i], '=');
        snprintf(name, sizeof name, "%.*s", (int)(eq - set[i]), set[i]);
        setenv(name, eq + 1, 1);
    }
    BootConfig cfg;
    err[0] = 0;
    int ok = boot_parse_env(&cfg, err);
    return ok ? cfg.rank * 100 + cfg.world * 10 + cfg.local_rank : -1;
}

static void test_env(void) {
    char err[BOOT_ERR];
    CHECK(parse(NULL, NULL, NULL, err) == 10, "defaults: %s", err);
    const char *s = "SDM_RUN_SECRET=0123456789abcdef";
    CHECK(parse("WORLD_SIZE=2x", s, NULL, err) < 0 && strstr(err, "WORLD_SIZE='2x'"), "2x: %s", err);
    CHECK(parse("RANK= 1", NULL, NULL, err) < 0 && strstr(err, "RANK="), "' 1': %s", err);
    CHECK(parse("LOCAL_RANK=", NULL, NULL, err) < 0 && strstr(err, "LOCAL_RANK"), "empty: %s", err);
    CHECK(parse("SDM_BOOT_TIMEOUT=0", NULL, NULL, err) < 0 && strstr(err, "SDM_BOOT_TIMEOUT"), "timeout 0: %s", err);
    CHECK(parse("SDM_BOOT_TIMEOUT=-5", NULL, NULL, err) < 0 && strstr(err, "SDM_BOOT_TIMEOUT"), "-5: %s", err);
    CHECK(parse("SDM_BOOT_TIMEOUT=abc", NULL, NULL, err) < 0 && strstr(err, "SDM_BOOT_TIMEOUT"), "abc: %s", err);
    CHECK(parse("MASTER_PORT=70000", NULL, NULL, err) < 0 && strstr(err, "MASTER_PORT"), "port 70000: %s", err);
    CHECK(parse("MASTER_PORT=0", NULL, NULL, err) < 0 && strstr(err, "MASTER_PORT"), "port 0: %s", err);
    CHECK(parse("WORLD_SIZE=0", NULL, NULL, err) < 0 && strstr(err, "WORLD_SIZE"), "world 0: %s", err);
    CHECK(parse("WORLD_SIZE=99999999999", NULL, NULL, err) < 0 && strstr(err, "WORLD_SIZE"), "overflow: %s", err);
    CHECK(parse("RANK=1", "SLURM_PROCID=0", NULL, err) < 0 && strstr(err, "RANK=1 but SLURM_PROCID=0"),
          "RANK against SLURM_PROCID: %s", err);
    CHECK(parse("WORLD_SIZE=4", "SLURM_NTASKS=1", s, err) < 0 && strstr(err, "WORLD_SIZE=4 but SLURM_NTASKS=1"),
          "WORLD_SIZE against SLURM_NTASKS: %s", err);
    CHECK(parse("LOCAL_RANK=1", "SLURM_LOCALID=0", NULL, err) < 0 && strstr(err, "LOCAL_RANK=1 but SLURM_LOCALID"),
          "LOCAL_RANK against SLURM_LOCALID: %s", err);
    CHECK(parse("SLURM_NTASKS=4", "SLURM_PROCID=3", s, err) == 340, "SLURM alone: %s", err);
    CHECK(parse("WORLD_SIZE=4", "SLURM_NTASKS=4", s, err) == 40, "agreeing variables: %s", err);
    CHECK(parse("WORLD_SIZE=2", NULL, NULL, err) < 0 && strstr(err, "export SDM_RUN_SECRET="), "no secret: %s", err);
    CHECK(parse("WORLD_SIZE=2", "SDM_RUN_SECRET=short", NULL, err) < 0 && strstr(err, "SDM_RUN_SECRET"),
          "short secret: %s", err);
    CHECK(parse("WORLD_SIZE=2", "RANK=2", s, err) < 0 && strstr(err, "rank 2, world 2"), "rank >= world: %s", err);
}

// The GPU a process takes: LOCAL_RANK among the node's GPUs; device 0 where a binding leaves each process one.
static void test_device(void) {
    char err[BOOT_ERR] = "";
    CHECK(boot_device(3, 8, NULL, err) == 3 && boot_device(3, 8, "0,1,2,3,4,5,6,7", err) == 3, "8 GPUs: rank 3");
    CHECK(boot_device(5, 1, "5", err) == 0, "one GPU bound to the task: device 0");
    CHECK(boot_device(0, 1, NULL, err) == 0, "one GPU, local rank 0");
    CHECK(boot_device(1, 1, NULL, err) < 0 && strstr(err, "local rank 1 but only 1 GPUs"),
          "two ranks on one GPU without a binding are refused: %s", err);
    CHECK(boot_device(1, 1, "", err) < 0, "an empty CUDA_VISIBLE_DEVICES is no binding");
    CHECK(boot_device(4, 2, "0,1", err) < 0 && strstr(err, "CUDA_VISIBLE_DEVICES"), "4 of 2: %s", err);
}

int main(void) {
    Rng rng = rng_make((uint64_t)getpid());
    for (int i = 0; i < BOOT_ID_BYTES; i++) g_id[i] = (unsigned char)rng_below(&rng, 256);
    // Below Linux's ephemeral range (32768-60999): a port there can be the local end of one of this test's own
    // client connections, and then rank 0 cannot listen on it (CI saw it once).
    int port = 20000 + (int)(getpid() % 12000);
    char dir[] = "/tmp/test_bootstrap_XXXXXX";
    if (!mkdtemp(dir)) sdm_die("mkdtemp failed");
    test_tcp(port);
    test_tcp_hostile(port + 1);
    test_tcp_refusals(port + 2);
    test_file(dir);
    rmdir(dir);
    test_env();
    test_device();
    return test_summary();
}
