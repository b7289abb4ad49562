#!/bin/bash
# Keep one engine server running on this node (the multi-node template's engine steps run one per
# server). CMD, a shell command line, is started; when it exits on its own it is started again after
# RESTART_DELAY_S (5) seconds, up to MAX_RESTARTS times, then the loop exits with the server's code.
# The trainer (engines.backend=attach) takes an engine whose /health stops answering out of routing
# and, once it answers again, pushes it the current weights before routing to it (docs/cluster.md).
# SIGTERM / SIGINT (srun forwards scancel's) stop the server, wait for it, and end the loop.
#
#   bash launch/slurm/engine_loop.sh MAX_RESTARTS LOG_FILE 'CMD ...'
#
# Every start and exit is appended to LOG_FILE with the server's own output.
set -u
if (($# != 3)) || ! [[ $1 =~ ^[0-9]+$ ]]; then
    echo "usage: engine_loop.sh MAX_RESTARTS LOG_FILE 'CMD ...' (MAX_RESTARTS a non-negative integer)" >&2
    exit 2
fi
max=$1 log=$2 cmd=$3
delay=${RESTART_DELAY_S:-5}
child=

note() { printf '[engine_loop %s] %s\n' "$(date -u +%FT%TZ)" "$*" >> "$log"; }

stop() {
    note "signal: stopping the server${child:+ (pid $child)}"
    if [[ -n $child ]]; then
        kill -TERM "$child" 2>/dev/null
        wait "$child" 2>/dev/null
    fi
    exit 143
}
trap stop TERM INT

restarts=0
while :; do
    bash -c "$cmd" >> "$log" 2>&1 &
    child=$!
    note "started (pid $child), restart $restarts of $max"
    wait "$child"
    rc=$?
    child=
    if ((restarts >= max)); then
        note "server exited with code $rc after $restarts restart(s) (MAX_RESTARTS=$max): it stays down"
        exit "$rc"
    fi
    restarts=$((restarts + 1))
    note "server exited with code $rc; starting it again in $delay s"
    sleep "$delay" &
    child=$!
    wait "$child"
    child=
done
