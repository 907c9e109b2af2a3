// core/common.h: error reporting and checked allocation shared by every program and test.
// Compiles as C11 (gcc) and as C++ (nvcc), so headers built on it can be included from .c and .cu files.
#ifndef SDM_CORE_COMMON_H
#define SDM_CORE_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// Print "sdm: <message>" to stderr and exit(1). Every user-facing error goes through here.
static inline void sdm_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("sdm: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static inline void *sdm_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) sdm_die("out of host memory allocating %zu bytes", bytes);
    return p;
}

static inline void *sdm_calloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) sdm_die("out of host memory allocating %zu x %zu bytes", count, size);
    return p;
}

// Marks the few plain-C helpers that device code calls too (the RNG, the AdamW element); empty for gcc.
#ifdef __CUDACC__
#define SDM_HOST_DEVICE __host__ __device__
#else
#define SDM_HOST_DEVICE
#endif

// Seconds on the monotonic clock: for durations and deadlines, never the time of day.
static inline double sdm_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define SDM_MIN(a, b) ((a) < (b) ? (a) : (b))
#define SDM_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif
