#!/usr/bin/env bash
# The launchers give each process the rank variables core/bootstrap.h reads. (ssh is replaced by a local shell.)
pass=0; fail=0
check() { if [ "$1" = "$2" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL $3: got '$1', want '$2'"; fi; }
cd "$(dirname "$0")/.."
got=$(scripts/launch_local.sh 3 sh -c 'echo $RANK/$LOCAL_RANK/$WORLD_SIZE' | sort | tr '\n' ' ')
check "$got" "0/0/3 1/1/3 2/2/3 " "launch_local ranks"
scripts/launch_local.sh 2 sh -c '[ $RANK = 1 ] && exit 7; exit 0'
check "$?" "7" "launch_local exit status of a failing rank"
hosts=$(mktemp); printf 'a\n# comment\nb\n' > "$hosts"
fake_ssh=$(mktemp); printf '#!/bin/sh\nshift; sh -c "$1"\n' > "$fake_ssh"; chmod +x "$fake_ssh"
got=$(SSH=$fake_ssh GPUS_PER_NODE=2 scripts/launch_ssh.sh "$hosts" sh -c 'echo $MASTER_ADDR:$RANK/$LOCAL_RANK/$WORLD_SIZE' | sort | tr '\n' ' ')
check "$got" "a:0/0/4 a:1/1/4 a:2/0/4 a:3/1/4 " "launch_ssh ranks"
rm -f "$hosts" "$fake_ssh"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
