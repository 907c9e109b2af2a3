#!/usr/bin/env bash
# The memory ledger (core/memory.h): `train_sdm --memory` is a dry run of the very allocations of a training run, so
# its breakdown must equal the sizes worked out here by hand from the shapes (docs/MODEL.md#memory), to the byte.
# Runs without a GPU; `make test` builds train_sdm first.
pass=0; fail=0
cd "$(dirname "$0")/.."

# expect OUTPUT CATEGORY BYTES: the line of CATEGORY in a --memory breakdown shows BYTES
expect() {
    local got; got=$(printf '%s\n' "$1" | grep -F "  $2 " | awk '{print $(NF-1)}')
    if [ "$got" = "$3" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $4: $2 is '$got', want $3"; fi
}

# --- sdm_flagship, B=4, T=4096, bf16, recompute on (its config) --------------------------------------------------
# storage S: 2,039,699,504 parameters plus 6 SDM layers x 4 tensors of H = 2 elements (ba, bb, A_log, dt_bias)
# padded to 8: + 144. S is a multiple of the 64-element shard grid, so world 1 adds nothing.
out=$(./train_sdm -c configs/sdm_flagship.cfg --memory)
S=2039699648; L=24; D=2048; F=5632; n=$((4 * 4096)); P=$((n * 2)); es=2
expect "$out" "working weights" $((2 * S)) flagship
expect "$out" "fp32 master weights" $((4 * S)) flagship
expect "$out" "AdamW m, v" $((8 * S)) flagship
expect "$out" "gradients (fp32)" $((4 * S)) flagship
# model: h [L+1][n,D], hmid [L][n,D], xmix and xffn one layer each (recompute), rstd_mix/ffn [L][n] fp32,
# W1|W3 product [L][n,2F], SwiGLU product one layer, xfinal [n,D], rstd_final, logits [n,264], losses, loss, tokens,
# targets, predictions
model=$(( (L + 1) * n * D * es + L * n * D * es + 2 * n * D * es + 2 * L * n * 4 + L * n * 2 * F * es + n * F * es
          + n * D * es + n * 4 + n * 264 * es + n * 4 + 4 + 3 * n * 4 ))
# 18 SWA layers (16 heads = 16 kv heads x 128): q, k, v, o [n, 2048] and lse [B, 16, T] fp32
attn=$(( 18 * (4 * n * 2048 * es + 4 * 16 * 4096 * 4) ))
# 6 SDM layers: packed biases [6148], z [n, 6152], g, beta [P], slots and weights 5 x [P, 64], readings o [n, D] fp32,
# LayerNorm mean and rstd [P]
sdm=$(( 6 * (6148 * es + n * 6152 * es + 2 * P * 4 + 5 * P * 64 * 4 + n * D * 4 + 2 * P * 4) ))
expect "$out" "activations saved for backward" $((model + attn + sdm)) flagship
# per SDM layer: bank [4, 2, 65536, 1024] bf16; the op's saved state for 8 streams x 4096 tokens x 64 writes / reads:
# 10 + 8 int/fp32 per-entry arrays, beta, A, S, Linv [8, 64 chunks, 64, 64], 3 chunk buffers [8, 64, 1024], Delta and
# U [8, 4096, 1024] fp32, and the snapshot rows (snapshot none: one bf16 row of 1024 per write entry)
ew=$((8 * 4096 * 64))
saved=$(( 18 * ew * 4 + 8 * 4096 * 4 + 3 * 8 * 64 * 64 * 64 * 4 + 3 * 8 * 64 * 1024 * 4 + 2 * 8 * 4096 * 1024 * 4
          + ew * 1024 * 2 ))
expect "$out" "SDM banks + saved state" $(( 6 * (4 * 2 * 65536 * 1024 * 2 + saved) )) flagship
expect "$out" "per-sequence bank gradients" $(( 4 * 2 * 65536 * 1024 * 2 )) "flagship (once, not per layer; bf16)"
expect "$out" "cuBLAS workspace" $((32 << 20)) flagship

# sdm.grad_bank_dtype = fp32 (the config takes bf16): the per-sequence bank gradients [4, 2, 65536, 1024] in fp32,
# nothing else changes
gb=$(./train_sdm -c configs/sdm_flagship.cfg --memory sdm.grad_bank_dtype=fp32)
expect "$gb" "per-sequence bank gradients" $(( 4 * 2 * 65536 * 1024 * 4 )) "flagship, fp32 bank gradient"
total=$(printf '%s\n' "$out" | grep -F "  total " | awk '{print $(NF-1)}')
expect "$gb" "total" $((total + 4 * 2 * 65536 * 1024 * 2)) "flagship, fp32 bank gradient"

# bf16 AdamW moments (optim.moment_dtype): m and v at 2 bytes each, nothing else changes
bf=$(./train_sdm -c configs/sdm_flagship.cfg --memory optim.moment_dtype=bf16)
expect "$bf" "AdamW m, v" $((4 * S)) "flagship, bf16 moments"
expect "$bf" "fp32 master weights" $((4 * S)) "flagship, bf16 moments"
total=$(printf '%s\n' "$out" | grep -F "  total " | awk '{print $(NF-1)}')
expect "$bf" "total" $((total - 4 * S)) "flagship, bf16 moments"

# recompute off: every layer keeps its two norm outputs and its SwiGLU product, every SDM layer its readout [n, D]
off=$(./train_sdm -c configs/sdm_flagship.cfg --memory distributed.selective_act_ckpt=false)
expect "$off" "activations saved for backward" \
    $((model + attn + sdm + (L - 1) * n * (2 * D + F) * es + 6 * n * D * es)) \
    "flagship, off"

# recompute_ffn: the W1|W3 product [n, 2F] kept for one layer instead of L (the largest activation)
ffn=$(./train_sdm -c configs/sdm_flagship.cfg --memory distributed.recompute_ffn=true)
expect "$ffn" "activations saved for backward" $((model + attn + sdm - (L - 1) * n * 2 * F * es)) "flagship, recompute_ffn"

# --- debug_hybrid, B=8, T=2048, recompute off (its config) ---------------------------------------------------------
out=$(./train_sdm -c configs/debug_hybrid.cfg --memory)
L=8; D=1024; F=2816; n=$((8 * 2048)); P=$n
model=$(( (L + 1) * n * D * es + 3 * L * n * D * es + 2 * L * n * 4 + L * n * 3 * F * es + n * D * es + n * 4
          + n * 264 * es + n * 4 + 4 + 3 * n * 4 ))
# SWA 0,2: q, o [n, 4 x 64], k, v [n, 2 x 64], lse [8, 4, 2048]; full attention 4,6: q, k, v, o [n, 8 x 128]
attn=$(( 2 * (2 * n * 256 * es + 2 * n * 128 * es + 8 * 4 * 2048 * 4) + 2 * (4 * n * 1024 * es + 8 * 8 * 2048 * 4) ))
# 4 SDM layers (H = 1, K = 128, W = R = 32, output gate, no readings norm): n_in = 2306, z row 2312, and r [n, D]
sdm=$(( 4 * (2306 * es + n * 2312 * es + 2 * P * 4 + 5 * P * 32 * 4 + n * D * 4 + n * D * es) ))
expect "$out" "activations saved for backward" $((model + attn + sdm)) debug_hybrid
ew=$((8 * 2048 * 32))
saved=$(( 18 * ew * 4 + 8 * 2048 * 4 + 3 * 8 * 32 * 64 * 64 * 4 + 3 * 8 * 64 * 1024 * 4 + 2 * 8 * 2048 * 1024 * 4
          + ew * 1024 * 2 ))
expect "$out" "SDM banks + saved state" $(( 4 * (8 * 4096 * 1024 * 2 + saved) )) debug_hybrid
expect "$out" "per-sequence bank gradients" $(( 8 * 4096 * 1024 * 4 )) debug_hybrid

# --- one place: no program or module source allocates device memory except through device_alloc ------------------
direct=$(grep -n 'cudaMalloc(\|cudaFree(' core/*.* sdm/*.* attention/*.* model/*.* data/*.* ./*.cu |
    grep -v '^core/cuda_common.cuh:')
if [ -z "$direct" ]; then pass=$((pass + 1))
else fail=$((fail + 1)); echo "FAIL: allocations outside the ledger:"; echo "$direct"; fi

# --- world size: the breakdown is per GPU and names the ranks --------------------------------------------------------
out=$(./train_sdm -c configs/debug_hybrid.cfg --memory=8)
if [[ "$out" == *"8 ranks"* ]]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: --memory=8: $out"; fi
# ZeRO-1 at 8 ranks (distributed.fsdp_type = no_shard): the fp32 master weights and AdamW m, v of one shard
# (core/shard.h: S / 8 rounded up to 64 elements), the working weights and gradients whole (padded to 8 shards)
out=$(./train_sdm -c configs/sdm_flagship.cfg --memory=8 distributed.fsdp_type=no_shard)
S=2039699648; shard=$(( (S + 8 * 64 - 1) / (8 * 64) * 64 ))
expect "$out" "fp32 master weights" $((4 * shard)) "flagship, 8 ranks, ZeRO-1"
expect "$out" "AdamW m, v" $((8 * shard)) "flagship, 8 ranks, ZeRO-1"
expect "$out" "working weights" $((2 * 8 * shard)) "flagship, 8 ranks, ZeRO-1"
expect "$out" "gradients (fp32)" $((4 * 8 * shard)) "flagship, 8 ranks, ZeRO-1"
# ZeRO-2 at 8 ranks (full_shard, the default): the gradients are one shard plus the buckets of model/grad_buckets.h,
# each as large as its largest segment. Blocks of even index are all SWA: mixer and FFN norms [D], wq, wk, wv, wo
# [D, D], W1, W3 [F, D], W2 [D, F]. Those of odd index include the SDM blocks, the largest: the rest of S after the
# 18 SWA blocks, the embedding [V, D], the final norm and the LM head. Embedding bucket [V, D]; head bucket [D] +
# [V, D] (the blocks end on a multiple of 8).
out=$(./train_sdm -c configs/sdm_flagship.cfg --memory=8)
D=2048; F=5632; V=258
swa=$(( 2 * D + 4 * D * D + 3 * F * D )); sdm=$(( (S - 18 * swa - 2 * V * D - D) / 6 ))
expect "$out" "gradients (fp32)" $(( 4 * (shard + swa + sdm + V * D + D + V * D) )) "flagship, 8 ranks, ZeRO-2"
expect "$out" "fp32 master weights" $((4 * shard)) "flagship, 8 ranks, ZeRO-2"
# sdm_7B at 8 ranks: within the 75 GiB per GPU of issue 10 (the ledger: 72.7 GiB)
total=$(./train_sdm -c configs/sdm_7B.cfg --memory=8 | grep -F "  total " | awk '{print $(NF-1)}')
if [ "$total" -le $((75 << 30)) ]; then pass=$((pass + 1))
else fail=$((fail + 1)); echo "FAIL: sdm_7B at 8 ranks needs $total bytes per GPU, more than 75 GiB"; fi
out=$(./train_sdm -c configs/sdm_flagship.cfg --memory=8 optim.moment_dtype=bf16 distributed.fsdp_type=no_shard)
expect "$out" "AdamW m, v" $((4 * shard)) "flagship, 8 ranks, ZeRO-1, bf16 moments"
err=$(./train_sdm -c configs/debug_hybrid.cfg --memory=0 2>&1 >/dev/null)
if [[ "$err" == *"world size must be a positive integer"* ]]; then pass=$((pass + 1))
else fail=$((fail + 1)); echo "FAIL: --memory=0 accepted: $err"; fi

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
