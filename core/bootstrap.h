// core/bootstrap.h: who am I in a multi-process run, and the exchange of NCCL's 128-byte unique id without MPI.
//
// Rank, world size and local rank come from RANK / WORLD_SIZE / LOCAL_RANK (scripts/, torchrun-style), else from
// SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun); where both of a pair are set they must agree (a launcher run
// inside an allocation unsets SLURM's). Every variable is parsed strictly and a bad one is refused by name.
//
// A run with more than one rank needs SDM_RUN_SECRET, the same on every rank (scripts/launch_*.sh make one from
// /dev/urandom per run). Only a peer that shows it gets the id, so a port scan, another job on the same port, or a
// stale file cannot join the run or feed it a foreign id.
//
// TCP: rank 0 listens on MASTER_ADDR:MASTER_PORT, bound to that address only (not 0.0.0.0). A client sends a hello
// (magic, version, rank, world size, secret) and gets a reply (status, world size, secret, id). Rank 0 reads each
// hello within BOOT_HELLO_S; a client that sends garbage, nothing or the wrong secret is dropped (a line on stderr)
// without an answer and without taking a rank's slot; one with the secret but another world size, a rank already
// served or out of range is told why, without the id. Connection resets and broken pipes only drop the client.
// Clients retry connecting until SDM_BOOT_TIMEOUT; every wait has that deadline, and rank 0 names the ranks that
// never joined.
//
// Init file (SDM_INIT_FILE, on a filesystem every rank sees): rank 0 writes the reply message there atomically, mode
// 0600. A rank takes it only with its run's secret (a file from another run is ignored until rank 0 replaces it),
// then writes <file>.ack<rank>. Rank 0 waits for every ack and then removes the file and the acks, so nothing is left
// behind once every rank has read it (nor after a timeout). A hand-set secret reused across runs defeats the stale
// check; hence the fresh secret per run in the launchers, and the removal.
// Plain POSIX C: testable on a machine without GPUs (tests/test_bootstrap.c).
#ifndef SDM_CORE_BOOTSTRAP_H
#define SDM_CORE_BOOTSTRAP_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "core/common.h"

#define BOOT_ID_BYTES 128 // sizeof(ncclUniqueId)
#define BOOT_ERR 512
#define BOOT_SECRET_MIN 16
#define BOOT_SECRET_MAX 64
#define BOOT_MAGIC 0x53444d42u // "SDMB"
#define BOOT_VERSION 1u
#define BOOT_HELLO_S 2 // how long rank 0 waits for the hello of a connected client
#define BOOT_MSG_BYTES (16 + BOOT_SECRET_MAX + BOOT_ID_BYTES)

static const struct timespec BOOT_POLL = {0, 100 * 1000 * 1000}; // retry interval: 100 ms

typedef struct {
    int rank, world, local_rank;
    char master_addr[256];
    int master_port;
    char init_file[512]; // non-empty: exchange through this file instead of TCP
    int timeout_s;
    char secret[BOOT_SECRET_MAX + 1];
} BootConfig;

// ------------------------------------------------------------------------------------------------------------------
// Configuration

// *out = the decimal integer in [lo, hi] held by variable `name`; *set = whether it is set (*out kept if not).
// Nothing but an optional '-' and digits is accepted ("2x", " 2", "" are refused).
static inline int boot_env_int(const char *name, long lo, long hi, int *out, int *set, char *err) {
    const char *v = getenv(name);
    *set = v != NULL;
    if (!v) return 1;
    char *end = NULL;
    errno = 0;
    long x = (v[0] == '-' || (v[0] >= '0' && v[0] <= '9')) ? strtol(v, &end, 10) : 0;
    if (!end || *end || errno || x < lo || x > hi) {
        snprintf(err, BOOT_ERR, "%s='%.40s' is not an integer in [%ld, %ld]", name, v, lo, hi);
        return 0;
    }
    *out = (int)x;
    return 1;
}

// One layout value from the explicit variable or SLURM's; both set and different is an error naming both.
static inline int boot_env_layout(const char *name, const char *slurm, long lo, int *out, char *err) {
    int a = *out, b = *out, has_a, has_b;
    if (!boot_env_int(name, lo, INT_MAX, &a, &has_a, err) || !boot_env_int(slurm, lo, INT_MAX, &b, &has_b, err))
        return 0;
    if (has_a && has_b && a != b) {
        snprintf(err, BOOT_ERR, "%s=%d but %s=%d: unset one of them (scripts/launch_local.sh and launch_ssh.sh set "
                 "%s and unset SLURM's)", name, a, slurm, b, name);
        return 0;
    }
    *out = has_a ? a : has_b ? b : *out;
    return 1;
}

static inline int boot_env_str(const char *name, char *out, size_t cap, char *err) {
    const char *v = getenv(name);
    if (!v) return 1;
    if (strlen(v) >= cap) {
        snprintf(err, BOOT_ERR, "%s is longer than %zu characters", name, cap - 1);
        return 0;
    }
    snprintf(out, cap, "%s", v);
    return 1;
}

static inline int boot_check(const BootConfig *c, char *err) {
    if (c->world < 1 || c->rank < 0 || c->rank >= c->world || c->local_rank < 0) {
        snprintf(err, BOOT_ERR, "bad process layout: rank %d, world %d, local rank %d", c->rank, c->world,
                 c->local_rank);
        return 0;
    }
    if (c->master_port < 1 || c->master_port > 65535) {
        snprintf(err, BOOT_ERR, "bad MASTER_PORT %d (1 to 65535)", c->master_port);
        return 0;
    }
    if (c->timeout_s < 1) {
        snprintf(err, BOOT_ERR, "bad SDM_BOOT_TIMEOUT %d (seconds, at least 1)", c->timeout_s);
        return 0;
    }
    size_t n = strlen(c->secret);
    for (size_t i = 0; i < n; i++)
        if (c->secret[i] <= ' ' || c->secret[i] > '~') n = 0; // no spaces or control characters
    if (c->world > 1 && (n < BOOT_SECRET_MIN || n > BOOT_SECRET_MAX)) {
        snprintf(err, BOOT_ERR, "world size %d needs SDM_RUN_SECRET, %d to %d printable characters shared by every "
                 "rank of this run only; scripts/launch_*.sh make one, by hand run once\n  export SDM_RUN_SECRET="
                 "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')\nand start every rank with it", c->world,
                 BOOT_SECRET_MIN, BOOT_SECRET_MAX);
        return 0;
    }
    return 1;
}

// The configuration from the environment (a single process when nothing is set), checked. 0 with err on failure.
static inline int boot_parse_env(BootConfig *c, char *err) {
    memset(c, 0, sizeof *c);
    c->world = 1;
    c->master_port = 29500;
    c->timeout_s = 300;
    snprintf(c->master_addr, sizeof c->master_addr, "127.0.0.1");
    int set;
    return boot_env_layout("RANK", "SLURM_PROCID", 0, &c->rank, err) &&
           boot_env_layout("WORLD_SIZE", "SLURM_NTASKS", 1, &c->world, err) &&
           boot_env_layout("LOCAL_RANK", "SLURM_LOCALID", 0, &c->local_rank, err) &&
           boot_env_int("MASTER_PORT", 1, 65535, &c->master_port, &set, err) &&
           boot_env_int("SDM_BOOT_TIMEOUT", 1, 86400, &c->timeout_s, &set, err) &&
           boot_env_str("MASTER_ADDR", c->master_addr, sizeof c->master_addr, err) &&
           boot_env_str("SDM_INIT_FILE", c->init_file, sizeof c->init_file, err) &&
           boot_env_str("SDM_RUN_SECRET", c->secret, sizeof c->secret, err) && boot_check(c, err);
}

// This process's GPU among the `visible` ones: LOCAL_RANK indexes the node's GPUs, except where a per-task binding
// (CUDA_VISIBLE_DEVICES set, `cuda_visible`, and exactly one GPU visible: SLURM's --gpus-per-task=1 or GPU binding)
// leaves each process its own, device 0. -1 with err when the local rank has no GPU.
static inline int boot_device(int local_rank, int visible, const char *cuda_visible, char *err) {
    if (visible == 1 && cuda_visible && *cuda_visible) return 0;
    if (local_rank < visible) return local_rank;
    snprintf(err, BOOT_ERR, "local rank %d but only %d GPUs are visible%s", local_rank, visible,
             cuda_visible ? " (CUDA_VISIBLE_DEVICES is set: one GPU a process takes device 0)" : "");
    return -1;
}

static inline BootConfig boot_from_env(void) {
    BootConfig c;
    char err[BOOT_ERR];
    if (!boot_parse_env(&c, err)) sdm_die("%s", err);
    return c;
}

// ------------------------------------------------------------------------------------------------------------------
// Messages: hello (code = the sender's rank), reply and init file (code = a BootStatus), ack (code = the rank).

typedef enum { BOOT_OK = 0, BOOT_BAD_WORLD, BOOT_RANK_TAKEN, BOOT_BAD_RANK } BootStatus;

typedef struct {
    int code, world;
    char secret[BOOT_SECRET_MAX]; // zero-padded
    unsigned char id[BOOT_ID_BYTES];
} BootMsg;

static inline BootMsg boot_msg(const BootConfig *c, int code, const unsigned char *id) {
    BootMsg m;
    memset(&m, 0, sizeof m);
    m.code = code;
    m.world = c->world;
    memcpy(m.secret, c->secret, strlen(c->secret));
    if (id) memcpy(m.id, id, BOOT_ID_BYTES);
    return m;
}

static inline void boot_put32(unsigned char *p, unsigned x) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(x >> (24 - 8 * i));
}

static inline unsigned boot_get32(const unsigned char *p) {
    return (unsigned)p[0] << 24 | (unsigned)p[1] << 16 | (unsigned)p[2] << 8 | p[3];
}

static inline void boot_encode(const BootMsg *m, unsigned char *out) {
    boot_put32(out, BOOT_MAGIC);
    boot_put32(out + 4, BOOT_VERSION);
    boot_put32(out + 8, (unsigned)m->code);
    boot_put32(out + 12, (unsigned)m->world);
    memcpy(out + 16, m->secret, BOOT_SECRET_MAX);
    memcpy(out + 16 + BOOT_SECRET_MAX, m->id, BOOT_ID_BYTES);
}

// 0 unless `in` carries our magic and version.
static inline int boot_decode(BootMsg *m, const unsigned char *in) {
    if (boot_get32(in) != BOOT_MAGIC || boot_get32(in + 4) != BOOT_VERSION) return 0;
    m->code = (int)boot_get32(in + 8);
    m->world = (int)boot_get32(in + 12);
    memcpy(m->secret, in + 16, BOOT_SECRET_MAX);
    memcpy(m->id, in + 16 + BOOT_SECRET_MAX, BOOT_ID_BYTES);
    return 1;
}

// Whether m carries c's secret, in time independent of where they differ.
static inline int boot_secret_ok(const BootConfig *c, const BootMsg *m) {
    BootMsg mine = boot_msg(c, 0, NULL);
    unsigned char diff = 0;
    for (int i = 0; i < BOOT_SECRET_MAX; i++) diff |= (unsigned char)(mine.secret[i] ^ m->secret[i]);
    return diff == 0;
}

// ------------------------------------------------------------------------------------------------------------------
// TCP

// SO_RCVTIMEO / SO_SNDTIMEO (the latter also bounds connect()): a safety net under the poll deadlines.
static inline void boot_socket_timeouts(int fd, double seconds) {
    struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    if (tv.tv_sec == 0 && tv.tv_usec < 1000) tv.tv_usec = 1000;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// Wait until fd is ready for `events` or the deadline passes; 1 when ready.
static inline int boot_wait(int fd, short events, double deadline) {
    for (;;) {
        int ms = (int)((deadline - sdm_now_s()) * 1000.0);
        if (ms <= 0) return 0;
        struct pollfd p = {fd, events, 0};
        int r = poll(&p, 1, ms);
        if (r > 0) return 1;
        if (r == 0 || errno != EINTR) return 0;
    }
}

// Send or receive one whole message before the deadline; 0 on timeout, EOF, reset or any error (no SIGPIPE).
static inline int boot_io(int fd, unsigned char *buf, int sending, double deadline) {
    size_t n = BOOT_MSG_BYTES;
    while (n) {
        if (!boot_wait(fd, sending ? POLLOUT : POLLIN, deadline)) return 0;
        ssize_t k = sending ? send(fd, buf, n, MSG_NOSIGNAL) : recv(fd, buf, n, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (k <= 0) return 0;
        buf += k;
        n -= (size_t)k;
    }
    return 1;
}

static inline int boot_resolve(const BootConfig *c, struct sockaddr_in *addr, char *err) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(c->master_addr, NULL, &hints, &res) != 0 || !res) {
        snprintf(err, BOOT_ERR, "cannot resolve MASTER_ADDR '%.200s' (IPv4)", c->master_addr);
        return 0;
    }
    memcpy(addr, res->ai_addr, sizeof *addr);
    addr->sin_port = htons((uint16_t)c->master_port);
    freeaddrinfo(res);
    return 1;
}

// Rank 0 with a connected client: read its hello, answer it. Returns 1 when the client joined as rank *joined_rank;
// else 0 with the reason in `why` (the client got an answer only if it showed the secret).
static inline int boot_serve_client(const BootConfig *c, int fd, const unsigned char *id, const char *taken,
                                    double deadline, int *joined_rank, char *why, size_t why_cap) {
    unsigned char buf[BOOT_MSG_BYTES];
    BootMsg h;
    double hello_deadline = SDM_MIN(deadline, sdm_now_s() + BOOT_HELLO_S);
    boot_socket_timeouts(fd, BOOT_HELLO_S);
    if (!boot_io(fd, buf, 0, hello_deadline)) return snprintf(why, why_cap, "no hello within %d s", BOOT_HELLO_S), 0;
    if (!boot_decode(&h, buf)) return snprintf(why, why_cap, "not an sdm.c hello"), 0;
    if (!boot_secret_ok(c, &h)) return snprintf(why, why_cap, "wrong SDM_RUN_SECRET"), 0;
    BootStatus s = h.world != c->world            ? BOOT_BAD_WORLD
                   : h.code < 1 || h.code >= c->world ? BOOT_BAD_RANK
                   : taken[h.code]                ? BOOT_RANK_TAKEN
                                                  : BOOT_OK;
    BootMsg reply = boot_msg(c, s, s == BOOT_OK ? id : NULL);
    boot_encode(&reply, buf);
    int sent = boot_io(fd, buf, 1, hello_deadline);
    if (s != BOOT_OK)
        return snprintf(why, why_cap, "refused rank %d of world size %d (%s)", h.code, h.world,
                        s == BOOT_BAD_WORLD ? "another world size" : s == BOOT_BAD_RANK ? "rank out of range"
                                                                                         : "that rank already joined"),
               0;
    if (!sent) return snprintf(why, why_cap, "rank %d: sending the id failed", h.code), 0;
    *joined_rank = h.code;
    return 1;
}

// "1, 3, 4" of the ranks 1..world-1 not marked in `done` (as many as fit).
static inline void boot_missing(const char *done, int world, char *out, size_t cap) {
    size_t len = 0;
    out[0] = 0;
    for (int r = 1; r < world && len + 16 < cap; r++)
        if (!done[r]) len += (size_t)snprintf(out + len, cap - len, "%s%d", len ? ", " : "", r);
}

static inline int boot_tcp_serve(const BootConfig *c, const unsigned char *id, char *err) {
    struct sockaddr_in addr;
    if (!boot_resolve(c, &addr, err)) return 0;
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, SOMAXCONN) != 0) {
        snprintf(err, BOOT_ERR, "rank 0 cannot listen on %.200s:%d: %s (MASTER_ADDR must be an address of rank 0's "
                 "host, MASTER_PORT free)", c->master_addr, c->master_port, strerror(errno));
        if (fd >= 0) close(fd);
        return 0;
    }
    char *joined = (char *)sdm_calloc((size_t)c->world, 1), why[160] = "", last[200] = "";
    int missing = c->world - 1, refused = 0;
    double deadline = sdm_now_s() + c->timeout_s;
    while (missing > 0 && boot_wait(fd, POLLIN, deadline)) {
        struct sockaddr_in peer;
        socklen_t len = sizeof peer;
        int client = accept(fd, (struct sockaddr *)&peer, &len), r = 0;
        if (client < 0) continue; // e.g. ECONNABORTED: the client reset before we accepted
        if (boot_serve_client(c, client, id, joined, deadline, &r, why, sizeof why)) {
            joined[r] = 1;
            missing--;
        } else {
            refused++;
            snprintf(last, sizeof last, "%s:%d: %s", inet_ntoa(peer.sin_addr), ntohs(peer.sin_port), why);
            fprintf(stderr, "sdm: rank 0 dropped a connection from %s\n", last);
        }
        close(client);
    }
    close(fd);
    if (missing) {
        char list[200];
        boot_missing(joined, c->world, list, sizeof list);
        snprintf(err, BOOT_ERR, "rank 0: rank(s) %s did not join within %d s (%d connection(s) dropped%s%s)", list,
                 c->timeout_s, refused, refused ? ", last " : "", last);
    }
    free(joined);
    return missing == 0;
}

static inline int boot_tcp_fetch(const BootConfig *c, unsigned char *id, char *err) {
    struct sockaddr_in addr;
    if (!boot_resolve(c, &addr, err)) return 0;
    unsigned char hello[BOOT_MSG_BYTES], buf[BOOT_MSG_BYTES];
    BootMsg m = boot_msg(c, c->rank, NULL);
    boot_encode(&m, hello);
    double deadline = sdm_now_s() + c->timeout_s;
    while (sdm_now_s() < deadline) {
        int fd = socket(AF_INET, SOCK_STREAM, 0), answered = 0;
        if (fd >= 0) {
            boot_socket_timeouts(fd, deadline - sdm_now_s());
            answered = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0 && boot_io(fd, hello, 1, deadline) &&
                       boot_io(fd, buf, 0, deadline) && boot_decode(&m, buf) && boot_secret_ok(c, &m);
            close(fd);
        }
        if (answered && m.code == BOOT_OK) {
            memcpy(id, m.id, BOOT_ID_BYTES);
            return 1;
        }
        if (answered) {
            if (m.code == BOOT_BAD_WORLD)
                snprintf(err, BOOT_ERR, "rank %d was started with world size %d, rank 0 with %d", c->rank, c->world,
                         m.world);
            else
                snprintf(err, BOOT_ERR, "rank %d: rank 0 refused it (%s)", c->rank,
                         m.code == BOOT_RANK_TAKEN ? "another process already joined as this rank" : "bad rank");
            return 0;
        }
        nanosleep(&BOOT_POLL, NULL); // rank 0 may not be listening yet, or dropped us (another run on this port)
    }
    snprintf(err, BOOT_ERR, "rank %d: no id from %.200s:%d within %d s (is rank 0 running, with the same "
             "SDM_RUN_SECRET?)", c->rank, c->master_addr, c->master_port, c->timeout_s);
    return 0;
}

// ------------------------------------------------------------------------------------------------------------------
// Init file

// Write m to path atomically (a temporary file, mode 0600, renamed over path).
static inline int boot_file_write(const char *path, const BootMsg *m) {
    char tmp[600];
    unsigned char buf[BOOT_MSG_BYTES];
    boot_encode(m, buf);
    snprintf(tmp, sizeof tmp, "%.500s.tmp%d", path, (int)getpid());
    unlink(tmp);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return 0;
    int ok = write(fd, buf, sizeof buf) == (ssize_t)sizeof buf;
    ok &= close(fd) == 0;
    ok = ok && rename(tmp, path) == 0;
    if (!ok) unlink(tmp);
    return ok;
}

// 1 when path holds a message of our run (magic, version and secret).
static inline int boot_file_read(const BootConfig *c, const char *path, BootMsg *m) {
    unsigned char buf[BOOT_MSG_BYTES + 1];
    FILE *fp = fopen(path, "rb");
    if (!fp) return 0;
    size_t n = fread(buf, 1, sizeof buf, fp);
    fclose(fp);
    return n == BOOT_MSG_BYTES && boot_decode(m, buf) && boot_secret_ok(c, m);
}

static inline void boot_ack_path(const BootConfig *c, int rank, char *out, size_t cap) {
    snprintf(out, cap, "%.500s.ack%d", c->init_file, rank);
}

static inline int boot_file_serve(const BootConfig *c, const unsigned char *id, char *err) {
    char path[600], *acked = (char *)sdm_calloc((size_t)c->world, 1);
    for (int r = 1; r < c->world; r++) boot_ack_path(c, r, path, sizeof path), unlink(path); // an earlier run's
    BootMsg m = boot_msg(c, BOOT_OK, id);
    if (!boot_file_write(c->init_file, &m)) {
        snprintf(err, BOOT_ERR, "%.400s: cannot write the init file: %s", c->init_file, strerror(errno));
        free(acked);
        return 0;
    }
    int missing = c->world - 1;
    double deadline = sdm_now_s() + c->timeout_s;
    while (missing > 0 && sdm_now_s() < deadline) {
        for (int r = 1; r < c->world; r++) {
            boot_ack_path(c, r, path, sizeof path);
            if (!acked[r] && boot_file_read(c, path, &m) && m.code == r) acked[r] = 1, missing--;
        }
        if (missing) nanosleep(&BOOT_POLL, NULL);
    }
    for (int r = 1; r < c->world; r++) boot_ack_path(c, r, path, sizeof path), unlink(path);
    unlink(c->init_file);
    if (missing) {
        char list[200];
        boot_missing(acked, c->world, list, sizeof list);
        snprintf(err, BOOT_ERR, "rank 0: rank(s) %s did not read %.200s within %d s", list, c->init_file,
                 c->timeout_s);
    }
    free(acked);
    return missing == 0;
}

static inline int boot_file_fetch(const BootConfig *c, unsigned char *id, char *err) {
    BootMsg m;
    double deadline = sdm_now_s() + c->timeout_s;
    while (sdm_now_s() < deadline) {
        if (boot_file_read(c, c->init_file, &m) && m.code == BOOT_OK) {
            if (m.world != c->world) {
                snprintf(err, BOOT_ERR, "rank %d was started with world size %d, rank 0 with %d", c->rank, c->world,
                         m.world);
                return 0;
            }
            memcpy(id, m.id, BOOT_ID_BYTES);
            char ack[600];
            boot_ack_path(c, c->rank, ack, sizeof ack);
            BootMsg a = boot_msg(c, c->rank, NULL);
            if (boot_file_write(ack, &a)) return 1;
            snprintf(err, BOOT_ERR, "%.400s: cannot write: %s", ack, strerror(errno));
            return 0;
        }
        nanosleep(&BOOT_POLL, NULL);
    }
    snprintf(err, BOOT_ERR, "%.400s: no init file of this run (this SDM_RUN_SECRET) within %d s", c->init_file,
             c->timeout_s);
    return 0;
}

// Rank 0 passes its id in `id`; every other rank receives it there. Returns 0 with err set on failure.
static inline int boot_exchange_id(const BootConfig *c, unsigned char id[BOOT_ID_BYTES], char *err) {
    if (!boot_check(c, err)) return 0;
    if (c->world == 1) return 1;
    if (c->rank == 0) return c->init_file[0] ? boot_file_serve(c, id, err) : boot_tcp_serve(c, id, err);
    return c->init_file[0] ? boot_file_fetch(c, id, err) : boot_tcp_fetch(c, id, err);
}

#endif
