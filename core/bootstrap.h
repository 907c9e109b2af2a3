// core/bootstrap.h: who am I in a multi-process run, and the exchange of NCCL's 128-byte unique id without MPI.
//
// Rank, world size and local rank come from flags, else from the usual launcher variables: SLURM_PROCID /
// SLURM_NTASKS / SLURM_LOCALID (srun), or RANK / WORLD_SIZE / LOCAL_RANK (torchrun-style and our scripts/).
// The id travels over TCP: rank 0 listens on MASTER_ADDR:MASTER_PORT and sends it to each of the other ranks, which
// connect (retrying until a timeout). Alternatively a file on a shared filesystem (init_file): rank 0 writes it
// atomically, the others poll for it; the file must be new for each run (put the job id in its name), or a rank
// could read the id of an earlier run. Plain POSIX C: testable on a machine without GPUs.
#ifndef SDM_CORE_BOOTSTRAP_H
#define SDM_CORE_BOOTSTRAP_H

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
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

static const struct timespec BOOT_POLL = {0, 100 * 1000 * 1000}; // retry interval: 100 ms

typedef struct {
    int rank, world, local_rank;
    char master_addr[256];
    int master_port;
    char init_file[512]; // non-empty: exchange through this file instead of TCP
    int timeout_s;
} BootConfig;

static inline int boot_env_int(const char *a, const char *b, int fallback) {
    const char *v = getenv(a);
    if (!v) v = getenv(b);
    return v ? atoi(v) : fallback;
}

// Defaults from the environment (single process when nothing is set).
static inline BootConfig boot_from_env(void) {
    BootConfig c;
    memset(&c, 0, sizeof c);
    c.rank = boot_env_int("SLURM_PROCID", "RANK", 0);
    c.world = boot_env_int("SLURM_NTASKS", "WORLD_SIZE", 1);
    c.local_rank = boot_env_int("SLURM_LOCALID", "LOCAL_RANK", 0);
    const char *addr = getenv("MASTER_ADDR");
    snprintf(c.master_addr, sizeof c.master_addr, "%s", addr ? addr : "127.0.0.1");
    c.master_port = boot_env_int("MASTER_PORT", "SDM_MASTER_PORT", 29500);
    const char *file = getenv("SDM_INIT_FILE");
    if (file) snprintf(c.init_file, sizeof c.init_file, "%s", file);
    c.timeout_s = boot_env_int("SDM_BOOT_TIMEOUT", "SDM_BOOT_TIMEOUT_S", 300);
    return c;
}

static inline int boot_check(const BootConfig *c, char *err) {
    if (c->world < 1 || c->rank < 0 || c->rank >= c->world || c->local_rank < 0) {
        snprintf(err, BOOT_ERR, "bad process layout: rank %d, world %d, local rank %d", c->rank, c->world,
                 c->local_rank);
        return 0;
    }
    if (c->master_port < 1 || c->master_port > 65535) {
        snprintf(err, BOOT_ERR, "bad MASTER_PORT %d", c->master_port);
        return 0;
    }
    return 1;
}

static inline int boot_io(int fd, void *buf, size_t n, int sending) {
    char *p = (char *)buf;
    while (n) {
        ssize_t k = sending ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            return 0;
        }
        p += k;
        n -= (size_t)k;
    }
    return 1;
}

// Each message is the id followed by the world size, so a rank started with another world size is refused.
typedef struct { unsigned char id[BOOT_ID_BYTES]; int world; } BootMessage;

static inline int boot_tcp_serve(const BootConfig *c, const BootMessage *msg, char *err) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons((uint16_t)c->master_port);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, c->world) != 0) {
        snprintf(err, BOOT_ERR, "rank 0 cannot listen on port %d: %s", c->master_port, strerror(errno));
        if (fd >= 0) close(fd);
        return 0;
    }
    struct timeval tv = {c->timeout_s, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv); // bounds accept() too
    for (int served = 1; served < c->world; served++) {
        int peer = accept(fd, NULL, NULL);
        if (peer < 0) {
            snprintf(err, BOOT_ERR, "rank 0: only %d of %d ranks connected within %d s", served, c->world,
                     c->timeout_s);
            close(fd);
            return 0;
        }
        int ok = boot_io(peer, (void *)msg, sizeof *msg, 1);
        close(peer);
        if (!ok) { snprintf(err, BOOT_ERR, "rank 0: sending the id failed"); close(fd); return 0; }
    }
    close(fd);
    return 1;
}

static inline int boot_tcp_fetch(const BootConfig *c, BootMessage *msg, char *err) {
    char port[16];
    snprintf(port, sizeof port, "%d", c->master_port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(c->master_addr, port, &hints, &res) != 0 || !res) {
        snprintf(err, BOOT_ERR, "cannot resolve MASTER_ADDR '%s'", c->master_addr);
        return 0;
    }
    time_t start = time(NULL);
    int ok = 0;
    while (!ok && time(NULL) - start <= c->timeout_s) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) ok = boot_io(fd, msg, sizeof *msg, 0);
        if (fd >= 0) close(fd);
        if (!ok) nanosleep(&BOOT_POLL, NULL); // rank 0 may not be listening yet
    }
    freeaddrinfo(res);
    if (!ok)
        snprintf(err, BOOT_ERR, "rank %d: no id from %s:%d within %d s", c->rank, c->master_addr, c->master_port,
                 c->timeout_s);
    return ok;
}

static inline int boot_file_publish(const BootConfig *c, const BootMessage *msg, char *err) {
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%.500s.tmp", c->init_file);
    FILE *fp = fopen(tmp, "wb");
    int ok = fp && fwrite(msg, sizeof *msg, 1, fp) == 1;
    if (fp) ok &= fclose(fp) == 0;
    ok = ok && rename(tmp, c->init_file) == 0; // readers never see a partial file
    if (!ok) snprintf(err, BOOT_ERR, "%.400s: cannot write the init file: %s", c->init_file, strerror(errno));
    return ok;
}

static inline int boot_file_fetch(const BootConfig *c, BootMessage *msg, char *err) {
    time_t start = time(NULL);
    while (time(NULL) - start <= c->timeout_s) {
        FILE *fp = fopen(c->init_file, "rb");
        if (fp) {
            int ok = fread(msg, sizeof *msg, 1, fp) == 1;
            fclose(fp);
            if (ok) return 1;
        }
        nanosleep(&BOOT_POLL, NULL);
    }
    snprintf(err, BOOT_ERR, "%.400s: init file did not appear within %d s", c->init_file, c->timeout_s);
    return 0;
}

// Rank 0 passes its id in `id`; every other rank receives it there. Returns 0 with err set on failure.
static inline int boot_exchange_id(const BootConfig *c, unsigned char id[BOOT_ID_BYTES], char *err) {
    if (!boot_check(c, err)) return 0;
    if (c->world == 1) return 1;
    BootMessage msg;
    memset(&msg, 0, sizeof msg);
    if (c->rank == 0) {
        memcpy(msg.id, id, BOOT_ID_BYTES);
        msg.world = c->world;
        return c->init_file[0] ? boot_file_publish(c, &msg, err) : boot_tcp_serve(c, &msg, err);
    }
    int ok = c->init_file[0] ? boot_file_fetch(c, &msg, err) : boot_tcp_fetch(c, &msg, err);
    if (ok && msg.world != c->world) {
        snprintf(err, BOOT_ERR, "rank %d was started with world size %d, rank 0 with %d", c->rank, c->world,
                 msg.world);
        return 0;
    }
    if (ok) memcpy(id, msg.id, BOOT_ID_BYTES);
    return ok;
}

#endif
