// sdm/sdm_dims.h: the hyper-parameters of one SDM layer (docs/SDM.md#hyper-parameters), shared by the CPU
// reference, the GPU kernels, the model description and the config parser.
#ifndef SDM_SDM_DIMS_H
#define SDM_SDM_DIMS_H

#define SDM_MAX_FACTORS 4

// weight activation over the k selected scores of one token and head (docs/SDM.md#weight-activations)
typedef enum { SDM_ACT_SOFTMAX = 0, SDM_ACT_L2_NORMALIZE, SDM_ACT_IDENTITY, SDM_ACT_SIGMOID } SdmAct;

// storage of the backward snapshots of touched bank rows (docs/SDM.md#snapshots)
typedef enum { SDM_SNAP_NONE = 0, SDM_SNAP_BF16, SDM_SNAP_FP8, SDM_SNAP_INT4 } SdmSnapshot;

typedef struct {
    int dim;                          // D, model width
    int heads;                        // H
    int head_dim;                     // d = D / H, width of a bank row
    int slots;                        // N, slots per head = product of factor_dims
    int n_factors;                    // F >= 1
    int factor_dims[SDM_MAX_FACTORS]; // n_1..n_F, first factor most significant in the slot index
    int key_dim;                      // K = sum of factor_dims: score columns per head
    int writes, reads;                // W, R: slots touched per token and head
    int chunk;                        // C: chunk length of the WY form (speed knob only)
    SdmAct write_act, read_act;
    float write_scale, read_scale;    // softmax temperature multipliers
    int key_weighted_decay;           // per-write decay g * kappa (docs/SDM.md#key-weighted-decay)
    int learned_bank;                 // backprop_on_memory: learned initial bank M0 [H*N, d]
    int normalize_readings;           // per-head LayerNorm of width d on the readings
    int output_gate;                  // sigmoid gate on the readings
    float norm_eps;                   // eps of the readings LayerNorm
    SdmSnapshot snapshot;             // backward snapshot storage
    int bank_fp32;                    // bank copy in fp32 instead of bf16
    int grad_bank_bf16;               // backward: bank gradient in bf16 between chunks (sdm.grad_bank_dtype)
} SdmDims;

#endif
