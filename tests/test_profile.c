// tests/test_profile.c: the measurement side of training: the step profile's table (core/profile.h: parts in step
// order, floors, n/a, the printed layout) and the model FLOPs behind MFU (model_flops_per_token, against a hand
// count of debug_hybrid; docs/MODEL.md#model-flops).
#include "core/profile.h"
#include "model/model.h"
#include "tests/test.h"

static ModelDesc g_model;

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

// attn_mask_pairs against counting the visible keys position by position.
static void test_mask_pairs(void) {
    int Ts[] = {1, 7, 128, 2048}, ws[] = {0, 1, 5, 128, 256, 4096};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 6; j++) {
            double n = 0;
            for (int p = 0; p < Ts[i]; p++) n += ws[j] == 0 ? p + 1 : SDM_MIN(p + 1, ws[j]);
            CHECK(attn_mask_pairs(Ts[i], ws[j]) == n, "T=%d w=%d: %g pairs, want %g", Ts[i], ws[j],
                  attn_mask_pairs(Ts[i], ws[j]), n);
        }
}

static const ModelDesc *load(const char *override) {
    Config c;
    char err[CFG_ERR];
    char *argv[] = {(char *)"test", (char *)"-c", (char *)"configs/debug_hybrid.cfg", (char *)override};
    if (!cfg_from_args(&c, override ? 4 : 3, argv, err)) sdm_die("%s", err);
    model_build(&g_model, &c);
    return &g_model;
}

// debug_hybrid (D = 1024, F = 2816, V = 258, T = 2048) counted by hand from configs/debug_hybrid.cfg.
static void test_flops_debug_hybrid(void) {
    double D = 1024, F = 2816, V = 258, T = 2048;
    double swa = (4 * 64 + 2 * 2 * 64) * D + D * 4 * 64;  // wq [256, D], wk, wv [128, D], wo [D, 256]
    double attn = 4 * D * D;                              // wq, wk, wv, wo [D, D] (8 heads of 128)
    double sdm = 2 * 128 * D + D * D + 2 * D + 2 * D * D; // wk, wq [H K = 128, D], wv, wa, wb [1, D], wg, wo
    double ffn = 3 * F * D, head = V * D;
    double matmul = 2 * swa + 2 * attn + 4 * sdm + 8 * ffn + head;
    // per token and layer 12 d_h per query head and visible key: SWA w = 256 sees 256·257/2 + (T - 256)·256 keys
    // over the sequence, full attention T(T+1)/2
    double swa_keys = (256.0 * 257 / 2 + (T - 256) * 256) / T, full_keys = (T + 1) / 2;
    double want = 6 * matmul + 2 * 12 * 4 * 64 * swa_keys + 2 * 12 * 8 * 128 * full_keys;
    const ModelDesc *m = load(NULL);
    CHECK((double)model_matmul_params(m) == matmul, "matmul weights %lld, want %.0f", model_matmul_params(m), matmul);
    CHECK(model_flops_per_token(m, 2048) == want, "FLOPs per token %.0f, want %.0f", model_flops_per_token(m, 2048),
          want);
    CHECK(want == 585081216.0, "hand count %.0f, want 585081216", want);
    // the matmul weights are the non-embedding parameters less norms and biases, plus the LM head
    CHECK(matmul == 92837904 - (17 * D + 4 * (2 * 128 + 3 * D + 4)) + head, "hand count disagrees with the table");
    // tied: the token embedding is the LM head and counts once
    long long untied = model_matmul_params(m);
    CHECK(model_matmul_params(load("model.weight_tying=true")) == untied, "a tied head must count once");
}

int main(void) {
    test_table();
    test_mask_pairs();
    test_flops_debug_hybrid();
    return test_summary();
}
