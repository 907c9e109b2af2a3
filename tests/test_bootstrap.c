// tests/test_bootstrap.c: the NCCL-id exchange between processes, over TCP and through a file, and its refusals.
#include <sys/wait.h>

#include "core/bootstrap.h"
#include "core/rng.h"
#include "tests/test.h"

// Run `world` processes exchanging a random id; returns how many non-zero ranks received exactly rank 0's id.
// world_of_rank1 lets rank 1 claim another world size.
static int run_world(int world, int port, const char *init_file, int world_of_rank1, char *first_err) {
    unsigned char id[BOOT_ID_BYTES];
    Rng r = rng_make((uint64_t)port);
    for (int i = 0; i < BOOT_ID_BYTES; i++) id[i] = (unsigned char)rng_below(&r, 256);
    int pipes[64][2];
    pid_t pids[64];
    for (int rank = 0; rank < world; rank++) {
        if (pipe(pipes[rank]) != 0) sdm_die("pipe failed");
        pids[rank] = fork();
        if (pids[rank] == 0) {
            BootConfig c = boot_from_env();
            c.rank = rank;
            c.world = rank == 1 ? world_of_rank1 : world;
            c.master_port = port;
            c.timeout_s = 10;
            snprintf(c.master_addr, sizeof c.master_addr, "127.0.0.1");
            snprintf(c.init_file, sizeof c.init_file, "%s", init_file);
            unsigned char got[BOOT_ID_BYTES];
            memcpy(got, rank == 0 ? id : (const unsigned char *)"", rank == 0 ? BOOT_ID_BYTES : 1);
            char err[BOOT_ERR] = "";
            int ok = boot_exchange_id(&c, got, err);
            int same = ok && memcmp(got, id, BOOT_ID_BYTES) == 0;
            if (write(pipes[rank][1], err, sizeof err) != (ssize_t)sizeof err) _exit(3);
            _exit(same ? 0 : 1);
        }
        close(pipes[rank][1]);
    }
    int good = 0;
    first_err[0] = 0;
    for (int rank = 0; rank < world; rank++) {
        char err[BOOT_ERR];
        if (read(pipes[rank][0], err, sizeof err) == (ssize_t)sizeof err && err[0] && !first_err[0])
            snprintf(first_err, BOOT_ERR, "%s", err);
        close(pipes[rank][0]);
        int status;
        waitpid(pids[rank], &status, 0);
        if (rank > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0) good++;
    }
    return good;
}

int main(void) {
    char err[BOOT_ERR];
    int port = 20000 + (int)(getpid() % 30000);
    CHECK(run_world(4, port, "", 4, err) == 3, "TCP: not every rank got the id (%s)", err);

    char file[256];
    snprintf(file, sizeof file, "build/test_bootstrap_%d.id", (int)getpid());
    CHECK(run_world(3, port + 1, file, 3, err) == 2, "file: not every rank got the id (%s)", err);
    remove(file);

    CHECK(run_world(2, port + 2, "", 3, err) == 0 && strstr(err, "world size 3"),
          "a rank with another world size was not refused (%s)", err);

    BootConfig c = boot_from_env();
    c.rank = 2;
    c.world = 2;
    unsigned char id[BOOT_ID_BYTES] = {0};
    CHECK(!boot_exchange_id(&c, id, err) && strstr(err, "rank 2, world 2"), "rank >= world accepted (%s)", err);
    c.rank = 1;
    c.timeout_s = 1;
    c.master_port = port + 3;
    CHECK(!boot_exchange_id(&c, id, err) && strstr(err, "within 1 s"), "missing rank 0 not reported (%s)", err);
    return test_summary();
}
