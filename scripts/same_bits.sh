#!/usr/bin/env bash
# scripts/same_bits.sh OLD_TREE: does this tree train bit for bit as OLD_TREE does? (a refactor's check, on a GPU)
#
# Builds train_sdm and infer_sdm in OLD_TREE (another checkout, e.g. `git archive REV | tar -x -C DIR`) and here,
# runs the same short fixed-seed trainings in both (bf16 debug_hybrid with the learned bank, readings norm and
# evaluation; fp32 debug_sdm with a tied head and gated attention), then compares the printed losses, the greedy
# generation and the checkpoints byte for byte: state.bin whole (AdamW moments, loader state), model.bin's fp32
# parameters (its tail: the config text before them may hold keys that one tree lacks). Prints SAME or DIFFERENT.
set -uo pipefail
old=$(cd "${1:?usage: scripts/same_bits.sh OLD_TREE}" && pwd)
new=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc 2>/dev/null || echo 4)
run() {  # run TREE LOG: the trainings and the generation in TREE, their output without timings in LOG
    (cd "$1" && rm -rf runs/same_bits runs/same_bits_fp32 && mkdir -p runs # (older trees do not make parents)
     ./train_sdm -c configs/debug_hybrid.cfg steps=20 optim.warmup=5 logging.freq=1 probe_freq=0 \
         checkpoint.eval_every=10 eval.steps=2 checkpoint.dump_every=20 sdm.backprop_on_memory=true \
         sdm.normalize_readings=true run_dir=runs/same_bits
     ./train_sdm -c configs/debug_sdm.cfg steps=20 optim.warmup=5 logging.freq=1 probe_freq=0 \
         checkpoint.eval_every=10 eval.steps=2 checkpoint.dump_every=20 distributed.model_dtype=fp32 \
         model.weight_tying=true model.attn_gate=true data.batch_size=2 run_dir=runs/same_bits_fp32
     ./infer_sdm runs/same_bits/step_00000020/model.bin --prompt "The key" --max-new 64 --temperature 0) 2>&1 |
        awk '/^----- generated/ { g = 1 } g { print } /^-----$/ { g = 0 }
             /^(step |eval step|val loss|[a-z]+ gap |[a-z]+( \(rank 0\))?: [0-9]+ queries)/ { print }' |
        sed -E 's/ \(rank 0\)//; s/ \| [0-9.]+ ms\/step.*//' > "$2"
}
for t in "$old" "$new"; do
    make -C "$t" -j"$jobs" --no-print-directory train_sdm infer_sdm >/dev/null 2>&1 ||
        { echo "DIFFERENT: $t does not build"; exit 1; }
done
run "$old" /tmp/same_bits_old.log
run "$new" /tmp/same_bits_new.log
same=1
diff /tmp/same_bits_old.log /tmp/same_bits_new.log > /tmp/same_bits.diff || { same=0; head -n 20 /tmp/same_bits.diff; }
for r in same_bits same_bits_fp32; do
    a=$old/runs/$r/step_00000020 b=$new/runs/$r/step_00000020
    cmp "$a/state.bin" "$b/state.bin" || same=0
    sa=$(stat -c %s "$a/model.bin") sb=$(stat -c %s "$b/model.bin")
    n=$(( sa < sb ? sa : sb ))
    cmp <(tail -c $((n - 65536)) "$a/model.bin") <(tail -c $((n - 65536)) "$b/model.bin") || same=0
done
grep -E '^step +(1|20)/' /tmp/same_bits_new.log
[ $same = 1 ] && echo SAME || echo DIFFERENT
[ $same = 1 ]
