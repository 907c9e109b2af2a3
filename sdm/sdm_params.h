// sdm/sdm_params.h: the parameter tensors of one SDM layer, listed once. The model's parameter table
// (model/model.h), the GPU model's views (model/gpu_model.cuh), the CPU model (model/model_ref.h) and the reference
// layer (sdm/sdm_ref.h) all expand SDM_PARAMS, so a tensor is added or renamed in one place.
#ifndef SDM_SDM_PARAMS_H
#define SDM_SDM_PARAMS_H

#include <stddef.h>

#include "core/common.h"
#include "sdm/sdm_dims.h"

// X(name, rows, cols, present, init, decay) in parameter-table order (docs/MODEL.md#parameter-table): the input
// weights wk..wg are consecutive (one fused GEMM reads them), then their biases bk..bg in the same order.
// rows, cols (0: a vector) and present are expressions in `s` (const SdmDims *); init names the rule of
// docs/MODEL.md#initialisation (TRUNC_NORMAL: at the layer's std); decay: AdamW's weight decay applies.
#define SDM_PARAMS(X)                                                                              \
    X(wk,      s->heads * s->key_dim, s->dim,      1,                     TRUNC_NORMAL, 1)         \
    X(wq,      s->heads * s->key_dim, s->dim,      1,                     TRUNC_NORMAL, 1)         \
    X(wv,      s->dim,                s->dim,      1,                     TRUNC_NORMAL, 1)         \
    X(wa,      s->heads,              s->dim,      1,                     TRUNC_NORMAL, 1)         \
    X(wb,      s->heads,              s->dim,      1,                     TRUNC_NORMAL, 1)         \
    X(wg,      s->dim,                s->dim,      s->output_gate,        TRUNC_NORMAL, 1)         \
    X(bk,      s->heads * s->key_dim, 0,           1,                     ZEROS,        1)         \
    X(bq,      s->heads * s->key_dim, 0,           1,                     ZEROS,        1)         \
    X(bv,      s->dim,                0,           1,                     ZEROS,        1)         \
    X(ba,      s->heads,              0,           1,                     ZEROS,        1)         \
    X(bb,      s->heads,              0,           1,                     ZEROS,        1)         \
    X(bg,      s->dim,                0,           s->output_gate,        ZEROS,        1)         \
    X(A_log,   s->heads,              0,           1,                     A_LOG,        0)         \
    X(dt_bias, s->heads,              0,           1,                     DT_BIAS,      0)         \
    X(ln_w,    s->head_dim,           0,           s->normalize_readings, ONES,         1)         \
    X(ln_b,    s->head_dim,           0,           s->normalize_readings, ZEROS,        1)         \
    X(wo,      s->dim,                s->dim,      1,                     TRUNC_NORMAL, 1)         \
    X(bo,      s->dim,                0,           1,                     ZEROS,        1)         \
    X(bank,    s->heads * s->slots,   s->head_dim, s->learned_bank,       TRUNC_NORMAL, 1)

// SDM_P_wk, ..., SDM_P_bank: the tensors' indices in list order.
#define SDM_PARAM_INDEX(name, ...) SDM_P_##name,
typedef enum { SDM_PARAMS(SDM_PARAM_INDEX) SDM_P_COUNT } SdmParam;
#undef SDM_PARAM_INDEX

static inline const char *sdm_param_name(int which) {
#define SDM_PARAM_NAME(name, ...) #name,
    static const char *const names[SDM_P_COUNT] = {SDM_PARAMS(SDM_PARAM_NAME)};
#undef SDM_PARAM_NAME
    return names[which];
}

// Element count of tensor `which`; 0 when the configuration has no such tensor.
static inline size_t sdm_param_numel(const SdmDims *s, int which) {
    switch (which) {
#define SDM_PARAM_NUMEL(name, rows, cols, present, ...) \
    case SDM_P_##name: return (present) ? (size_t)(rows) * (size_t)((cols) ? (cols) : 1) : 0;
        SDM_PARAMS(SDM_PARAM_NUMEL)
#undef SDM_PARAM_NUMEL
    default: sdm_die("sdm_param_numel: no parameter %d", which); return 0;
    }
}

#endif
