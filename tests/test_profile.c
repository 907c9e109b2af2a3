// tests/test_profile.c: the measurement side of training: the step profile's table (core/profile.h: parts in step
// order, floors, n/a, the printed layout).
#include "core/profile.h"
#include "tests/test.h"

// The printed table of `t` as a string (caller frees).
static char *print_to_string(const ProfTable *t) {
    char *buf = NULL;
    size_t len = 0;
    FILE *fp = open_memstream(&buf, &len);
    prof_print(t, fp);
    fclose(fp);
    return buf;
}

// Two steps of three parts: a GEMM region (20 ms floor at 100 TFLOP/s), a copy (2 ms at 2 TB/s) and host time of
// unknown work, found again by text and by pointer.
static void test_table(void) {
    ProfTable t = prof_table_make(100, 2);
    char gemm[] = "GEMM"; // another pointer with the same text: the same part
    for (int step = 0; step < 2; step++) {
        prof_add_work(&t, prof_part(&t, "GEMM"), 2e12, 0);
        prof_add_work(&t, prof_part(&t, "copy"), 0, 4e9);
        prof_add_work(&t, prof_part(&t, "host"), PROF_NA, PROF_NA);
        t.part[prof_part(&t, gemm)].ms += 25;
        t.part[prof_part(&t, "copy")].ms += 5;
        t.part[prof_part(&t, "host")].ms += 20;
        t.steps++;
    }
    CHECK(t.n_parts == 3, "%d parts, want 3", t.n_parts);
    CHECK(fabs(prof_floor_ms(&t, 1e12, 1e9) - 10) < 1e-12, "floor of 1 TFLOP and 1 GB: %g ms, want 10 (the FLOPs)",
          prof_floor_ms(&t, 1e12, 1e9));
    CHECK(fabs(prof_floor_ms(&t, 1e10, 1e9) - 0.5) < 1e-12, "floor of 10 GFLOP and 1 GB: %g ms, want 0.5 (the bytes)",
          prof_floor_ms(&t, 1e10, 1e9));
    CHECK(prof_floor_ms(&t, 0, 0) < 0 && prof_floor_ms(&t, PROF_NA, 1e9) < 0, "no or unknown work must give n/a");
    const char *want = "profile: 2 steps, floors at 100 TFLOP/s and 2.00 TB/s (n/a: work not counted)\n"
                       "  part                        ms/step   share   floor ms  floor/time\n"
                       "  GEMM                         25.000   50.0%     20.000       80.0%\n"
                       "  copy                          5.000   10.0%      2.000       40.0%\n"
                       "  host                         20.000   40.0%        n/a         n/a\n"
                       "  total                        50.000  100.0%     22.000 known parts\n";
    char *got = print_to_string(&t);
    CHECK(!strcmp(got, want), "table:\n%swant:\n%s", got, want);
    free(got);

    // every part known: the total line gives the whole step's floor / time
    ProfTable k = prof_table_make(100, 2);
    prof_add_work(&k, prof_part(&k, "GEMM"), 2e12, 0);
    k.part[0].ms = 40;
    k.steps = 1;
    got = print_to_string(&k);
    CHECK(strstr(got, "  total                        40.000  100.0%     20.000       50.0%\n") != NULL,
          "total line of a fully known table:\n%s", got);
    free(got);
}

int main(void) {
    test_table();
    return test_summary();
}
