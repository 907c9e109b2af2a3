#!/usr/bin/env bash
# Start a run over several nodes with plain ssh: one process per GPU on each host of HOSTFILE (one host per line).
#   GPUS_PER_NODE=8 scripts/launch_ssh.sh hosts.txt ./train_sdm -c configs/sdm_flagship.cfg
# The first host is rank 0 and serves the NCCL id on MASTER_ADDR:MASTER_PORT (MASTER_ADDR: an address of the first
# host that every host reaches) to the ranks that show this run's SDM_RUN_SECRET (made here unless set; it travels on
# the ssh command line). The repository must be at the same path on every host (a shared filesystem, or a copy).
# When a rank fails, the others are stopped and the launcher exits with that rank's status, naming it. ssh -tt gives
# each remote rank a terminal, so stopping its ssh hangs it up on the remote host; keep-alives every 30 s make a dead
# host's ssh (hence its rank's failure) show within about 90 s. SSH overrides the ssh command.
# Ctrl-C or a TERM to this launcher stops every rank at once, without a checkpoint (a hang-up, not train_sdm's stop
# signal, reaches the remote ranks); for a graceful stop send TERM to the train_sdm processes on every host.
set -u
hostfile=${1:?usage: launch_ssh.sh HOSTFILE COMMAND...}; shift
[ $# -gt 0 ] || { echo "launch_ssh.sh: no command given" >&2; exit 2; }
mapfile -t hosts < <(grep -v '^\s*\(#\|$\)' "$hostfile")
[ ${#hosts[@]} -gt 0 ] || { echo "launch_ssh.sh: $hostfile lists no hosts" >&2; exit 2; }
source "$(dirname "$0")/launch_common.sh"
g=${GPUS_PER_NODE:-8}
world=$((${#hosts[@]} * g))
master=${MASTER_ADDR:-${hosts[0]}}
port=${MASTER_PORT:-29500}
dir=$(pwd)
cmd=$(printf '%q ' "$@")
for ((h = 0; h < ${#hosts[@]}; h++)); do
    for ((l = 0; l < g; l++)); do
        r=$((h * g + l))
        env="MASTER_ADDR=$master MASTER_PORT=$port WORLD_SIZE=$world RANK=$r LOCAL_RANK=$l NCCL_NVLS_ENABLE=0"
        env+=" SDM_RUN_SECRET=$SDM_RUN_SECRET"
        launch_rank $r ${SSH:-ssh -tt -o ServerAliveInterval=30 -o ServerAliveCountMax=3} "${hosts[$h]}" "cd $(printf '%q' "$dir") && $env exec $cmd"
    done
done
launch_wait launch_ssh.sh
