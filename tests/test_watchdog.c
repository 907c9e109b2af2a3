// tests/test_watchdog.c: core/watchdog.h with fake poll and fire functions. It fires once when the beats stop or poll
// reports an error, naming the last progress; it stays quiet while the beats go on; watchdog_stop returns at once.
// The waits are functional, not speed checks: a case that must fire gets 20 s (it fires after 0.2 s), and the quiet
// cases beat every 5 ms against a 2 s limit, so a loaded CI machine would need to stall the test for 2 s to fail it.
#include "core/watchdog.h"
#include "tests/test.h"

typedef struct {
    int polls, error_after; // poll returns an error from call error_after on (0: never)
    volatile int fires;
    char why[WATCH_MSG];
} Fake;

static const char *fake_poll(void *ctx) {
    Fake *f = (Fake *)ctx;
    f->polls++;
    return f->error_after && f->polls >= f->error_after ? "peer connection lost" : NULL;
}

static void fake_fire(void *ctx, const char *why) {
    Fake *f = (Fake *)ctx;
    snprintf(f->why, WATCH_MSG, "%s", why);
    __atomic_add_fetch(&f->fires, 1, __ATOMIC_SEQ_CST);
}

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static int fires(Fake *f) { return __atomic_load_n(&f->fires, __ATOMIC_SEQ_CST); }

// Wait up to `limit` seconds for a fire, beating every 5 ms when beat is set; returns the seconds waited.
static double wait_fire(Watchdog *w, Fake *f, double limit, int beat) {
    double t0 = sdm_now_s();
    long long n = 0;
    while (!fires(f) && sdm_now_s() - t0 < limit) {
        if (beat) watchdog_beat(w, "step", ++n);
        sleep_s(0.005);
    }
    return sdm_now_s() - t0;
}

int main(void) {
    { // no beat after the start: fires once, naming the start
        Fake f = {0};
        Watchdog w;
        watchdog_start(&w, 0.2, 0.02, fake_poll, fake_fire, &f, "start");
        wait_fire(&w, &f, 20, 0);
        sleep_s(0.1); // time for a second fire, which must not come
        watchdog_stop(&w);
        CHECK(fires(&f) == 1, "silent run: %d fires, want 1", fires(&f));
        CHECK(strstr(f.why, "no progress") && strstr(f.why, "the last: start)"), "silent run: message '%s'", f.why);
    }
    { // beats, then silence: names the last beat
        Fake f = {0};
        Watchdog w;
        watchdog_start(&w, 0.2, 0.02, fake_poll, fake_fire, &f, "start");
        watchdog_beat(&w, "checkpoint piece", 7);
        watchdog_beat(&w, NULL, 99); // the clock only
        wait_fire(&w, &f, 20, 0);
        watchdog_stop(&w);
        CHECK(fires(&f) == 1 && strstr(f.why, "the last: checkpoint piece 7)"), "after a beat: %d fires, '%s'",
              fires(&f), f.why);
    }
    { // steady beats: quiet
        Fake f = {0};
        Watchdog w;
        watchdog_start(&w, 2.0, 0.02, fake_poll, fake_fire, &f, "start");
        wait_fire(&w, &f, 3.0, 1);
        watchdog_stop(&w);
        CHECK(fires(&f) == 0, "steady beats: fired ('%s')", f.why);
        CHECK(f.polls > 10, "steady beats: %d polls in 3 s, want many", f.polls);
    }
    { // poll's error fires while the beats go on, with no time limit at all
        Fake f = {0};
        f.error_after = 4;
        Watchdog w;
        watchdog_start(&w, 0, 0.02, fake_poll, fake_fire, &f, "start");
        wait_fire(&w, &f, 20, 1);
        watchdog_stop(&w);
        CHECK(fires(&f) == 1 && f.polls == 4, "poll error: %d fires after %d polls, want 1 after 4", fires(&f),
              f.polls);
        CHECK(!strncmp(f.why, "peer connection lost (the last progress, ", 41) && strstr(f.why, ": step "),
              "poll error: message '%s'", f.why);
    }
    { // no time limit and no error: quiet, even without beats
        Fake f = {0};
        Watchdog w;
        watchdog_start(&w, 0, 0.02, fake_poll, fake_fire, &f, "start");
        wait_fire(&w, &f, 0.5, 0);
        watchdog_stop(&w);
        CHECK(fires(&f) == 0 && f.polls > 2, "no limit: %d fires, %d polls", fires(&f), f.polls);
    }
    { // stop wakes the thread at once, long before its 100 s poll interval; a stopped watchdog never fires
        Fake f = {0};
        Watchdog w;
        watchdog_start(&w, 0.001, 100, fake_poll, fake_fire, &f, "start");
        sleep_s(0.1); // the thread is in its wait by now
        double t0 = sdm_now_s();
        watchdog_stop(&w);
        double took = sdm_now_s() - t0;
        CHECK(took < 50 && fires(&f) == 0 && f.polls == 0, "stop: %.1f s, %d fires, %d polls", took, fires(&f),
              f.polls);
        watchdog_beat(&w, "step", 1); // beats and stops after the stop are no-ops
        watchdog_stop(&w);
    }
    return test_summary();
}
