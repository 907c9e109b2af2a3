// core/profile.cuh: a step profile by named part, timed with CUDA events on the compute stream (the table and the
// floors: core/profile.h). prof_step_begin records a first event; every prof_mark records one more, and the time
// between two consecutive events belongs to the part the later one names, so the parts tile the step and add up
// to its time (host gaps included: the GPU waiting for the host shows up in the part that follows it). Events only
// observe the stream, so a profiled step computes the same bits as an unprofiled one. Off (a NULL profiler, or
// outside begin..end) a mark costs one branch. Events recorded inside a CUDA graph capture cannot be timed: a
// captured step must be profiled outside its graph.
#ifndef SDM_CORE_PROFILE_CUH
#define SDM_CORE_PROFILE_CUH

#include "core/cuda_common.cuh"
#include "core/profile.h"

typedef struct {
    ProfTable table;
    int on;              // inside prof_step_begin .. prof_step_end
    int n_events, cap;   // events recorded this step; pool size (grows during the first step)
    cudaEvent_t *events; // [cap]
    int *part;           // [cap] the part of the region that ends at each event (-1: the step's start)
} Profiler;

static inline Profiler *prof_create(double peak_tflops, double hbm_tbps) {
    Profiler *p = (Profiler *)sdm_calloc(1, sizeof(Profiler));
    p->table = prof_table_make(peak_tflops, hbm_tbps);
    return p;
}

static inline void prof_destroy(Profiler *p) {
    if (!p) return;
    for (int i = 0; i < p->cap; i++) cudaCheck(cudaEventDestroy(p->events[i]));
    free(p->events);
    free(p->part);
    free(p);
}

static inline void prof_record(Profiler *p, int part, cudaStream_t s) {
    if (p->n_events == p->cap) {
        int cap = p->cap ? 2 * p->cap : 256;
        p->events = (cudaEvent_t *)realloc(p->events, cap * sizeof(cudaEvent_t));
        p->part = (int *)realloc(p->part, cap * sizeof(int));
        if (!p->events || !p->part) sdm_die("profile: out of host memory");
        for (int i = p->cap; i < cap; i++) cudaCheck(cudaEventCreate(&p->events[i]));
        p->cap = cap;
    }
    p->part[p->n_events] = part;
    cudaCheck(cudaEventRecord(p->events[p->n_events++], s));
}

static inline void prof_step_begin(Profiler *p, cudaStream_t s) {
    if (!p) return;
    p->on = 1;
    p->n_events = 0;
    prof_record(p, -1, s);
}

// The region since the previous mark was part `name`; it did `flops` and had to move `bytes` (0: none counted,
// PROF_NA: unknown). The work is a floor, so counting only the GEMMs of a region that also has element-wise
// kernels still gives a lower bound.
static inline void prof_mark(Profiler *p, const char *name, double flops, double bytes, cudaStream_t s) {
    if (!p || !p->on) return;
    int i = prof_part(&p->table, name);
    prof_add_work(&p->table, i, flops, bytes);
    prof_record(p, i, s);
}

// End of a step: waits for its last event, then adds its region times to the table when `keep` (a warm-up step
// passes 0: it grows the event pool and is forgotten, floors included).
static inline void prof_step_end(Profiler *p, int keep) {
    if (!p) return;
    p->on = 0;
    if (p->n_events == 0) return;
    cudaCheck(cudaEventSynchronize(p->events[p->n_events - 1]));
    if (!keep) {
        ProfTable fresh = prof_table_make(p->table.peak_flops / 1e12, p->table.bandwidth / 1e12);
        p->table = fresh;
        return;
    }
    for (int i = 1; i < p->n_events; i++) {
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, p->events[i - 1], p->events[i]));
        p->table.part[p->part[i]].ms += ms;
    }
    p->table.steps++;
}

#endif
