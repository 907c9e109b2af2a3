#!/usr/bin/env bash
# infer_sdm refuses bad arguments and unreadable checkpoints before touching the GPU: a non-zero exit and a message
# naming the argument or file. It reads the newest of many checkpoints of a run folder, refuses a FIFO at once, and
# with a valid checkpoint but no usable GPU says so plainly. Needs ./infer_sdm and build/test_checkpoint (`make test`
# builds both).
pass=0; fail=0
cd "$(dirname "$0")/.."
# refused "what" ARGS... : exit status non-zero and the message contains "what"
# (VMEM_KB: an address-space limit for this run)
refused() {
    local want=$1; shift
    out=$(ulimit -v "${VMEM_KB:-unlimited}"; timeout 60 ./infer_sdm "$@" 2>&1); rc=$?
    if [ $rc -ne 0 ] && [[ "$out" == *"$want"* ]]; then pass=$((pass + 1));
    else fail=$((fail + 1)); echo "FAIL infer_sdm $*: exit $rc, output '$out' (want non-zero and '$want')"; fi
}
if [ ! -x ./infer_sdm ]; then
    echo "FAIL ./infer_sdm is not built (make infer_sdm)"; echo "0 passed, 1 failed"; exit 1
fi
tmp=$(mktemp -d)
head -c 300 /dev/zero > "$tmp/garbage.bin"
refused "no CHECKPOINT"
refused "$tmp/missing" "$tmp/missing"
refused "garbage.bin: wrong magic" "$tmp/garbage.bin"
refused "no complete checkpoint" "$tmp"
refused "--top-p" "$tmp/garbage.bin" --top-p 2
refused "--top-p" "$tmp/garbage.bin" --top-p 0
refused "--top-k" "$tmp/garbage.bin" --top-k 0
refused "--max-new" "$tmp/garbage.bin" --max-new 12x
refused "--temperature" "$tmp/garbage.bin" --temperature -1
refused "--seed needs a value" "$tmp/garbage.bin" --seed
refused "unknown option '--bogus'" "$tmp/garbage.bin" --bogus 1
refused "not several" "$tmp/garbage.bin" --prompt a --prompt-file b
refused "not several" "$tmp/garbage.bin" --prompts a --prompt b
refused "--batch" "$tmp/garbage.bin" --batch 0
refused "--prompt-file $tmp/nope" "$tmp/garbage.bin" --prompt-file "$tmp/nope"
refused "need --eval" "$tmp/garbage.bin" --out "$tmp"
refused "takes no prompt" "$tmp/garbage.bin" --eval "$tmp/x.bin" --prompt a
refused "--eval-batches" "$tmp/garbage.bin" --eval "$tmp/x.bin" --eval-batches 0
# --prompts files are read before the checkpoint: a bad JSONL line is named (file, line), an empty file refused
printf '{"prompt": "a"}\n{"prompt": 3}\n' > "$tmp/bad.jsonl"
refused "bad.jsonl: line 2: column 12: the document field is not a string" "$tmp/garbage.bin" --prompts "$tmp/bad.jsonl"
refused "bad.jsonl: line 1: no \"q\" string field" "$tmp/garbage.bin" --prompts "$tmp/bad.jsonl" --prompt-field q
printf '\n\n' > "$tmp/empty.txt"
refused "empty.txt: no prompt" "$tmp/garbage.bin" --prompts "$tmp/empty.txt"
refused "--prompt-field names" "$tmp/garbage.bin" --prompts "$tmp/empty.txt" --prompt-field q
# a run folder of 30 checkpoints made in random order (garbage model.bin): the newest, step 3000, is the one read
many="$tmp/many"
for s in $(seq 100 100 3000 | shuf); do
    d=$(printf '%s/step_%08d' "$many" "$s"); mkdir -p "$d"
    cp "$tmp/garbage.bin" "$d/model.bin"; touch "$d/state.bin" "$d/DONE"
done
mkdir -p "$many/step_-0000001" && touch "$many/step_-0000001/"{model.bin,state.bin,DONE} # not a step name
refused "step_00003000/model.bin: wrong magic" "$many"
mkfifo "$tmp/fifo.bin"
refused "fifo.bin: not a regular file" "$tmp/fifo.bin"
VMEM_KB=1500000 refused "/dev/zero: out of memory" "$tmp/garbage.bin" --prompt-file /dev/zero # an endless prompt
# a valid checkpoint, no usable GPU (hidden on a machine that has one)
build/test_checkpoint --save "$tmp/run" >/dev/null
CUDA_VISIBLE_DEVICES=-1 refused "no usable GPU" "$tmp/run"
rm -rf "$tmp"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
