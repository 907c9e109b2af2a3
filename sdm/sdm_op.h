// sdm/sdm_op.h: the C API of the GPU SDM memory op (docs/SDM.md): shapes, the supported-shape check and the
// memory sizing. The kernels and the entry points below live in sdm/sdm_op.cuh (include that from a .cu file); this
// header is plain C11 / C++17 so host code can size buffers without CUDA.
//
// Data layout (token-major, shared with the CPU oracle sdm/sdm_ref.h and the layer):
//   wslot [B,T,H,W] int32   write slots within the head (0..N-1), ascending and distinct per (b,t,h)
//   kappa [B,T,H,W] fp32    write weights
//   gamma [B,T,H,W] fp32    per-entry log-decay (<= 0)
//   beta  [B,T,H]   fp32    write strength
//   v     [B,T,H,d] fp32    values (= [B,T,D])
//   rslot [B,T,H,R] int32   read slots, ascending and distinct per (b,t,h)
//   rho   [B,T,H,R] fp32    read weights
//   out   [B,T,H,d] fp32    readings
//   bank  [B,H,N,d] bf16 (default) or fp32; stream (b,h) owns rows [(b*H+h)*N, (b*H+h+1)*N)
// Gradients have the shapes of their inputs (fp32); dbank_init is [B,H,N,d] fp32, or bf16 with grad_bank_bf16.
//
// Entry points (sdm/sdm_op.cuh), all asynchronous on `stream`, no allocation, no host synchronisation, CUDA-graph
// capturable; every one first calls sdm_op_check and dies with its message on an unsupported shape:
//
//   void sdm_op_forward(const SdmOpShape *s, const SdmOpInputs *in, void *bank, float *out,
//                       void *saved, cudaStream_t stream);
//       bank: in = initial bank, out = final bank. s->training = 1: saves into `saved` (sdm_op_saved_bytes) what
//       sdm_op_backward needs (per-chunk WY quantities, Delta, V - R0, snapshots of the touched rows).
//       s->training = 0 (prefill): `saved` is plain scratch of sdm_op_saved_bytes (smaller: no snapshots, no saves).
//       s->fwd_path: the chunk loop as three launches per chunk (the gather's rows in registers or by bulk copies)
//       or as one persistent cooperative launch (by default for a prefill of few streams); the same bits every way.
//   void sdm_op_backward(const SdmOpShape *s, const SdmOpInputs *in, const void *bank, const float *dout,
//                        const float *dbank_final, const SdmOpGrads *g, void *saved, void *scratch,
//                        cudaStream_t stream);
//       after sdm_op_forward with s->training = 1 on the same inputs and `saved`. bank: the final bank left by the
//       forward, read and left as it is (a chunk's start rows come from the snapshots: docs/SDM.md#bank-restoration).
//       dout [B,T,H,d]; dbank_final [B,H,N,d] fp32 or
//       NULL (zero). Writes every gradient of SdmOpGrads (each fully overwritten); g->dbank_init doubles as the dense
//       bank-gradient accumulator G: fp32 with s->grad_bank_bf16 = 0, bf16 with 1 (fp32 sums inside a chunk, each
//       touched row rounded to bf16 once per chunk; dbank_final is then rounded in and may not share its buffer).
//       scratch: sdm_op_scratch_bytes, may be shared by all layers.
//   void sdm_op_decode(const SdmOpShape *s, const SdmOpInputs *in, void *bank, float *out, cudaStream_t stream);
//       one token for each of the B*H streams (s->T must be 1; inputs in the same layout with T = 1): the
//       recurrence (docs/SDM.md#the-recurrence) applied to the bank in place, readings written to out [B,1,H,d]. Needs
//       no workspace.
//
// Precision: every decay, Gram matrix, solve, GEMM and accumulation is IEEE fp32 (no TF32 anywhere); a bank row is
// rounded to the bank dtype once per chunk (with grad_bank_bf16, a touched row of the bank gradient to bf16 once per
// chunk). bank_fp32 = 1 with snapshot none and grad_bank_bf16 = 0 is the all-fp32 mode. The op is
// bitwise deterministic (no floating-point atomics; duplicates of a slot are combined by one thread in time order).
#ifndef SDM_SDM_OP_H
#define SDM_SDM_OP_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "sdm/sdm_dims.h"

#define SDM_OP_MAX_CHUNK 256
#define SDM_OP_CHUNK_ENTRIES 49152 // C * (W + R): phase 1 numbers the entries of a chunk in 16 bits

// Functions both the host (sizing) and phase 1's kernel use.
#ifdef __CUDACC__
#define SDM_HOST_DEVICE __host__ __device__
#else
#define SDM_HOST_DEVICE
#endif

// How sdm_op_forward runs its chunk loop (docs/SDM.md#phases-on-the-gpu); every path gives the same bits.
typedef enum {
    SDM_FWD_AUTO,       // the op chooses (sdm_fwd_persistent_blocks in sdm/sdm_op_fwd.cuh)
    SDM_FWD_LAUNCHES,   // three launches per chunk
    SDM_FWD_PERSISTENT, // one cooperative launch for every chunk (dies where the GPU cannot run it)
    SDM_FWD_LAUNCHES_BULK, // three launches per chunk, the gather's rows by bulk copies (sm_90 and rows of at most
                           // 2 KB; elsewhere as SDM_FWD_LAUNCHES)
} SdmFwdPath;

typedef struct {
    int B, T, H;          // sequences, tokens per sequence, heads
    int N, d;             // slots per head, row width (head dim)
    int W, R;             // writes / reads per token and head
    int C;                // chunk length 1..256 (the op uses min(C, T))
    int bank_fp32;        // 0: bf16 bank, 1: fp32 bank
    SdmSnapshot snapshot; // storage of the backward snapshots (training only)
    int grad_bank_bf16;   // backward: the bank gradient G (dbank_init) in bf16 (1) or fp32 (0) between chunks
    int training;         // 1: forward saves for the backward; 0: prefill
    SdmFwdPath fwd_path;  // 0 (auto) unless a test or benchmark forces a path
    int fwd_max_blocks;   // > 0: at most this many blocks in the persistent forward (tests); 0: all that fit
} SdmOpShape;

typedef struct {
    const int *wslot;
    const float *kappa, *gamma, *beta, *v;
    const int *rslot;
    const float *rho;
} SdmOpInputs;

typedef struct {
    float *dkappa, *dgamma, *dbeta, *dv, *drho; // shapes of kappa, gamma, beta, v, rho
    void *dbank_init;                           // [B,H,N,d] fp32, or bf16 with grad_bank_bf16
} SdmOpGrads;

static inline int sdm_op_chunk(const SdmOpShape *s) { return s->C < s->T ? s->C : s->T; }
static inline int sdm_op_chunks(const SdmOpShape *s) { int C = sdm_op_chunk(s); return (s->T + C - 1) / C; }

// Width of the column tile one CTA owns in the per-chunk solve kernels: the widest of 64/32/16/8 that divides d and
// still gives >= 256 (stream, block) CTAs.
static inline int sdm_op_col_block(const SdmOpShape *s) {
    int db = 64;
    while (db > 8 && (s->d % db != 0 || (long long)s->B * s->H * (s->d / db) < 256)) db /= 2;
    return db;
}

// NULL when the op supports the shape, else a message saying what is not supported.
static inline const char *sdm_op_check(const SdmOpShape *s) {
    if (s->B < 1 || s->T < 1 || s->H < 1 || s->N < 1 || s->d < 1) return "B, T, H, N, d must be >= 1";
    if (s->W < 1 || s->R < 1 || s->W > s->N || s->R > s->N) return "W and R must be in 1..N";
    if (s->C < 1 || s->C > SDM_OP_MAX_CHUNK) return "chunk size C must be in 1..256";
    if (s->d % 8 != 0 || s->d > 4096) return "row width d must be a multiple of 8 and <= 4096";
    if (s->W > 1024 || s->R > 1024) return "W and R must be <= 1024";
    if ((long long)sdm_op_chunk(s) * (s->W + s->R) > SDM_OP_CHUNK_ENTRIES)
        return "C * (W + R) must be <= 49152 (phase 1 numbers a chunk's entries in 16 bits)";
    if ((long long)s->B * s->H * s->N * s->d >= (1ll << 40)) return "bank larger than 2^40 elements";
    if (s->snapshot == SDM_SNAP_BF16 && !s->bank_fp32) return "bf16 snapshots need an fp32 bank (use none)";
    if (s->snapshot < SDM_SNAP_NONE || s->snapshot > SDM_SNAP_INT4) return "unknown snapshot mode";
    if (s->fwd_path < SDM_FWD_AUTO || s->fwd_path > SDM_FWD_LAUNCHES_BULK) return "unknown forward path";
    if (s->fwd_max_blocks < 0) return "fwd_max_blocks must be >= 0";
    return NULL;
}

static inline size_t sdm_op_align(size_t x) { return (x + 255) & ~(size_t)255; }

// Columns that share one fp8/int4 snapshot scale: a fixed number, so how a row is rounded depends neither on the
// batch nor on the kernels' column tiles (a d that is not a multiple of it ends in a partial block).
#define SDM_SNAP_SCALE_COLS 32

// Bytes of one snapshot row payload (d values) and its number of scales (fp8/int4: one fp32 per scale block).
static inline size_t sdm_op_snap_row_bytes(const SdmOpShape *s) {
    switch (s->snapshot) {
    case SDM_SNAP_NONE: return (size_t)s->d * (s->bank_fp32 ? 4 : 2);
    case SDM_SNAP_BF16: return (size_t)s->d * 2;
    case SDM_SNAP_FP8: return (size_t)s->d;
    default: return (size_t)s->d / 2;
    }
}
static inline size_t sdm_op_snap_scales(const SdmOpShape *s) {
    int quantised = s->snapshot == SDM_SNAP_FP8 || s->snapshot == SDM_SNAP_INT4;
    return quantised ? (size_t)(s->d + SDM_SNAP_SCALE_COLS - 1) / SDM_SNAP_SCALE_COLS : 0;
}

// Bytes a training forward or backward must move at least (its byte floor, as BENCHMARKS.md counts it),
// per token and head: forward, read the W written and R read rows, write the W rows and W snapshot rows; backward,
// read and write the bank gradient (fp32, or bf16 with grad_bank_bf16) at the W + R rows, read the W snapshots and
// the R rows read.
static inline double sdm_op_floor_bytes(const SdmOpShape *s, int backward) {
    double th = (double)s->B * s->T * s->H, row = (double)s->d * (s->bank_fp32 ? 4 : 2);
    double snap = (double)sdm_op_snap_row_bytes(s) + 4.0 * sdm_op_snap_scales(s), W = s->W, R = s->R;
    if (!backward) return th * ((2 * W + R) * row + W * snap);
    return th * ((2 * W + 2 * R) * s->d * (s->grad_bank_bf16 ? 2 : 4) + W * snap + R * row);
}

// Phase 1 (sdm/sdm_op_wy.cuh, docs/SDM.md#phases-on-the-gpu): the threads of its block, and its working set for one
// chunk, kept in shared memory when it fits in SDM_WY_SMEM_MAX bytes (an H100 or H200 allows 227 KB a block, an A100
// 163 KB; the flagship's chunk, C = 64 and W = R = 64, takes 152 KB), else in `saved` (wy_work, one per stream and
// chunk). Byte offsets of its regions (16-byte aligned) for n = C (W + R) entries:
#define SDM_WY_THREADS 512
#define SDM_WY_SMEM_MAX (160 << 10)
typedef struct {
    size_t keys;   // [n] uint64 sort keys of the entries; then each slot's writes; then Linv packed, C (C + 1) / 2 fp32
    size_t span;   // [C W + C R] uint32 where the writes of an entry's slot before it are, for each write then read
    size_t groups; // [n] uint16 start positions of the slot groups; later A [C][C] fp32
    size_t lam;    // [C W] fp32 gamma, then lambda
    size_t kap;    // [C W] fp32 kappa
    size_t rows;   // [warps][2][C] fp32 the row of A and the row of S each warp is summing
    size_t count;  // int: the number of slot groups
    size_t bytes;
} SdmWyLayout;

SDM_HOST_DEVICE static inline SdmWyLayout sdm_wy_layout(int C, int W, int R) {
    const size_t n = (size_t)C * (W + R), tri = (size_t)C * (C + 1) / 2 * 4, cc = (size_t)C * C * 4;
    SdmWyLayout L;
    size_t off = 0;
#define SDM_WY_TAKE(field, b) do { L.field = off; off += ((b) + 15) & ~(size_t)15; } while (0)
    SDM_WY_TAKE(keys, 8 * n > tri ? 8 * n : tri);
    SDM_WY_TAKE(span, 4 * n);
    SDM_WY_TAKE(groups, 2 * n > cc ? 2 * n : cc);
    SDM_WY_TAKE(lam, (size_t)C * W * 4);
    SDM_WY_TAKE(kap, (size_t)C * W * 4);
    SDM_WY_TAKE(rows, (size_t)SDM_WY_THREADS / 32 * 2 * C * 4);
    SDM_WY_TAKE(count, 4);
#undef SDM_WY_TAKE
    L.bytes = off;
    return L;
}

// The backward's per-chunk WY kernel (sdm_bwy_kernel in sdm/sdm_op_bwd.cuh) likewise: its working set for one chunk in
// shared memory when it fits in SDM_WY_SMEM_MAX bytes (112 KB at the flagship's chunk), else in `scratch` (bwy_work).
typedef struct {
    size_t mats;  // dS, dL [C][C] fp32, then beta [C]
    size_t links; // prev, next [C W], then prevr, prevw [C R] uint16 (0xffff: none)
    size_t vals;  // kappa, lambda [C W], rho [C R] fp32; later dlam, dmu [C W], dlam' [C R]; before them the tiles of
                  // the C x C products, [2][64][33] fp32
    size_t bytes;
} SdmBwyLayout;

SDM_HOST_DEVICE static inline SdmBwyLayout sdm_bwy_layout(int C, int W, int R) {
    const size_t vals = (size_t)C * (2 * W + R) * 4, tiles = 2 * 64 * 33 * 4;
    SdmBwyLayout L;
    L.mats = 0;
    L.links = ((size_t)(2 * C + 1) * C * 4 + 15) & ~(size_t)15;
    L.vals = L.links + (((size_t)C * (W + R) * 4 + 15) & ~(size_t)15);
    L.bytes = (L.vals + (vals > tiles ? vals : tiles) + 15) & ~(size_t)15;
    return L;
}

// Offsets of every buffer inside `saved` / `scratch` (bytes). Streams are stream-major: [S = B*H][Tp][...] with
// Tp = chunks * C (padded tokens are inert).
typedef struct {
    int S, C, nc, Tp, DB;
    // saved: per write entry [S][Tp][W]
    size_t w_slot, w_prev, w_next, w_lastread, w_kappa, w_lam, w_gath, w_scat, w_pi, w_elam_tot;
    // saved: per read entry [S][Tp][R]
    size_t r_slot, r_prevw, r_prevr, r_nextr, r_nearw, r_rho, r_lam, r_gath;
    size_t beta;                  // [S][Tp]
    size_t A, Sm, Linv;           // [S][nc][C][C]
    size_t cx, ce, cdelta;        // [S][C][d] fp32 per-chunk buffers: X (forward) / dR0 (backward), E, Delta (prefill)
    size_t delta, u;              // [S][Tp][d] fp32 (training)
    size_t snap, snap_scale;      // [S][Tp][W] rows, [S][Tp][W][sdm_op_snap_scales] fp32 (training)
    size_t wy_work;               // [S][nc] phase 1's working sets (sdm_wy_layout) when one exceeds SDM_WY_SMEM_MAX
    size_t wy_work_bytes;         // their bytes; 0: in shared memory
    size_t saved_bytes;
    // scratch (backward)
    size_t wsum;                  // [S][C][d] write-path gradient of delta for the current chunk
    size_t dx;                    // [S][Tp][d]
    size_t omega, eta, psi, dmu;  // [S][Tp][W]: per-entry dots omega, eta, psi, then gradients of lambda, mu
    size_t phi, dlamr;            // [S][Tp][R]: per-entry dot phi, gradient of lambda'
    size_t later_snap;            // [S][N] int: per slot, the entry whose snapshot is the row after the current chunk

    size_t bwy_work;              // [S][nc] the backward WY kernel's working sets (sdm_bwy_layout) when one exceeds
    size_t bwy_work_bytes;        // SDM_WY_SMEM_MAX, and their bytes; 0: in shared memory
    size_t scratch_bytes;
} SdmOpLayout;

static inline SdmOpLayout sdm_op_layout(const SdmOpShape *s) {
    SdmOpLayout L;
    memset(&L, 0, sizeof(L));
    L.S = s->B * s->H;
    L.C = sdm_op_chunk(s);
    L.nc = sdm_op_chunks(s);
    L.Tp = L.nc * L.C;
    L.DB = sdm_op_col_block(s);
    size_t ew = (size_t)L.S * L.Tp * s->W, er = (size_t)L.S * L.Tp * s->R, tok = (size_t)L.S * L.Tp;
    size_t cc = (size_t)L.S * L.nc * L.C * L.C, rows = tok * s->d;
    size_t off = 0;
#define SDM_OP_TAKE(field, bytes) do { L.field = off; off += sdm_op_align(bytes); } while (0)
    SDM_OP_TAKE(w_slot, ew * 4); SDM_OP_TAKE(w_prev, ew * 4); SDM_OP_TAKE(w_next, ew * 4);
    SDM_OP_TAKE(w_lastread, ew * 4); SDM_OP_TAKE(w_kappa, ew * 4); SDM_OP_TAKE(w_lam, ew * 4);
    SDM_OP_TAKE(w_gath, ew * 4); SDM_OP_TAKE(w_scat, ew * 4); SDM_OP_TAKE(w_pi, ew * 4);
    SDM_OP_TAKE(w_elam_tot, ew * 4);
    SDM_OP_TAKE(r_slot, er * 4); SDM_OP_TAKE(r_prevw, er * 4); SDM_OP_TAKE(r_prevr, er * 4);
    SDM_OP_TAKE(r_nextr, er * 4); SDM_OP_TAKE(r_nearw, er * 4); SDM_OP_TAKE(r_rho, er * 4); SDM_OP_TAKE(r_lam, er * 4);
    SDM_OP_TAKE(r_gath, er * 4);
    SDM_OP_TAKE(beta, tok * 4);
    SDM_OP_TAKE(A, cc * 4); SDM_OP_TAKE(Sm, cc * 4); SDM_OP_TAKE(Linv, cc * 4);
    size_t chunk_rows = (size_t)L.S * L.C * s->d;
    SDM_OP_TAKE(cx, chunk_rows * 4); SDM_OP_TAKE(ce, chunk_rows * 4); SDM_OP_TAKE(cdelta, chunk_rows * 4);
    if (s->training) {
        SDM_OP_TAKE(delta, rows * 4); SDM_OP_TAKE(u, rows * 4);
        SDM_OP_TAKE(snap, ew * sdm_op_snap_row_bytes(s));
        SDM_OP_TAKE(snap_scale, ew * sdm_op_snap_scales(s) * 4);
    }
    size_t wy = sdm_wy_layout(L.C, s->W, s->R).bytes;
    L.wy_work_bytes = wy > SDM_WY_SMEM_MAX ? (size_t)L.S * L.nc * wy : 0;
    SDM_OP_TAKE(wy_work, L.wy_work_bytes);
    L.saved_bytes = off;
    off = 0;
    SDM_OP_TAKE(wsum, (size_t)L.S * L.C * s->d * 4);
    SDM_OP_TAKE(dx, rows * 4);
    SDM_OP_TAKE(omega, ew * 4); SDM_OP_TAKE(eta, ew * 4); SDM_OP_TAKE(psi, ew * 4); SDM_OP_TAKE(dmu, ew * 4);
    SDM_OP_TAKE(phi, er * 4); SDM_OP_TAKE(dlamr, er * 4);
    SDM_OP_TAKE(later_snap, (size_t)L.S * s->N * 4);
    size_t bwy = sdm_bwy_layout(L.C, s->W, s->R).bytes;
    L.bwy_work_bytes = bwy > SDM_WY_SMEM_MAX ? (size_t)L.S * L.nc * bwy : 0;
    SDM_OP_TAKE(bwy_work, L.bwy_work_bytes);
    L.scratch_bytes = off;
#undef SDM_OP_TAKE
    return L;
}

// Device bytes the caller allocates: `saved` for sdm_op_forward / sdm_op_backward, `scratch` for sdm_op_backward.
static inline size_t sdm_op_saved_bytes(const SdmOpShape *s) { return sdm_op_layout(s).saved_bytes; }
static inline size_t sdm_op_scratch_bytes(const SdmOpShape *s) { return sdm_op_layout(s).scratch_bytes; }

#endif
