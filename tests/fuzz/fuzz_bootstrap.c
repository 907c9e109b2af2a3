// tests/fuzz/fuzz_bootstrap.c: core/bootstrap.h, what a network peer, an init file or the environment hands a rank.
// The first byte picks (mod 3):
//   0: the bytes are a client's hello to rank 0 (boot_serve_client over a socket pair; world 4, rank 2 already
//      joined). Promises: a client joins only with the magic, version, secret, world size and a free rank in range;
//      only a client that showed the secret gets any answer, and the id only when it joined.
//   1: the bytes are an init file (boot_file_read). Promise: taken only when it is one whole message with the secret.
//   2: the bytes are the environment: up to 11 '\n'-separated values of RANK, WORLD_SIZE, LOCAL_RANK, SLURM_PROCID,
//      SLURM_NTASKS, SLURM_LOCALID, MASTER_PORT, SDM_BOOT_TIMEOUT, MASTER_ADDR, SDM_INIT_FILE, SDM_RUN_SECRET (a value
//      starting with byte 1 unsets it) for boot_parse_env. Promise: an accepted integer is '-'? digits, in range.
#include <sys/socket.h>

#include "core/bootstrap.h"
#include "tests/fuzz/fuzz.h"

static const char *SECRET = "0123456789abcdef0123456789abcdef";

static BootConfig config(void) {
    BootConfig c;
    memset(&c, 0, sizeof c);
    c.rank = 0;
    c.world = 4;
    c.master_port = 29500;
    c.timeout_s = 3;
    snprintf(c.master_addr, sizeof c.master_addr, "127.0.0.1");
    snprintf(c.secret, sizeof c.secret, "%s", SECRET);
    return c;
}

static void fuzz_hello(const uint8_t *data, size_t n) {
    BootConfig c = config();
    unsigned char id[BOOT_ID_BYTES];
    for (int i = 0; i < BOOT_ID_BYTES; i++) id[i] = (unsigned char)(0xA5 ^ i);
    const char taken[4] = {0, 0, 1, 0};
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) abort();
    size_t k = SDM_MIN(n, (size_t)4096);
    if (k && write(sv[1], data, k) != (ssize_t)k) abort();
    shutdown(sv[1], SHUT_WR); // the peer says no more: a short hello ends at once
    int rank = -1;
    char why[160] = "";
    int joined = boot_serve_client(&c, sv[0], id, taken, sdm_now_s() + 5, &rank, why, sizeof why);
    unsigned char reply[BOOT_MSG_BYTES + 1];
    ssize_t got = recv(sv[1], reply, sizeof reply, MSG_DONTWAIT);
    close(sv[0]);
    close(sv[1]);
    BootMsg hello, r;
    int decoded = n >= BOOT_MSG_BYTES && boot_decode(&hello, data), has_secret = decoded && boot_secret_ok(&c, &hello);
    if (joined) {
        FUZZ_ASSERT(has_secret && hello.world == 4 && hello.code >= 1 && hello.code < 4 && !taken[hello.code] &&
                        rank == hello.code, "joined as rank %d without a valid hello", rank);
    } else {
        FUZZ_ASSERT(why[0], "dropped without a reason");
    }
    if (got > 0) {
        FUZZ_ASSERT(has_secret, "a client without the secret got an answer (%s)", why);
        FUZZ_ASSERT(got == BOOT_MSG_BYTES && boot_decode(&r, reply), "malformed reply");
        int zero = 1;
        for (int i = 0; i < BOOT_ID_BYTES; i++) zero &= r.id[i] == 0;
        FUZZ_ASSERT(joined ? r.code == BOOT_OK && !memcmp(r.id, id, BOOT_ID_BYTES) : r.code != BOOT_OK && zero,
                    "reply code %d with%s the id to a client that %s", r.code, zero ? "out" : "", joined ? "joined" :
                    "did not join");
    } else {
        FUZZ_ASSERT(!joined, "joined without a reply");
    }
}

static void fuzz_file(const uint8_t *data, size_t n) {
    BootConfig c = config();
    const char *path = fuzz_path("init");
    fuzz_write_file(path, data, n);
    BootMsg m;
    if (boot_file_read(&c, path, &m)) {
        BootMsg d;
        FUZZ_ASSERT(n == BOOT_MSG_BYTES && boot_decode(&d, data) && boot_secret_ok(&c, &d),
                    "an init file of %zu bytes was taken", n);
    }
}

static const char *const VARS[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                                   "SLURM_LOCALID", "MASTER_PORT", "SDM_BOOT_TIMEOUT", "MASTER_ADDR", "SDM_INIT_FILE",
                                   "SDM_RUN_SECRET"};
#define NUM_VARS 11
#define NUM_INT_VARS 8

static void fuzz_env(const uint8_t *data, size_t n) {
    char *text = fuzz_cstring(data, n), *p = text, *value[NUM_VARS];
    for (int i = 0; i < NUM_VARS; i++) {
        char *nl = p ? strchr(p, '\n') : NULL;
        if (nl) *nl = 0;
        value[i] = p && p[0] != 1 ? p : NULL;
        if (value[i]) setenv(VARS[i], value[i], 1);
        else unsetenv(VARS[i]);
        p = nl ? nl + 1 : NULL;
    }
    BootConfig c;
    char err[BOOT_ERR] = "";
    if (boot_parse_env(&c, err)) {
        for (int i = 0; i < NUM_INT_VARS; i++) {
            const char *v = value[i];
            if (!v) continue;
            size_t k = v[0] == '-';
            FUZZ_ASSERT(v[k], "%s='%s' accepted", VARS[i], v);
            for (; v[k]; k++) FUZZ_ASSERT(v[k] >= '0' && v[k] <= '9', "%s='%s' accepted", VARS[i], v);
        }
        FUZZ_ASSERT(boot_check(&c, err), "accepted a configuration boot_check refuses: %s", err);
    } else {
        FUZZ_ASSERT(err[0], "refusal without a message");
    }
    for (int i = 0; i < NUM_VARS; i++) unsetenv(VARS[i]);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int mode = data[0] % 3;
    if (mode == 0) fuzz_hello(data + 1, size - 1);
    else if (mode == 1) fuzz_file(data + 1, size - 1);
    else fuzz_env(data + 1, size - 1);
    return 0;
}
