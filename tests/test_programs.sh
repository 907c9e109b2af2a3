#!/usr/bin/env bash
# The programs refuse bad input before touching a GPU: a clear message naming the file, line, key or argument, and
# a non-zero exit. (Runs on the CPU-only CI machine; `make test` builds the programs first.)
pass=0; fail=0
cd "$(dirname "$0")/.."
# expect_fail NEEDLE COMMAND...: the command exits non-zero and its stderr contains NEEDLE
expect_fail() {
    local needle=$1; shift
    local err; err=$("$@" 2>&1 >/dev/null); local rc=$?
    if [ $rc -ne 0 ] && [[ "$err" == *"$needle"* ]]; then pass=$((pass + 1))
    else fail=$((fail + 1)); echo "FAIL: '$*' exited $rc with: $err (wanted '$needle')"; fi
}
bad=$(mktemp --suffix=.cfg)
printf 'model.dim = 64\nmodel.n_layers = 2\nmodel.attn_at = 0,1\nsdm.bogus = 1\n' > "$bad"
expect_fail "$bad:4: unknown key 'sdm.bogus'" ./train_sdm -c "$bad"
expect_fail "argument 'optim.lr=fast'" ./train_sdm -c configs/debug_sdm.cfg optim.lr=fast
expect_fail "argument '--bogus'" ./train_sdm --bogus
expect_fail "configs/missing.cfg: cannot open" ./train_sdm -c configs/missing.cfg
expect_fail "layer 7 is assigned no type" ./train_sdm -c configs/debug_sdm.cfg model.sdm_at=1,3,5
expect_fail "key 'sdm.num_reads': 2000 exceeds slots_per_head 1024" ./train_sdm -c configs/debug_sdm.cfg sdm.slots_per_head=1024 sdm.num_reads=2000
rm -f "$bad"
if ./train_sdm --help | grep -q "sdm.slots_per_head"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: --help lists no keys"; fi
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
