// tests/test_data_util.h: temporary directories and whole-file helpers for the data tests.
// The including .c file defines _POSIX_C_SOURCE 200809L before any include (mkdtemp).
#ifndef SDM_TESTS_TEST_DATA_UTIL_H
#define SDM_TESTS_TEST_DATA_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/common.h"

#define TEST_PATH_LEN 512

static inline void test_tmpdir(char dir[TEST_PATH_LEN]) {
    snprintf(dir, TEST_PATH_LEN, "/tmp/sdm_data_test_XXXXXX");
    if (!mkdtemp(dir)) sdm_die("cannot create a temporary directory");
}

static inline void test_rmdir(const char *dir) {
    char cmd[TEST_PATH_LEN + 32];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", dir);
}

static inline void test_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) sdm_die("cannot write %s", path);
}

// The whole file in a buffer of exactly *n bytes (so ASan catches any read past its end).
static inline uint8_t *test_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) sdm_die("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = (uint8_t *)sdm_malloc((size_t)size);
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) sdm_die("cannot read %s", path);
    fclose(f);
    *n = (size_t)size;
    return buf;
}

#endif
