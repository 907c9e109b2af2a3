// train_sdm.cu: trains a hybrid SWA / full-attention / SDM language model.
//
//   ./train_sdm -c configs/sdm_flagship.cfg [key=value ...]
//
// Status: the config, the model description and its parameter table are in place; this program prints the model it
// would train and the memory it would need. The training loop lands with the GPU kernels (see README.md, Status).
#include "core/common.h"
#include "core/config.h"
#include "core/model.h"

static void usage(void) {
    printf("usage: train_sdm -c CONFIG.cfg [key=value ...]\n"
           "  -c FILE     config file (see configs/); later key=value arguments override it\n"
           "  --help      this text and every config key\n\n");
    cfg_print_help(stdout);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { usage(); return 0; }

    // 1. configuration: file, then command-line overrides, then cross-field validation
    Config cfg;
    char err[CFG_ERR];
    if (!cfg_from_args(&cfg, argc, argv, err)) sdm_die("%s", err);

    // 2. the model: layer kinds and the ordered parameter table
    ModelDesc *model = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    model_build(model, &cfg);
    model_print_summary(model, &cfg, stdout);
    printf("  training memory estimate per GPU (B=%d, T=%d): %.1f GiB\n", cfg.batch_size, cfg.seq_len,
           model_train_memory_bytes(model, &cfg, 1) / (1 << 30));

    printf("train_sdm: the training loop is not built yet; nothing was trained\n");
    free(model);
    return 0;
}
