#!/usr/bin/env bash
# scripts/prepare_text.sh on a small local file in the format of the `bible` reader (no download): one document
# per chapter (heading, then the verses without their numbers), every 10th chapter to validation; an input without
# chapters is refused. Needs ./prepare_data (`make test` builds it).
pass=0; fail=0
cd "$(dirname "$0")/.."
check() { if eval "$1"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $2"; fi; }
tmp=$(mktemp -d)
for c in $(seq 1 20); do
    printf '\nSong of Tests %d\n\n  1 In the beginning.\n  22 And so on, %d.\n' "$c" "$c"
done > "$tmp/bible.txt"
scripts/prepare_text.sh "$tmp/bible.txt" "$tmp/out" > "$tmp/log" 2>&1; rc=$?
check "[ $rc -eq 0 ] && grep -q '20 documents (18 train, 2 validation)' '$tmp/log'" "exit $rc: $(cat "$tmp/log")"
# document c is "Song of Tests c\nIn the beginning.\nAnd so on, c." plus BOS and EOS: no verse numbers left
want=0
for c in $(seq 1 20); do
    d="Song of Tests $c"$'\n'"In the beginning."$'\n'"And so on, $c."; want=$((want + ${#d} + 2))
done
got=0
for f in "$tmp"/out/*.bin; do got=$((got + ($(stat -c %s "$f") - 1024) / 2)); done
check "[ $got -eq $want ]" "$got tokens in the shards, expected $want"
printf 'not a bible\n' > "$tmp/bad.txt"
scripts/prepare_text.sh "$tmp/bad.txt" "$tmp/out2" > "$tmp/log2" 2>&1; rc=$?
check "[ $rc -ne 0 ] && grep -q 'no chapters' '$tmp/log2'" "an input without chapters was accepted (exit $rc)"
rm -rf "$tmp"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
