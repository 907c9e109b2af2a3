#!/usr/bin/env bash
# scripts/recall_demo.sh: the recall demo of issue 15. Generates MQAR (data/README.md), trains
# configs/recall_{sdm,swa,full}.cfg side by side on one GPU, and draws what they remember:
#   OUT/accuracy_by_gap.svg     MQAR exact accuracy by gap bucket at the last evaluation, one line per model
#   OUT/loss_by_position.svg    validation loss by position in the row at the last evaluation, one line per model
#   OUT/{accuracy_by_gap,loss_by_position}.tsv   the plotted points (series, x, y); OUT/ARCH.log, OUT/ARCH/ the runs
#
#   scripts/recall_demo.sh [OUT] [key=value ...]       OUT defaults to runs/recall_demo; key=value overrides go to
#                                                      all three runs (e.g. steps=500 sdm.num_writes=64)
# Environment:
#   ARCHS="sdm swa full"   which configs/recall_ARCH.cfg to run
#   MQAR_ARGS="..."        extra prepare_data options (default --pairs 16 --min-gap 16); --seq-len is data.seq_len
#   DATA=DIR               where the MQAR shards go (default data/generated/mqar)
#   PLOT_ONLY=1            no data, no training: collect and plot the run folders already in OUT
#   TRAIN_SDM=PROGRAM      the trainer (default ./train_sdm; the CPU test substitutes a fake one)
# A run folder that exists is refused (train_sdm would resume from it): remove it or choose another OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

out=runs/recall_demo
if [ $# -gt 0 ] && [[ $1 != *=* ]]; then out=$1; shift; fi
archs=${ARCHS:-sdm swa full}
data=${DATA:-data/generated/mqar}
train_sdm=${TRAIN_SDM:-./train_sdm}

# the value of key in configs/recall_sdm.cfg, or its last override among the arguments
setting() {
    local v
    v=$(sed -n "s/^[[:space:]]*$1[[:space:]]*=[[:space:]]*\([^#[:space:]]*\).*/\1/p" configs/recall_sdm.cfg | tail -n 1)
    for a in ${overrides[@]+"${overrides[@]}"}; do [[ $a == "$1="* ]] && v=${a#*=}; done
    echo "$v"
}
overrides=("$@")
seq_len=$(setting data.seq_len)
window=$(setting model.swa_window)

mkdir -p "$out"
if [ "${PLOT_ONLY:-0}" != 1 ]; then
    make --no-print-directory prepare_data svgplot
    [ "$train_sdm" = ./train_sdm ] && make --no-print-directory train_sdm
    for a in $archs; do
        [ -e "$out/$a" ] && {
            echo "recall_demo: $out/$a exists (train_sdm would resume it): remove it or choose another OUT" >&2
            exit 1
        }
    done
    # shellcheck disable=SC2086  # MQAR_ARGS is a list of options
    ./prepare_data --task mqar --seq-len "$seq_len" ${MQAR_ARGS:---pairs 16 --min-gap 16} -o "$data"
    declare -A pids
    t0=$(date +%s)
    for a in $archs; do
        "$train_sdm" -c "configs/recall_$a.cfg" "run_dir=$out/$a" "data.train=$data/mqar_train_*.bin" \
            "data.val=$data/mqar_val_*.bin" "$@" > "$out/$a.log" 2>&1 &
        pids[$a]=$!
        echo "recall_demo: training $a (pid ${pids[$a]}, log $out/$a.log)"
    done
    failed=0
    for a in $archs; do
        if ! wait "${pids[$a]}"; then
            echo "recall_demo: $a failed; the end of $out/$a.log:" >&2; tail -n 5 "$out/$a.log" >&2; failed=1
        fi
    done
    echo "recall_demo: trained in $(( $(date +%s) - t0 )) s"
    [ $failed = 0 ] || exit 1
else
    make --no-print-directory svgplot
fi

# Points of the last evaluation of every run: x is the bucket's geometric middle (gap buckets [lo,hi), the last
# open-ended one drawn at 1.5 lo; position buckets [lo,hi]).
: > "$out/accuracy_by_gap.tsv"
: > "$out/loss_by_position.tsv"
for a in $archs; do
    for f in eval_recall.tsv eval_positions.tsv; do
        [ -s "$out/$a/$f" ] || { echo "recall_demo: $out/$a/$f is missing or empty (no evaluation ran?)" >&2; exit 1; }
    done
    awk -F'\t' -v s="$a" '$2 == "mqar" { rows[$1] = rows[$1] sprintf("%s\t%.3f\t%s\n", s,
            $4 < 0 ? 1.5 * $3 : sqrt(($3 > 1 ? $3 : 1) * $4), $6); if ($1 + 0 >= last) last = $1 + 0 }
        END { printf "%s", rows[last] }' "$out/$a/eval_recall.tsv" >> "$out/accuracy_by_gap.tsv"
    awk -F'\t' -v s="$a" '{ rows[$1] = rows[$1] sprintf("%s\t%.3f\t%s\n", s, sqrt($2 * $3), $4);
            if ($1 + 0 >= last) last = $1 + 0 }
        END { printf "%s", rows[last] }' "$out/$a/eval_positions.tsv" >> "$out/loss_by_position.tsv"
done
[ -s "$out/accuracy_by_gap.tsv" ] || { echo "recall_demo: no MQAR scores in the runs' eval_recall.tsv" >&2; exit 1; }
# chance: one value in 10 digits, over the plotted gaps
awk -F'\t' 'NR == 1 || $2 < lo { lo = $2 } NR == 1 || $2 > hi { hi = $2 }
    END { printf "chance\t%s\t0.1\nchance\t%s\t0.1\n", lo, hi }' \
    "$out/accuracy_by_gap.tsv" >> "$out/accuracy_by_gap.tsv"

./svgplot --logx --ymin 0 --ymax 1 --title "MQAR recall by gap (SWA window $window, rows of $seq_len tokens)" \
    --xlabel "gap: tokens from fact to query" --ylabel "exact accuracy" \
    -o "$out/accuracy_by_gap.svg" "$out/accuracy_by_gap.tsv"
./svgplot --logx --title "Validation loss by position in the row (SWA window $window)" \
    --xlabel "position in the row (tokens)" --ylabel "mean loss (nats)" \
    -o "$out/loss_by_position.svg" "$out/loss_by_position.tsv"
echo "recall_demo: accuracy by gap (series, gap, exact):"
column -t -s $'\t' "$out/accuracy_by_gap.tsv" 2>/dev/null || cat "$out/accuracy_by_gap.tsv"
echo "recall_demo: wrote $out/accuracy_by_gap.svg and $out/loss_by_position.svg"
