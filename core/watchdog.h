// core/watchdog.h: a thread that ends a run which stopped making progress, instead of letting it hang.
//
// NCCL waits without a timeout: when a rank dies (killed, out of memory, a node lost) outside a launcher that stops
// the others, the surviving ranks wait in their next collective for ever, holding their GPUs. The watchdog runs beside
// the training loop. The loop calls watchdog_beat at each point of progress (a step done, a checkpoint piece sent or
// received, an evaluation batch); every poll_s seconds the thread asks `poll` for an error (core/dist.cuh: NCCL's
// asynchronous error of the communicator, which reports a peer's lost connection) and checks the time since the last
// beat. On an error, or no beat for timeout_s seconds, it calls `fire` once with a message naming the last progress;
// fire does not return (dist.cuh aborts the communicator and ends the process). A healthy rank also stops beating
// while it waits for a slow peer (rank 0 reading a large checkpoint, say), so timeout_s must exceed the longest such
// wait: that is why the limit is a setting (distributed.timeout).
// Plain C with POSIX threads; tests/test_watchdog.c checks it with fake poll and fire functions.
#ifndef SDM_CORE_WATCHDOG_H
#define SDM_CORE_WATCHDOG_H

#include <errno.h>
#include <pthread.h>
#include <time.h>

#include "core/common.h"

#define WATCH_MSG 512

typedef const char *(*WatchPoll)(void *ctx);           // an error message, or NULL while all is well
typedef void (*WatchFire)(void *ctx, const char *why); // ends the process (a test's may return)

typedef struct {
    double timeout_s, poll_s; // no beat for timeout_s fires (0: only poll's errors do); checked every poll_s
    WatchPoll poll;           // may be NULL
    WatchFire fire;
    void *ctx;
    pthread_t thread;
    pthread_mutex_t mu;       // guards what follows
    pthread_cond_t wake;      // watchdog_stop wakes the thread at once
    double last_beat;         // monotonic seconds
    const char *what;         // the last progress: what (a static string) and at (a step, a piece; -1: none)
    long long at;
    int running, stopping;
    char why[WATCH_MSG];      // the message fire got
} Watchdog;

// The message when the thread should fire, into why; 0 while all is well. Called with mu held.
static inline int watch_verdict(Watchdog *w, double now) {
    const char *error = w->poll ? w->poll(w->ctx) : NULL;
    double quiet = now - w->last_beat;
    if (!error && !(w->timeout_s > 0 && quiet > w->timeout_s)) return 0;
    char last[128];
    if (w->at >= 0) snprintf(last, sizeof last, "%s %lld", w->what, w->at);
    else snprintf(last, sizeof last, "%s", w->what);
    if (error) snprintf(w->why, WATCH_MSG, "%s (the last progress, %.0f s before: %s)", error, quiet, last);
    else snprintf(w->why, WATCH_MSG, "no progress for %.0f s (the last: %s)", quiet, last);
    return 1;
}

static void *watch_thread(void *arg) {
    Watchdog *w = (Watchdog *)arg;
    pthread_mutex_lock(&w->mu);
    while (!w->stopping) {
        double wake_at = sdm_now_s() + w->poll_s;
        struct timespec ts;
        ts.tv_sec = (time_t)wake_at;
        ts.tv_nsec = (long)((wake_at - (double)ts.tv_sec) * 1e9);
        while (!w->stopping && pthread_cond_timedwait(&w->wake, &w->mu, &ts) != ETIMEDOUT) {
        }
        if (w->stopping || !watch_verdict(w, sdm_now_s())) continue;
        pthread_mutex_unlock(&w->mu); // fire may take long (an abort), and a test's beats go on meanwhile
        w->fire(w->ctx, w->why);
        return NULL;
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

// Start watching; the start counts as the first beat (what, with no number).
static inline void watchdog_start(Watchdog *w, double timeout_s, double poll_s, WatchPoll poll, WatchFire fire,
                                  void *ctx, const char *what) {
    memset(w, 0, sizeof *w);
    w->timeout_s = timeout_s;
    w->poll_s = poll_s;
    w->poll = poll;
    w->fire = fire;
    w->ctx = ctx;
    w->what = what;
    w->at = -1;
    w->last_beat = sdm_now_s();
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); // the waits' deadlines are sdm_now_s() times
    if (pthread_mutex_init(&w->mu, NULL) != 0 || pthread_cond_init(&w->wake, &attr) != 0 ||
        pthread_create(&w->thread, NULL, watch_thread, w) != 0)
        sdm_die("cannot start the watchdog thread");
    pthread_condattr_destroy(&attr);
    w->running = 1;
}

// Progress: `what` (a string that outlives the watchdog) number `at` (-1: no number) is done; what = NULL only
// restarts the clock, keeping the last label (a collective call inside a step).
static inline void watchdog_beat(Watchdog *w, const char *what, long long at) {
    if (!w->running) return;
    pthread_mutex_lock(&w->mu);
    w->last_beat = sdm_now_s();
    if (what) {
        w->what = what;
        w->at = at;
    }
    pthread_mutex_unlock(&w->mu);
}

// Stop and join the thread (at once, not after a poll interval); a no-op on a watchdog never started.
static inline void watchdog_stop(Watchdog *w) {
    if (!w->running) return;
    pthread_mutex_lock(&w->mu);
    w->stopping = 1;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->mu);
    w->running = 0;
}

#endif
