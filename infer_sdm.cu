// infer_sdm.cu: generates text from a checkpoint of a model trained by train_sdm.
//
//   ./infer_sdm -c CONFIG.cfg [key=value ...]
//
// Status: the config, the model description and its parameter table are in place; this program prints the model it
// would load. Generation lands with the GPU kernels and checkpoints (see README.md, Status).
#include "core/common.h"
#include "core/config.h"
#include "core/model.h"

static void usage(void) {
    printf("usage: infer_sdm -c CONFIG.cfg [key=value ...]\n"
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

    printf("infer_sdm: generation is not built yet\n");
    free(model);
    return 0;
}
