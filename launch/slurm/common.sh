# shellcheck shell=bash
# Helpers sourced by launch/slurm/*.sbatch (bash >= 4.4). Nothing here runs on its own.
#
# Every command a template starts is printed first, to the job's batch log, in three kinds of line
# (launch/slurm/render.py parses them):
#   + <command>                 what the batch shell runs (srun steps), exactly, shell-quoted
#   [<host> <role>] <command>   what runs on that node for that role, exactly as its shell gets it
#   # <text>                    everything else (what is waited for, what a signal would do)
# DRY_RUN=1 prints the same lines and runs nothing. The engines' API key is never expanded into a
# printed line: commands refer to "$SGLANG_API_KEY", which only the node's shell expands.

MF_DRY_RUN=${DRY_RUN:-0}
MF_ENGINE_PIDS=()
# Until the trainer runs there is nothing to checkpoint; USR1's default action would kill the job.
trap 'printf "# USR1 before the trainer started: nothing to checkpoint\n"' USR1

mf_log() { printf '# %s\n' "$*"; }
mf_die() { printf 'error: %s\n' "$*" >&2; exit 2; }
mf_dry() { [[ $MF_DRY_RUN == 1 ]]; }

# One word, quoted for bash only when it needs it (the rule of Python's shlex.quote).
mf_q() {
    local word=$1 escaped="'\\''"
    if [[ $word =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        printf '%s' "$word"
    else
        printf "'%s'" "${word//\'/$escaped}"
    fi
}

mf_quote() {
    local words=() word
    for word in "$@"; do words+=("$(mf_q "$word")"); done
    printf '%s' "${words[*]}"
}

mf_node() {  # mf_node HOST ROLE COMMAND_TEXT: record what HOST runs for ROLE
    printf '[%s %s] %s\n' "$1" "$2" "$3"
}

mf_run() {  # print, then run in the foreground (not in a dry run)
    printf '+ %s\n' "$(mf_quote "$@")"
    mf_dry || "$@"
}

mf_bg() {  # print, then run in the background (not in a dry run); its pid in MF_PID
    printf '+ %s &\n' "$(mf_quote "$@")"
    MF_PID=
    if ! mf_dry; then
        "$@" &
        MF_PID=$!
    fi
}

mf_int() {  # mf_int NAME VALUE MIN: VALUE must be an integer >= MIN
    [[ $2 =~ ^[0-9]+$ ]] && (($2 >= $3)) || mf_die "$1 must be an integer >= $3, got '$2'"
}

mf_gpus_per_node() {  # GPUS_PER_NODE, else Slurm's --gpus-per-node (which may read "h100:8")
    local gpus=${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-8}}
    gpus=${gpus##*:}
    mf_int GPUS_PER_NODE "$gpus" 1
    printf '%s' "$gpus"
}

mf_hosts() {  # MF_HOSTS=(the allocation's hostnames, in Slurm's order)
    [[ -n ${SLURM_JOB_NODELIST:-} ]] || mf_die "SLURM_JOB_NODELIST is unset: submit with sbatch, or dry-run with launch/slurm/render.py"
    local text
    text=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || mf_die "scontrol show hostnames '$SLURM_JOB_NODELIST' failed"
    mapfile -t MF_HOSTS <<<"$text"
}

mf_join() {  # mf_join SEP WORD...: the words joined by SEP
    local IFS=$1
    shift
    printf '%s' "$*"
}

mf_seq_list() {  # mf_seq_list FIRST LAST SEP: FIRST..LAST joined by SEP
    local out=() i
    for ((i = $1; i <= $2; i++)); do out+=("$i"); done
    mf_join "$3" "${out[@]}"
}

mf_engine_backend() {  # ENGINE_BACKEND: sglang (default), or local: the project's own engine server (CPU hosts)
    ENGINE_BACKEND=${ENGINE_BACKEND:-sglang}
    case $ENGINE_BACKEND in
        sglang) ;;
        local) ((ENGINE_TP == 1)) || mf_die "ENGINE_BACKEND=local serves one device per engine: set ENGINE_TP=1, got $ENGINE_TP" ;;
        *) mf_die "ENGINE_BACKEND must be sglang or local, got '$ENGINE_BACKEND'" ;;
    esac
}

# /tmp is each host's own on the tools/cluster mini-cluster (Slurm's ClusterName mfcluster), and
# on any cluster whose nodes stage nothing there (MF_TMP_IS_NODE_LOCAL=1): what the job's hosts share
# must live elsewhere. The trainer gets the variable too and refuses its own keys (checkpoint.save_dir,
# logging.dir, model.hf_path, data.path) under /tmp by name.
mf_shared_paths() {  # mf_shared_paths NAME=VALUE...: refuse a value under /tmp where /tmp is node-local
    [[ ${SLURM_CLUSTER_NAME:-} == mfcluster ]] && MF_TMP_IS_NODE_LOCAL=1
    [[ ${MF_TMP_IS_NODE_LOCAL:-0} == 1 ]] || return 0
    export MF_TMP_IS_NODE_LOCAL
    local pair name value real
    for pair in "$@"; do
        name=${pair%%=*} value=${pair#*=}
        [[ -n $value ]] || continue
        real=$(realpath -m -- "$value")
        if [[ $real == /tmp || $real == /tmp/* ]]; then
            mf_die "$name=$value is under /tmp, which is each host's own on this cluster: put it on the shared filesystem (outside /tmp)"
        fi
    done
}

mf_config_args() {  # MF_CONFIG_ARGS=(--config F ...) from CONFIG (space-separated; later files win)
    MF_CONFIG_ARGS=()
    local file
    for file in $CONFIG; do
        [[ -f $file ]] || mf_die "CONFIG names a file that does not exist (paths are relative to $(pwd)): $file"
        MF_CONFIG_ARGS+=(--config "$file")
    done
    ((${#MF_CONFIG_ARGS[@]})) || mf_die "CONFIG is empty"
}

mf_activate() {  # the software environment: VENV=<dir> activates a virtualenv (modules/conda: do it before sbatch)
    if [[ -n ${VENV:-} ]]; then
        printf '+ source %s\n' "$(mf_q "$VENV/bin/activate")"
        mf_dry || source "$VENV/bin/activate"
    fi
}

mf_api_key() {  # export SGLANG_API_KEY; a random one for this job when unset. Never printed.
    if [[ -z ${SGLANG_API_KEY:-} ]]; then
        SGLANG_API_KEY=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
        mf_log "SGLANG_API_KEY was unset: generated one for this job (not printed)"
    fi
    export SGLANG_API_KEY
}

# The trainer's torchrun, wrapped so that its pid lands in a node-local file: on USR1 the batch
# shell signals torchrun's children (the trainer ranks) and not torchrun itself, which would
# forward a second SIGTERM and then SIGKILL the ranks after its shutdown timeout.
mf_trainer_wrap() {  # MF_WRAP=(bash -c ... PIDFILE)
    MF_PIDFILE=/tmp/megatron-flash-${SLURM_JOB_ID}-torchrun.pid
    MF_WRAP=(bash -c 'echo $$ > "$0" && exec "$@"' "$MF_PIDFILE")
}

mf_checkpoint_cmd() {  # MF_CHECKPOINT_CMD=(srun step that sends one SIGTERM to every trainer rank)
    # --ntasks too: srun otherwise takes the job's SLURM_NTASKS (one per node of the whole job) and
    # refuses a step on fewer nodes ("More processors requested than permitted").
    MF_CHECKPOINT_CMD=(srun --overlap --nodes="$#" --ntasks-per-node=1 --ntasks="$#" --nodelist="$(mf_join , "$@")"
                       bash -c 'pkill -TERM -P "$(cat "$0")"' "$MF_PIDFILE")
}

# USR1 (#SBATCH --signal=B:USR1@...) reaches only the batch shell. The trainer ranks then get one
# SIGTERM each: the controller checkpoints at the end of the current step and exits 0.
mf_on_usr1() {
    mf_log "USR1 ($(date -u +%FT%TZ)): the time limit is near; asking the trainer ranks to checkpoint and stop"
    MF_PREEMPTED=1
    MF_TRAPPED=1
    mf_run "${MF_CHECKPOINT_CMD[@]}" || mf_log "could not signal the trainer ranks"
}

mf_install_usr1() {
    MF_PREEMPTED=0
    mf_log "on USR1: + $(mf_quote "${MF_CHECKPOINT_CMD[@]}")"
    trap mf_on_usr1 USR1
}

# mf_wait PID: its exit code. A trapped signal makes `wait` return 128+n at once, whether or not the
# child ended (bash may already have reaped it, so `kill -0` cannot tell): wait again after every
# trap; bash keeps a reaped child's status for that next `wait`. If the child's own status came
# back just before the trap ran, the next `wait` answers 127 (nothing left): keep the status.
mf_wait() {
    local pid=$1 rc saved=
    MF_TRAPPED=0
    while :; do
        wait "$pid" && rc=0 || rc=$?
        if [[ $MF_TRAPPED == 1 ]]; then
            MF_TRAPPED=0
            ((rc > 128)) || saved=$rc
            continue
        fi
        if [[ $rc == 127 && -n $saved ]]; then rc=$saved; fi
        return "$rc"
    done
}

mf_wait_healthy() {  # mf_wait_healthy TIMEOUT_S URL...: every GET URL/health answers 200
    local timeout=$1 url pid
    shift
    mf_log "wait up to ${timeout}s for GET <url>/health = 200 from: $*"
    mf_dry && return 0
    local deadline=$((SECONDS + timeout)) pending=("$@") waiting
    while ((${#pending[@]})); do
        waiting=()
        for url in "${pending[@]}"; do
            # The key goes to curl on stdin (a builtin printf): never in a command line `ps` shows.
            printf 'header = "Authorization: Bearer %s"\n' "$SGLANG_API_KEY" \
                | curl -sf -o /dev/null -m 5 -K - "$url/health" || waiting+=("$url")
        done
        pending=("${waiting[@]}")
        ((${#pending[@]})) || break
        for pid in "${MF_ENGINE_PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || { printf 'error: an engine step exited during start-up (see %s)\n' "$LOG_DIR" >&2; return 1; }
        done
        ((SECONDS < deadline)) || { printf 'error: not healthy after %ss: %s\n' "$timeout" "${pending[*]}" >&2; return 1; }
        sleep "${HEALTH_POLL_S:-10}"
    done
    mf_log "engines healthy: $*"
}

mf_finish() {  # mf_finish TRAINER_RC: stop engine steps, requeue after a USR1 stop when REQUEUE=1, exit
    local rc=$1 pid
    mf_dry && { mf_log "dry run: nothing was started"; exit 0; }
    for pid in "${MF_ENGINE_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done  # srun forwards it
    # Bounded: an engine host that cannot be reached (link down) keeps its srun step waiting for
    # Slurm to declare the node lost (SlurmdTimeout, minutes); the trainer's exit code goes out first.
    local deadline=$((SECONDS + ${ENGINE_STOP_TIMEOUT:-60}))
    for pid in "${MF_ENGINE_PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
        if kill -0 "$pid" 2>/dev/null; then
            mf_log "engine step (srun pid $pid) still running ${ENGINE_STOP_TIMEOUT:-60}s after SIGTERM (its host unreachable?): SIGKILL to srun"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    if [[ ${MF_PREEMPTED:-0} == 1 && ${REQUEUE:-0} == 1 && $rc == 0 ]]; then
        mf_run scontrol requeue "$SLURM_JOB_ID"
    fi
    mf_log "trainer exit code $rc"
    exit "$rc"
}
