// tests/test_stop_signal.c: core/stop_signal.h. A first SIGTERM or SIGINT only sets the flag (the process goes on);
// a second one ends the process at once with status 128 + the signal. Each case runs in a child process.
#include <sys/wait.h>

#include "core/stop_signal.h"
#include "tests/test.h"

// Child: install, raise `first`, report the flag through the exit status (or raise `second` and report survival).
static int child_status(int first, int second) {
    pid_t pid = fork();
    if (pid == 0) {
        stop_signal_install();
        raise(first);
        if (stop_signal_received() != first) _exit(2);
        if (second) raise(second);
        _exit(0); // reached only without a second signal
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
}

int main(void) {
    const int cases[4][3] = {{SIGTERM, 0, 0}, {SIGINT, 0, 0}, {SIGTERM, SIGTERM, 128 + SIGTERM},
                             {SIGTERM, SIGINT, 128 + SIGINT}}; // first, second, the status wanted
    for (int k = 0; k < 4; k++) {
        int status = child_status(cases[k][0], cases[k][1]);
        CHECK(status == cases[k][2], "signals %d then %d: status %d, want %d", cases[k][0], cases[k][1], status,
              cases[k][2]);
    }
    return test_summary();
}
