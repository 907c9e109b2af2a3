// core/stop_signal.h: a graceful stop on SIGTERM or SIGINT (a scheduler's time limit, Ctrl-C).
//
// The first signal only sets a flag, which the training loop polls between steps: it finishes the step, writes a
// checkpoint and exits 0. A second signal exits at once with status 128 + its number (the usual shell convention),
// for a user who does not want to wait. SA_RESTART keeps a signal from failing a read or write under way.
#ifndef SDM_CORE_STOP_SIGNAL_H
#define SDM_CORE_STOP_SIGNAL_H

#include <signal.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t g_stop_signal = 0; // the first signal's number, 0 before any

static void stop_signal_handler(int sig) {
    if (g_stop_signal) _exit(128 + sig);
    g_stop_signal = sig;
}

static inline void stop_signal_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = stop_signal_handler;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

// The number of the first stop signal received, 0 when none.
static inline int stop_signal_received(void) { return g_stop_signal; }

#endif
