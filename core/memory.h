// core/memory.h: the device-memory ledger. Every device buffer of a run is allocated through device_alloc
// (core/cuda_common.cuh), which records its bytes under one category; the start-up estimate, the step line and
// `train_sdm --memory` all read this one table. In a dry run device_alloc only records and returns NULL, so the
// breakdown of any config comes from the very code that allocates, also on a machine without a GPU.
// Plain C: the table and its printing need no CUDA. Categories and what fills them: docs/MODEL.md#memory.
#ifndef SDM_CORE_MEMORY_H
#define SDM_CORE_MEMORY_H

#include "core/common.h"

typedef enum {
    MEM_WEIGHTS,     // working weights in the compute dtype
    MEM_MASTER,      // fp32 master weights
    MEM_ADAMW,       // AdamW m and v
    MEM_GRADS,       // fp32 parameter gradients
    MEM_ACTIVATIONS, // activations saved for the backward (and the forward's own buffers)
    MEM_SDM_SAVED,   // SDM banks and the op's saved state (snapshots, WY quantities)
    MEM_BANK_GRADS,  // per-sequence bank gradients [B, H, N, d], fp32 or bf16 (sdm.grad_bank_dtype)
    MEM_SCRATCH,     // backward temporaries, shared by the layers
    MEM_STAGING,     // the bounded buffer of copies to and from the host in pieces (loading weights, checkpoints)
    MEM_CUBLAS,      // the cuBLASLt workspace
    MEM_NCCL,        // NCCL's own buffers (measured when the communicator is created)
    MEM_CONTEXT,     // CUDA context and libraries (measured before the first allocation)
    MEM_KINDS
} MemKind;

static const char *const MEM_KIND_NAMES[MEM_KINDS] = {
    "working weights", "fp32 master weights", "AdamW m, v", "gradients (fp32)", "activations saved for backward",
    "SDM banks + saved state", "per-sequence bank gradients", "backward scratch (shared)", "host copy staging",
    "cuBLAS workspace", "NCCL buffers", "CUDA context"};

// Bytes of the MEM_STAGING buffer: arrays of any size pass to and from the host through it, so no whole-array
// temporary is needed on the device; it lives only during such a copy, so the steady-state total leaves it out.
#define MEM_STAGE_BYTES ((size_t)64 << 20)

#define MEM_MAX_LIVE 8192 // live allocations the ledger can track (a flagship run has about 400)

typedef struct {
    size_t bytes[MEM_KINDS]; // live bytes per category
    size_t live, peak;       // live total and its maximum
    int dry_run;             // record only: device_alloc returns NULL
    int n_live;
    struct { void *ptr; size_t bytes; MemKind kind; } entry[MEM_MAX_LIVE];
} MemLedger;

static MemLedger g_mem; // the process's ledger

static inline void mem_record(MemKind kind, size_t bytes) {
    g_mem.bytes[kind] += bytes;
    g_mem.live += bytes;
    g_mem.peak = SDM_MAX(g_mem.peak, g_mem.live);
}

// A real allocation, remembered so that mem_forget can subtract it when it is freed.
static inline void mem_remember(void *ptr, MemKind kind, size_t bytes) {
    if (g_mem.n_live == MEM_MAX_LIVE) sdm_die("memory ledger: more than %d live device buffers", MEM_MAX_LIVE);
    g_mem.entry[g_mem.n_live].ptr = ptr;
    g_mem.entry[g_mem.n_live].bytes = bytes;
    g_mem.entry[g_mem.n_live].kind = kind;
    g_mem.n_live++;
    mem_record(kind, bytes);
}

static inline void mem_forget(void *ptr) {
    for (int i = 0; i < g_mem.n_live; i++)
        if (g_mem.entry[i].ptr == ptr) {
            g_mem.bytes[g_mem.entry[i].kind] -= g_mem.entry[i].bytes;
            g_mem.live -= g_mem.entry[i].bytes;
            g_mem.entry[i] = g_mem.entry[--g_mem.n_live];
            return;
        }
}

static inline double mem_gib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0 * 1024.0); }

// The breakdown: one line per non-empty category (GiB, share of the total, bytes), then the total.
static inline void mem_print(FILE *fp, const char *title) {
    fprintf(fp, "%s\n", title);
    for (int k = 0; k < MEM_KINDS; k++)
        if (g_mem.bytes[k])
            fprintf(fp, "  %-34s %10.3f GiB  %5.1f%%  %15zu bytes\n", MEM_KIND_NAMES[k], mem_gib(g_mem.bytes[k]),
                    100.0 * (double)g_mem.bytes[k] / (double)g_mem.live, g_mem.bytes[k]);
    fprintf(fp, "  %-34s %10.3f GiB  %5.1f%%  %15zu bytes\n", "total", mem_gib(g_mem.live), 100.0, g_mem.live);
}

#endif
