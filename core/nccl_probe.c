// core/nccl_probe.c: the Makefile's NCCL probe. Compiled and linked (nothing runs) to learn whether nccl.h and libnccl
// are usable; preprocessed with -DSDM_NCCL_VERSION to read the version from the header. A file rather than a
// printf through $(shell), whose '#' escaping differs between GNU Make 3.82 and 4.x.
#include <nccl.h>
#ifdef SDM_NCCL_VERSION
sdm_nccl_version NCCL_MAJOR NCCL_MINOR NCCL_PATCH
#else
int main(void) {
    int v;
    return ncclGetVersion(&v) != ncclSuccess;
}
#endif
