#!/usr/bin/env bash
# Start a run over several nodes with plain ssh: one process per GPU on each host of HOSTFILE (one host per line).
#   GPUS_PER_NODE=8 scripts/launch_ssh.sh hosts.txt ./train_sdm -c configs/sdm_flagship.cfg
# The first host is rank 0 and serves the NCCL id on MASTER_PORT. The repository must be at the same path on every
# host (a shared filesystem, or a copy). Exits with the first non-zero status.
set -u
hostfile=${1:?usage: launch_ssh.sh HOSTFILE COMMAND...}; shift
[ $# -gt 0 ] || { echo "launch_ssh.sh: no command given" >&2; exit 2; }
mapfile -t hosts < <(grep -v '^\s*\(#\|$\)' "$hostfile")
[ ${#hosts[@]} -gt 0 ] || { echo "launch_ssh.sh: $hostfile lists no hosts" >&2; exit 2; }
g=${GPUS_PER_NODE:-8}
world=$((${#hosts[@]} * g))
master=${MASTER_ADDR:-${hosts[0]}}
port=${MASTER_PORT:-29500}
dir=$(pwd)
cmd=$(printf '%q ' "$@")
pids=()
for ((h = 0; h < ${#hosts[@]}; h++)); do
    for ((l = 0; l < g; l++)); do
        env="MASTER_ADDR=$master MASTER_PORT=$port WORLD_SIZE=$world RANK=$((h * g + l)) LOCAL_RANK=$l NCCL_NVLS_ENABLE=0"
        ${SSH:-ssh} "${hosts[$h]}" "cd $(printf '%q' "$dir") && $env $cmd" &
        pids+=($!)
    done
done
rc=0
for p in "${pids[@]}"; do wait "$p" || { s=$?; [ $rc -eq 0 ] && rc=$s; }; done
exit $rc
