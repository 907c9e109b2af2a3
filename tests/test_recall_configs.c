// tests/test_recall_configs.c: the demo configs (configs/recall_*.cfg, scripts/recall_demo.sh) load and validate,
// agree on everything but the mixers (size, schedule, data), and have the mixers they claim: SWA + SDM with no
// full-attention layer, SWA only, full attention only.
#include "core/config.h"
#include "model/model.h"
#include "tests/test.h"

static ModelDesc g_model; // large: keep it off the stack

static void count_kinds(const char *file, Config *c, int kinds[3]) {
    char err[CFG_ERR] = "";
    char *argv[] = {(char *)"test", (char *)"-c", (char *)file};
    int ok = cfg_from_args(c, 3, argv, err);
    CHECK(ok, "%s does not load: %s", file, err);
    kinds[0] = kinds[1] = kinds[2] = 0;
    if (!ok) return;
    model_build(&g_model, c);
    for (int l = 0; l < g_model.n_layers; l++) {
        kinds[0] += g_model.kind[l] == LAYER_ATTN;
        kinds[1] += g_model.kind[l] == LAYER_SWA;
        kinds[2] += g_model.kind[l] == LAYER_SDM;
    }
    printf("%s: %d attention, %d SWA, %d SDM layers, %lld non-embedding parameters\n", file, kinds[0], kinds[1],
           kinds[2], g_model.n_nonembedding);
}

int main(void) {
    Config sdm, swa, full;
    int k_sdm[3], k_swa[3], k_full[3];
    count_kinds("configs/recall_sdm.cfg", &sdm, k_sdm);
    count_kinds("configs/recall_swa.cfg", &swa, k_swa);
    count_kinds("configs/recall_full.cfg", &full, k_full);
    CHECK(k_sdm[0] == 0 && k_sdm[1] > 0 && k_sdm[2] > 0, "recall_sdm: must be SWA + SDM without full attention");
    CHECK(k_swa[0] == 0 && k_swa[2] == 0 && k_swa[1] == swa.n_layers, "recall_swa: must be SWA only");
    CHECK(k_full[1] == 0 && k_full[2] == 0 && k_full[0] == full.n_layers, "recall_full: must be full attention only");
    CHECK(sdm.swa_window == swa.swa_window && sdm.swa_window > 0 && sdm.swa_window < sdm.seq_len, "SWA windows differ");
    const Config *c[3] = {&sdm, &swa, &full};
    int differ = 0;
    for (int i = 1; i < 3; i++)
        differ += c[i]->dim != sdm.dim || c[i]->n_layers != sdm.n_layers || c[i]->steps != sdm.steps ||
                  c[i]->batch_size != sdm.batch_size || c[i]->seq_len != sdm.seq_len || c[i]->lr != sdm.lr ||
                  c[i]->warmup != sdm.warmup || c[i]->eval_every != sdm.eval_every ||
                  c[i]->eval_steps != sdm.eval_steps || c[i]->seed != sdm.seed ||
                  strcmp(c[i]->train_data, sdm.train_data) || strcmp(c[i]->val_data, sdm.val_data) ||
                  strcmp(c[i]->eval_task, sdm.eval_task);
    CHECK(differ == 0, "the demo configs differ beyond their mixers");
    CHECK(sdm.steps % sdm.eval_every == 0, "steps %d is not a multiple of eval_every %d: no evaluation at the end",
          sdm.steps, sdm.eval_every);
    CHECK(strstr(sdm.train_data, "mqar_train") && strstr(sdm.val_data, "mqar_val") && !strcmp(sdm.eval_task, "mqar"),
          "the demo configs must train and score MQAR");
    return test_summary();
}
