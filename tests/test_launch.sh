#!/usr/bin/env bash
# The launchers: the rank variables core/bootstrap.h reads, one fresh secret shared by every rank, SLURM's variables
# out of the way, a failing rank stopping the others quickly with its number and status reported, and a stop sent to
# launch_local.sh passed on to the ranks (which finish) before a second one stops them at once.
# (ssh is replaced by a local shell.)
pass=0; fail=0
check() {
    if [ "$1" = "$2" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL $3: got '$1', want '$2'"; fi
}
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

got=$(scripts/launch_local.sh 3 sh -c 'echo $RANK/$LOCAL_RANK/$WORLD_SIZE' | sort | tr '\n' ' ')
check "$got" "0/0/3 1/1/3 2/2/3 " "launch_local ranks"
got=$(SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 scripts/launch_local.sh 2 sh -c 'echo ${SLURM_PROCID:-unset}' |
    tr '\n' ' ')
check "$got" "unset unset " "launch_local inside a SLURM allocation"
got=$(scripts/launch_local.sh 3 sh -c 'echo $SDM_RUN_SECRET' | sort -u)
check "$(printf '%s' "$got" | grep -cE '^[0-9a-f]{32}$')" "1" "launch_local: one 32-hex secret for every rank"
again=$(scripts/launch_local.sh 1 sh -c 'echo $SDM_RUN_SECRET')
[ "$got" != "$again" ]; check "$?" "0" "launch_local: a new secret per run"

# The fake program: rank 1 fails with status 3 after a moment, the others would run for a minute. Each records its
# pid, so the test can see that none survives the launcher.
fake=$tmp/fake.sh
printf '#!/bin/sh\necho $$ > %s/pid.$RANK\n[ "$RANK" = 1 ] && { sleep 0.5; exit 3; }\nsleep 60\n' "$tmp" > "$fake"
chmod +x "$fake"
# (a zombie is not a survivor: a launcher that exits right after its KILL leaves the reaping to init)
survivors() {
    local n=0 f st
    for f in "$tmp"/pid.*; do
        st=$(ps -o stat= -p "$(cat "$f")" 2>/dev/null)
        [ -n "$st" ] && [ "${st#Z}" = "$st" ] && n=$((n + 1))
    done
    echo $n
}
start=$(date +%s)
scripts/launch_local.sh 4 "$fake" 2> "$tmp/err"; rc=$?
check "$rc" "3" "launch_local: exit status of the failing rank"
check "$(grep -c 'rank 1 exited with status 3' "$tmp/err")" "1" "launch_local names the failed rank"
check "$(($(date +%s) - start < 10))" "1" "launch_local stops the other ranks quickly"
check "$(ls "$tmp"/pid.* | wc -l) $(survivors)" "4 0" "launch_local: every rank started, none survives"
rm -f "$tmp"/pid.*

# A stop sent to launch_local.sh reaches every rank as a TERM, and the launcher waits while they finish: each fake rank
# takes 1.5 s (longer than the launcher's TERM-then-KILL second) to "write its checkpoint", then exits 0.
wait_pids() { local i; for i in $(seq 100); do [ "$(ls "$tmp"/pid.* 2>/dev/null | wc -l)" = "$1" ] && return; sleep 0.1; done; }
graceful=$tmp/graceful.sh
printf '#!/bin/sh\ntrap '"'"'kill $s; sleep 1.5; echo > %s/saved.$RANK; exit 0'"'"' TERM\nsleep 60 & s=$!\necho $$ > %s/pid.$RANK\nwait $s\n' \
    "$tmp" "$tmp" > "$graceful"
chmod +x "$graceful"
scripts/launch_local.sh 3 "$graceful" 2> "$tmp/err" & launcher=$!
wait_pids 3
kill -TERM $launcher
wait $launcher; rc=$?
check "$rc" "0" "launch_local: a TERM to the launcher, every rank stopping cleanly"
check "$(ls "$tmp"/saved.* 2>/dev/null | wc -l) $(survivors)" "3 0" "launch_local: every rank finished its stop"
check "$(grep -c 'stop requested' "$tmp/err")" "1" "launch_local says the stop was passed on"
rm -f "$tmp"/pid.* "$tmp"/saved.*
# a rank that does not stop: a second TERM to the launcher stops every rank at once
stuck=$tmp/stuck.sh
printf '#!/bin/sh\ntrap '"'"'echo > %s/saved.$RANK'"'"' TERM\nsleep 60 & s=$!\necho $$ > %s/pid.$RANK\nwhile :; do wait $s; done\n' \
    "$tmp" "$tmp" > "$stuck"
chmod +x "$stuck"
start=$(date +%s)
scripts/launch_local.sh 3 "$stuck" 2> "$tmp/err" & launcher=$!
wait_pids 3
kill -TERM $launcher
sleep 0.6
check "$(survivors)" "3" "launch_local: the ranks still run after the first TERM"
kill -TERM $launcher
wait $launcher; rc=$?
check "$rc" "130" "launch_local: a second TERM"
check "$(($(date +%s) - start < 10)) $(survivors)" "1 0" "launch_local: a second TERM stops every rank at once"
check "$(ls "$tmp"/saved.* 2>/dev/null | wc -l)" "3" "launch_local: every rank got the first TERM"
rm -f "$tmp"/pid.* "$tmp"/saved.*

hosts=$tmp/hosts; printf 'a\n# comment\nb\n' > "$hosts"
fake_ssh=$tmp/ssh; printf '#!/bin/sh\nshift; exec sh -c "$1"\n' > "$fake_ssh"; chmod +x "$fake_ssh"
got=$(SSH=$fake_ssh GPUS_PER_NODE=2 scripts/launch_ssh.sh "$hosts" \
    sh -c 'echo $MASTER_ADDR:$RANK/$LOCAL_RANK/$WORLD_SIZE' | sort | tr '\n' ' ')
check "$got" "a:0/0/4 a:1/1/4 a:2/0/4 a:3/1/4 " "launch_ssh ranks"
got=$(SSH=$fake_ssh GPUS_PER_NODE=2 scripts/launch_ssh.sh "$hosts" sh -c 'echo $SDM_RUN_SECRET' | sort -u)
check "$(printf '%s' "$got" | grep -cE '^[0-9a-f]{32}$')" "1" "launch_ssh: one 32-hex secret for every rank"
start=$(date +%s)
SSH=$fake_ssh GPUS_PER_NODE=2 scripts/launch_ssh.sh "$hosts" "$fake" 2> "$tmp/err"; rc=$?
check "$rc" "3" "launch_ssh: exit status of the failing rank"
check "$(grep -c 'rank 1 exited with status 3' "$tmp/err")" "1" "launch_ssh names the failed rank"
check "$(($(date +%s) - start < 10))" "1" "launch_ssh stops the other ranks quickly"
check "$(ls "$tmp"/pid.* | wc -l) $(survivors)" "4 0" "launch_ssh: every rank started, none survives"

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
