#!/usr/bin/env bash
# Start or stop a Docker daemon for the system tests, the way DESIGN §5 describes it:
# vfs storage (works inside any container or VM), no iptables; the default bridge network stays (verifiers' docker
# runtime starts its containers on it; the image tests choose host or no network themselves).
#
# usage: ci/dockerd.sh start    reuse a daemon whose socket answers; otherwise start one in the background,
#                               record its pid and wait until it answers. Prints "reused" or "started".
#        ci/dockerd.sh stop     stop the daemon this script started (by its recorded pid); a reused one is left alone.
#        ci/dockerd.sh status   exit 0 when the socket answers.
#
# State (pid file, log) lives in $PRIMERL_CI_STATE (default: $TMPDIR/primerl-ci).
set -euo pipefail
state="${PRIMERL_CI_STATE:-${TMPDIR:-/tmp}/primerl-ci}"
pidfile="$state/dockerd.pid"
log="$state/dockerd.log"

answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

case "${1:-}" in
start)
    if answers; then echo reused; exit 0; fi
    command -v dockerd >/dev/null || "$(dirname "$0")/apt-install.sh" docker.io
    mkdir -p "$state"
    # setsid: the daemon outlives this script and is not hit by the caller's terminal signals.
    setsid dockerd --storage-driver=vfs --iptables=false >"$log" 2>&1 < /dev/null &
    echo $! > "$pidfile"
    for _ in $(seq 1 120); do
        if answers; then echo started; exit 0; fi
        if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
            echo "dockerd exited during start-up; its log ($log) ends with:" >&2; tail -20 "$log" >&2
            rm -f "$pidfile"; exit 1
        fi
        sleep 0.5
    done
    echo "dockerd did not answer within 60 s; see $log" >&2; exit 1
    ;;
stop)
    [ -f "$pidfile" ] || exit 0
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$pidfile"
    ;;
status)
    answers
    ;;
*)
    echo "usage: $0 start|stop|status" >&2; exit 2
    ;;
esac
