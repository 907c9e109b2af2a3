// core/file.h: opening an input that must be a regular file (a config, a token shard). fopen() on a FIFO blocks
// until a writer appears and a device never ends, so the file is opened with O_NONBLOCK and refused by fstat
// unless it is a regular file, before any read.
#ifndef SDM_CORE_FILE_H
#define SDM_CORE_FILE_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// The file at path opened for reading, or NULL with the reason (without the path) in why[cap].
static inline FILE *sdm_fopen_regular(const char *path, char *why, size_t cap) {
    int fd = open(path, O_RDONLY | O_NONBLOCK);  // O_NONBLOCK: no effect on the regular files that pass
    if (fd < 0) { snprintf(why, cap, "cannot open: %s", strerror(errno)); return NULL; }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        snprintf(why, cap, "cannot open: not a regular file (a directory, FIFO or device)");
        return NULL;
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) { snprintf(why, cap, "cannot open: %s", strerror(errno)); close(fd); }
    return f;
}

#endif
