#!/usr/bin/env bash
# Run test binaries, echo their output, and print the summed "N passed, N failed" last.
# A binary that crashes or prints no summary counts as one failure.
passed=0; failed=0
for t in "$@"; do
    echo "== $t"
    out=$("$t" 2>&1); rc=$?
    printf '%s\n' "$out"
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -z "$line" ]; then
        echo "FAIL $t: exited $rc without a summary line"; failed=$((failed + 1)); continue
    fi
    p=${line%% passed*}; f=${line#*, }; f=${f%% failed*}
    passed=$((passed + p)); failed=$((failed + f))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then echo "FAIL $t: exit status $rc"; failed=$((failed + 1)); fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
