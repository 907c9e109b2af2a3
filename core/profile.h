// core/profile.h: the table of a step profile, without CUDA (so the CPU tests check it): named parts, each with its
// time summed over the profiled steps and its floor, the least time the work it did could take on this GPU:
//   floor = max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)   per timed region, summed
// A region whose work is not known (PROF_NA) makes its part's floor n/a, so a printed floor is never a guess.
// core/profile.cuh times the parts with CUDA events; the caller names them (core/ knows no model).
#ifndef SDM_CORE_PROFILE_H
#define SDM_CORE_PROFILE_H

#include "core/common.h"

#define PROF_MAX_PARTS 48
#define PROF_NA (-1.0) // flops or bytes of a region that are not known

typedef struct {
    const char *name;   // a string literal of the caller: parts are found by pointer first, then by text
    double ms;          // summed over the profiled steps
    double floor_ms;    // summed over the profiled steps; meaningless when na
    int na;             // some region of this part had unknown work
} ProfPart;

typedef struct {
    double peak_flops, bandwidth; // FLOP/s and bytes/s of the floors
    int steps;                    // steps accumulated
    int n_parts;                  // in order of first appearance: the order of the step
    ProfPart part[PROF_MAX_PARTS];
} ProfTable;

static inline ProfTable prof_table_make(double peak_tflops, double hbm_tbps) {
    ProfTable t;
    memset(&t, 0, sizeof t);
    t.peak_flops = peak_tflops * 1e12;
    t.bandwidth = hbm_tbps * 1e12;
    return t;
}

// Index of part `name`, added at the end when new.
static inline int prof_part(ProfTable *t, const char *name) {
    for (int i = 0; i < t->n_parts; i++)
        if (t->part[i].name == name || !strcmp(t->part[i].name, name)) return i;
    if (t->n_parts == PROF_MAX_PARTS) sdm_die("profile: more than %d parts", PROF_MAX_PARTS);
    ProfPart *p = &t->part[t->n_parts];
    memset(p, 0, sizeof *p);
    p->name = name;
    return t->n_parts++;
}

// The floor of one region (ms), or PROF_NA when its work is unknown.
static inline double prof_floor_ms(const ProfTable *t, double flops, double bytes) {
    if (flops < 0 || bytes < 0 || (flops == 0 && bytes == 0)) return PROF_NA;
    return 1e3 * SDM_MAX(flops / t->peak_flops, bytes / t->bandwidth);
}

// Add one region's work to part i (its time comes later, from the events).
static inline void prof_add_work(ProfTable *t, int i, double flops, double bytes) {
    double f = prof_floor_ms(t, flops, bytes);
    if (f < 0) t->part[i].na = 1;
    else t->part[i].floor_ms += f;
}

// The table, one line per part in step order: ms per step, share of the step, floor per step, floor / time (how
// close the part runs to its floor), and a total line.
static inline void prof_print(const ProfTable *t, FILE *fp) {
    double total = 0, floor_total = 0;
    int floor_na = 0;
    for (int i = 0; i < t->n_parts; i++) {
        total += t->part[i].ms;
        floor_total += t->part[i].floor_ms;
        floor_na |= t->part[i].na;
    }
    int steps = t->steps > 0 ? t->steps : 1;
    fprintf(fp, "profile: %d steps, floors at %.0f TFLOP/s and %.2f TB/s (n/a: work not counted)\n", t->steps,
            t->peak_flops / 1e12, t->bandwidth / 1e12);
    fprintf(fp, "  %-24s %10s %7s %10s %11s\n", "part", "ms/step", "share", "floor ms", "floor/time");
    for (int i = 0; i < t->n_parts; i++) {
        const ProfPart *p = &t->part[i];
        fprintf(fp, "  %-24s %10.3f %6.1f%%", p->name, p->ms / steps, total > 0 ? 100 * p->ms / total : 0.0);
        if (p->na) fprintf(fp, " %10s %11s\n", "n/a", "n/a");
        else fprintf(fp, " %10.3f %10.1f%%\n", p->floor_ms / steps, p->ms > 0 ? 100 * p->floor_ms / p->ms : 0.0);
    }
    fprintf(fp, "  %-24s %10.3f %6.1f%% %10.3f", "total", total / steps, 100.0, floor_total / steps);
    if (floor_na) fprintf(fp, " %11s\n", "known parts"); // the n/a parts' floors are left out of the sum
    else fprintf(fp, " %10.1f%%\n", total > 0 ? 100 * floor_total / total : 0.0);
}

#endif
