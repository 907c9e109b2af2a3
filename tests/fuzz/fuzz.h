// tests/fuzz/fuzz.h: helpers shared by the libFuzzer harnesses (tests/fuzz/fuzz_*.c, built by `make fuzz`).
// A harness feeds the fuzzer's bytes to the real parser, unchanged, and checks what the parser promises (a refusal
// names the file and where; an accepted input is what it claims to be). A broken promise aborts: libFuzzer saves the
// input as a crash, like an ASan or UBSan report.
#ifndef SDM_TESTS_FUZZ_H
#define SDM_TESTS_FUZZ_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// A broken promise: print it and abort (libFuzzer keeps the input).
#define FUZZ_ASSERT(cond, ...)                                                   \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "fuzz: %s:%d: broken promise: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                        \
            fputc('\n', stderr);                                                 \
            abort();                                                             \
        }                                                                        \
    } while (0)

// Scratch files live in a per-process folder: $FUZZ_TMP/sdm_fuzz_PID (else /dev/shm, in memory, else /tmp), removed
// with the files fuzz_path named when the process exits normally.
static char g_fuzz_dir[400], g_fuzz_files[32][512];
static int g_fuzz_nfiles;

static inline void fuzz_cleanup(void) {
    for (int i = 0; i < g_fuzz_nfiles; i++) remove(g_fuzz_files[i]);
    rmdir(g_fuzz_dir);
}

// dir/name in the per-process folder (fixed names, so corpus inputs that name a file, a manifest's lines, match).
static inline const char *fuzz_path(const char *name) {
    if (!g_fuzz_dir[0]) {
        const char *dir = getenv("FUZZ_TMP");
        if (!dir) dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(g_fuzz_dir, sizeof g_fuzz_dir, "%.300s/sdm_fuzz_%ld", dir, (long)getpid());
        if (mkdir(g_fuzz_dir, 0700) != 0 && errno != EEXIST) {
            fprintf(stderr, "fuzz: cannot create %s\n", g_fuzz_dir);
            abort();
        }
        atexit(fuzz_cleanup);
    }
    for (int i = 0; i < g_fuzz_nfiles; i++)
        if (!strcmp(strrchr(g_fuzz_files[i], '/') + 1, name)) return g_fuzz_files[i];
    if (g_fuzz_nfiles == 32) abort();
    char *p = g_fuzz_files[g_fuzz_nfiles++];
    snprintf(p, sizeof g_fuzz_files[0], "%s/%.100s", g_fuzz_dir, name);
    return p;
}

static inline void fuzz_write_file(const char *path, const uint8_t *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        fprintf(stderr, "fuzz: cannot write %s\n", path);
        abort();
    }
}

// data[0..n) as a NUL-terminated string (interior NULs end it early, as for a C string); malloc'ed.
static inline char *fuzz_cstring(const uint8_t *data, size_t n) {
    char *s = (char *)malloc(n + 1);
    if (!s) abort();
    if (n) memcpy(s, data, n);
    s[n] = 0;
    return s;
}

#endif
