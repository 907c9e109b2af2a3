#!/usr/bin/env bash
# prepare_data's numeric options take decimal digits only, within 64 bits: a sign, a space, trailing garbage, an empty
# value or a number past 2^64 - 1 (which strtoull wraps or saturates) is refused, naming the option, before any
# work. Needs ./prepare_data (`make test` builds it).
pass=0; fail=0
cd "$(dirname "$0")/.."
check() { if eval "$1"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $2"; fi; }
tmp=$(mktemp -d)
for v in "+5" " 5" "5 " "-1" "5x" "" "18446744073709551616" "99999999999999999999"; do
    ./prepare_data --task mqar --seed "$v" -o "$tmp/out" > "$tmp/log" 2>&1; rc=$?
    check "[ $rc -ne 0 ] && grep -q -- '--seed' '$tmp/log' && [ ! -e '$tmp/out' ]" \
        "--seed '$v' was not refused before any work (exit $rc): $(cat "$tmp/log")"
done
for v in "+1024" "1e3" "0x400"; do
    ./prepare_data --task mqar --seq-len "$v" -o "$tmp/out" > "$tmp/log" 2>&1; rc=$?
    check "[ $rc -ne 0 ] && grep -q -- '--seq-len' '$tmp/log'" "--seq-len '$v' was accepted (exit $rc)"
done
rm -rf "$tmp"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
