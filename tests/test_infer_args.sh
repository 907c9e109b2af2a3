#!/usr/bin/env bash
# infer_sdm refuses bad arguments and unreadable checkpoints before touching the GPU: a non-zero exit and a message
# naming the argument or file. Needs ./infer_sdm (make infer_sdm; `make test` builds it).
pass=0; fail=0
cd "$(dirname "$0")/.."
# refused "what" ARGS... : exit status non-zero and the message contains "what"
refused() {
    local want=$1; shift
    out=$(./infer_sdm "$@" 2>&1); rc=$?
    if [ $rc -ne 0 ] && [[ "$out" == *"$want"* ]]; then pass=$((pass + 1));
    else fail=$((fail + 1)); echo "FAIL infer_sdm $*: exit $rc, output '$out' (want non-zero and '$want')"; fi
}
if [ ! -x ./infer_sdm ]; then echo "FAIL ./infer_sdm is not built (make infer_sdm)"; echo "0 passed, 1 failed"; exit 1; fi
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
rm -rf "$tmp"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
