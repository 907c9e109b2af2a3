#!/usr/bin/env bash
# Start N processes on this node, one per GPU, with the rank variables core/bootstrap.h reads.
#   scripts/launch_local.sh N ./train_sdm -c configs/sdm_flagship.cfg
# Rank 0 serves the NCCL id on MASTER_ADDR:MASTER_PORT (default 127.0.0.1:29500) to the ranks that show this run's
# SDM_RUN_SECRET (made here unless set). When a rank fails, the others are stopped and the launcher exits with that
# rank's status, naming it. A first Ctrl-C or TERM to the launcher is passed on to every rank (train_sdm finishes its
# step and writes its checkpoint); a second stops them at once.
set -u
n=${1:?usage: launch_local.sh N COMMAND...}; shift
[ $# -gt 0 ] || { echo "launch_local.sh: no command given" >&2; exit 2; }
launch_graceful=1 # a stop (Ctrl-C, TERM) reaches the ranks as a TERM: they checkpoint and exit (launch_common.sh)
source "$(dirname "$0")/launch_common.sh"
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500} WORLD_SIZE=$n
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} # no NVLink multicast (shared hosts)
for ((r = 0; r < n; r++)); do
    RANK=$r LOCAL_RANK=$r launch_rank $r "$@"
done
launch_wait launch_local.sh
