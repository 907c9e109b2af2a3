#!/usr/bin/env bash
# scripts/recall_demo.sh end to end with a fake trainer (no GPU): MQAR generation at the configs' seq_len, three
# runs launched in the background with their own run_dir and the overrides, the last evaluation of each collected,
# the two SVGs drawn; a second run refuses the existing run folders; PLOT_ONLY=1 redraws. Needs ./prepare_data and
# ./svgplot (`make test` builds them).
pass=0; fail=0
cd "$(dirname "$0")/.."
check() { if eval "$1"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $2"; fi; }
tmp=$(mktemp -d)
# The fake trainer writes two evaluations (steps 250 and 500) into its run_dir; the last one depends on the config.
cat > "$tmp/fake_train" <<'FAKE'
#!/usr/bin/env bash
cfg=$2; run=; for a in "$@"; do case $a in run_dir=*) run=${a#run_dir=};; esac; done
[ -f "$cfg" ] && [ -n "$run" ] || { echo "fake_train: bad arguments $*" >&2; exit 1; }
echo "$*" > "$run.args"; mkdir -p "$run"
case $cfg in *sdm*) acc=0.95;; *swa*) acc=0.11;; *) acc=1.0;; esac
for step in 250 500; do
    a=$([ $step = 500 ] && echo $acc || echo 0.2)
    printf '%s\tmqar\t0\t32\t100\t%s\t%s\n%s\tmqar\t32\t64\t100\t%s\t%s\n%s\tmqar\t512\t1024\t90\t%s\t%s\n' \
        $step $a $a $step $a $a $step $a $a >> "$run/eval_recall.tsv"
    printf '%s\t1\t1\t5.5\t32\n%s\t2\t3\t3.1\t64\n%s\t512\t1024\t2.0\t16384\n' $step $step $step \
        >> "$run/eval_positions.tsv"
done
FAKE
chmod +x "$tmp/fake_train"
export TRAIN_SDM=$tmp/fake_train DATA=$tmp/data MQAR_ARGS="--pairs 8 --train-tokens 100000 --val-tokens 40000"
out=$tmp/out
scripts/recall_demo.sh "$out" steps=500 > "$tmp/log" 2>&1; rc=$?
check "[ $rc -eq 0 ]" "recall_demo exited $rc: $(tail -n 5 "$tmp/log")"
seq_len=$(sed -n 's/^data.seq_len = //p' configs/recall_sdm.cfg)
size=$(stat -c %s "$tmp/data/mqar_val_000000.bin" 2>/dev/null || echo 0)
check "[ $(( (size - 1024) / 2 % seq_len )) -eq 0 ] && [ $size -gt 1024 ]" \
    "validation shard of $size bytes is not whole documents of $seq_len tokens"
for a in sdm swa full; do
    check "grep -q -- '-c configs/recall_$a.cfg run_dir=$out/$a data.train=$tmp/data/mqar_train_\*.bin \
data.val=$tmp/data/mqar_val_\*.bin steps=500' '$out/$a.args'" \
        "$a: trainer arguments: $(cat "$out/$a.args" 2>/dev/null)"
    check "grep -q '>$a</text>' '$out/accuracy_by_gap.svg' && grep -q '>$a</text>' '$out/loss_by_position.svg'" \
        "$a missing from a picture"
done
check "grep -q '>chance</text>' '$out/accuracy_by_gap.svg'" "no chance line"
check "[ \"\$(tail -n 1 '$out/accuracy_by_gap.svg')\" = '</svg>' ] && \
[ \"\$(tail -n 1 '$out/loss_by_position.svg')\" = '</svg>' ]" "an SVG is not complete"
check "[ \$(grep -c '^sdm' '$out/accuracy_by_gap.tsv') -eq 3 ] && \
grep -q \$'^sdm\t5.657\t0.95\$' '$out/accuracy_by_gap.tsv' && ! grep -q '0\.2\$' '$out/accuracy_by_gap.tsv'" \
    "accuracy points are not the last evaluation's: $(head -n 4 "$out/accuracy_by_gap.tsv")"
check "grep -q \$'^full\t724.077\t2.0\$' '$out/loss_by_position.tsv'" \
    "loss points: $(head -n 3 "$out/loss_by_position.tsv")"
scripts/recall_demo.sh "$out" > "$tmp/log2" 2>&1; rc=$?
check "[ $rc -ne 0 ] && grep -q 'exists' '$tmp/log2'" "a second run did not refuse the existing run folders"
rm "$out"/*.svg
PLOT_ONLY=1 scripts/recall_demo.sh "$out" > "$tmp/log3" 2>&1; rc=$?
check "[ $rc -eq 0 ] && [ -s '$out/accuracy_by_gap.svg' ] && [ -s '$out/loss_by_position.svg' ]" \
    "PLOT_ONLY=1 did not redraw: $(tail -n 3 "$tmp/log3")"
rm -rf "$tmp"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
