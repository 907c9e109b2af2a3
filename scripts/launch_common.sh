# scripts/launch_common.sh: sourced by launch_local.sh and launch_ssh.sh. A per-run secret, and the supervision of
# the rank processes: when one fails, the others are stopped and the launcher exits with its status, naming it.
# Each rank runs in its own session (setsid) so that stopping it stops everything it started (ssh, a shell, the
# program). Ctrl-C or a TERM to the launcher: with launch_graceful=1 (launch_local.sh, whose ranks are the programs
# themselves) the first one is passed on as a TERM to every rank and the launcher goes on waiting, so train_sdm can
# finish its step and write its checkpoint (core/stop_signal.h; every rank stops after the same step); a second one,
# or the first one without launch_graceful, stops every rank at once (TERM, then KILL a second later).

# A fresh secret per run (core/bootstrap.h): only processes that know it can join the run.
export SDM_RUN_SECRET=${SDM_RUN_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
# The launcher sets RANK/WORLD_SIZE/LOCAL_RANK; SLURM's (inside an allocation) would contradict them.
unset SLURM_PROCID SLURM_NTASKS SLURM_LOCALID

launch_pids=()
launch_graceful=${launch_graceful:-0}
launch_stopping=0

# launch_rank RANK COMMAND...: start one rank in the background.
launch_rank() {
    local r=$1; shift
    setsid "$@" &
    launch_pids[$r]=$!
}

launch_stop_all() {
    local p
    for p in "${launch_pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
    sleep 1
    for p in "${launch_pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
}

# INT or TERM to the launcher (see the top).
launch_signal() {
    local name=$1 p
    if [ "$launch_graceful" = 1 ] && [ "$launch_stopping" = 0 ]; then
        launch_stopping=1
        echo "$name: stop requested: every rank stops after its current step (with its checkpoint); a second" \
            "Ctrl-C or TERM stops them at once" >&2
        for p in "${launch_pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
        return
    fi
    echo "$name: interrupted, stopping every rank" >&2
    launch_stop_all
    exit 130
}

# Wait for every rank; on the first failure stop the rest and exit with its status. Polls (bash 4.2 has no wait -n -p).
launch_wait() {
    local name=$1 r s
    trap 'launch_signal "$name"' INT TERM
    while [ ${#launch_pids[@]} -gt 0 ]; do
        for r in "${!launch_pids[@]}"; do
            kill -0 "${launch_pids[$r]}" 2>/dev/null && continue
            wait "${launch_pids[$r]}"; s=$?
            unset "launch_pids[$r]"
            if [ $s -ne 0 ]; then
                echo "$name: rank $r exited with status $s; stopping the other ranks" >&2
                launch_stop_all
                exit $s
            fi
        done
        sleep 0.2
    done
    exit 0
}
