// tests/test.h: the tiny test harness every test binary uses.
// CHECK records a pass or a failure with a message; test_summary() prints "N passed, N failed" last
// and returns the exit status (non-zero on any failure). C11 and C++ compatible.
#ifndef SDM_TESTS_TEST_H
#define SDM_TESTS_TEST_H

#include <math.h>
#include <stdio.h>

static int g_test_passed = 0, g_test_failed = 0;

#define CHECK(cond, ...)                                                         \
    do {                                                                         \
        if (cond) {                                                              \
            g_test_passed++;                                                     \
        } else {                                                                 \
            g_test_failed++;                                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                          \
            printf(__VA_ARGS__);                                                 \
            printf("\n");                                                        \
        }                                                                        \
    } while (0)

// ||a - b|| / max(||b||, tiny): the relative error of a against the reference b. NaN stays NaN.
static inline double rel_error(const double *a, const double *b, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = a[i] - b[i];
        num += e * e;
        den += b[i] * b[i];
    }
    return sqrt(num) / (den > 1e-300 ? sqrt(den) : 1e-150);
}

// Check a against the reference b with relative tolerance tol; prints the error either way when verbose.
static inline int check_close(const char *what, const double *a, const double *b, size_t n, double tol) {
    double err = rel_error(a, b, n);
    int ok = err <= tol; // false for NaN
    CHECK(ok, "%s: relative error %.3e > tolerance %.1e", what, err, tol);
    return ok;
}

static inline int test_summary(void) {
    printf("%d passed, %d failed\n", g_test_passed, g_test_failed);
    return g_test_failed != 0;
}

#endif
