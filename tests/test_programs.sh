#!/usr/bin/env bash
# The programs refuse bad input before touching a GPU: a clear message naming the file, line, key or argument, and
# a non-zero exit. train_sdm prepares its run folder (parents made, stale .tmp folders of ours removed, config.cfg
# and train.log written) before the GPU check, refuses a run folder it cannot use, and without a usable GPU says so
# plainly. (Runs on the CPU-only CI machine; `make test` builds the programs first.)
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
expect_fail "key 'sdm.num_reads': 2000 exceeds slots_per_head 1024" \
    ./train_sdm -c configs/debug_sdm.cfg sdm.slots_per_head=1024 sdm.num_reads=2000
rm -f "$bad"
tmp=$(mktemp -d)
run="$tmp/runs/a"
mkdir -p "$run/step_00000003.tmp" "$run/step_0000003.tmp"
expect_fail "no usable GPU" env CUDA_VISIBLE_DEVICES=-1 ./train_sdm -c configs/debug_sdm.cfg run_dir="$run"
for f in config.cfg train.log step_0000003.tmp; do
    if [ -e "$run/$f" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $run/$f missing"; fi
done
if [ ! -e "$run/step_00000003.tmp" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: stale .tmp kept"; fi
touch "$tmp/file"
expect_fail "run folder $tmp/file: exists and is not a folder" ./train_sdm -c configs/debug_sdm.cfg run_dir="$tmp/file"
expect_fail "cannot create $tmp/file/x" ./train_sdm -c configs/debug_sdm.cfg run_dir="$tmp/file/x/y"
rm -rf "$tmp"
if ./train_sdm --help | grep -q "sdm.slots_per_head"; then pass=$((pass + 1))
else fail=$((fail + 1)); echo "FAIL: --help lists no keys"; fi
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
