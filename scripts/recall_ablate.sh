#!/usr/bin/env bash
# scripts/recall_ablate.sh: the recall ablations of QUALITY.md, side by side on one GPU.
#
#   scripts/recall_ablate.sh VARIANTS [OUT] [key=value ...]
#
# VARIANTS: one run per line, `NAME CONFIG [key=value ...]` (# starts a comment); trailing key=value arguments of
# this script go to every run. Generates the MQAR data of configs/recall_*.cfg (MQAR_ARGS, as scripts/recall_demo.sh),
# trains every variant at once (each under `timeout ${LIMIT:-540}`: what evaluated before the limit still counts),
# then prints one table: the last evaluation's MQAR exact accuracy by gap bucket, val loss, speed.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,10p' "$0"; exit 2; }
variants=$1; shift
out=runs/ablate
if [ $# -gt 0 ] && [[ $1 != *=* ]]; then out=$1; shift; fi
data=${DATA:-data/generated/mqar}
mkdir -p "$out"
make --no-print-directory prepare_data train_sdm >/dev/null || exit 1
seq_len=$(sed -n 's/^data.seq_len *= *\([0-9]*\).*/\1/p' configs/recall_sdm.cfg)
# shellcheck disable=SC2086  # MQAR_ARGS is a list of options
./prepare_data --task mqar --seq-len "$seq_len" ${MQAR_ARGS:---pairs 16 --min-gap 16} -o "$data" --quiet || exit 1

names=()
while read -r name config rest; do
    [[ -z $name || $name == \#* ]] && continue
    rm -rf "${out:?}/$name"
    # shellcheck disable=SC2086  # rest is a list of key=value words
    timeout "${LIMIT:-540}" ./train_sdm -c "$config" "run_dir=$out/$name" "data.train=$data/mqar_train_*.bin" \
        "data.val=$data/mqar_val_*.bin" $rest "$@" > "$out/$name.log" 2>&1 &
    names+=("$name")
done < "$variants"
wait

printf '%-14s %6s %8s %8s  %s\n' variant step "val" "tok/s" "MQAR exact accuracy by gap bucket (last eval)"
for n in "${names[@]}"; do
    tsv=$out/$n/eval_recall.tsv
    acc=$( [ -s "$tsv" ] && awk -F'\t' '$2 == "mqar" { if ($1 + 0 > last) { last = $1 + 0; row = "" }
        if ($1 + 0 == last && $5 > 0) row = row sprintf(" [%s,%s):%.2f", $3, $4 < 0 ? "inf" : $4, $7) }
        END { print row }' "$tsv")
    val=$(grep -o 'val loss [0-9.]*' "$out/$n.log" | tail -n 1 | awk '{print $3}')
    step=$(grep -o '^eval step [0-9]*' "$out/$n.log" | tail -n 1 | awk '{print $3}')
    tps=$(grep -o '[0-9]* tok/s' "$out/$n.log" | tail -n 1 | awk '{print $1}')
    printf '%-14s %6s %8s %8s %s\n' "$n" "${step:--}" "${val:--}" "${tps:--}" \
        "${acc:- (no evaluation; see $out/$n.log)}"
done
