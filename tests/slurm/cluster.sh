#!/usr/bin/env bash
# A throwaway one-node SLURM cluster (munged + slurmctld + slurmd) that lives entirely in one directory.
#
#   tests/slurm/cluster.sh install      # apt-get install slurm-wlm munge, only if a daemon is missing
#   tests/slurm/cluster.sh start DIR    # write DIR/slurm.conf, start the daemons, wait for the node to be idle
#   tests/slurm/cluster.sh stop DIR     # stop the daemons recorded in DIR/*.pid (and only those)
#
# Clients talk to the cluster with SLURM_CONF=DIR/slurm.conf (start prints that line). Everything a
# cluster writes (config, munge key and socket, spool, state, logs, pids) is under DIR and its ports
# are picked free at start, so several clusters, or a leftover one, do not collide. Needs root: the
# daemons and the jobs run as root, and munged runs as root with a key of its own (see start).
# Measured on Debian 12 (slurm-wlm 22.05, munge 0.5.15, no systemd).
set -euo pipefail

EXIT_INSTALL=3   # install: the packages are missing and cannot be installed (tests skip on this)
EXIT_START=4     # start: a daemon died or the node did not become idle in time
START_TIMEOUT=${SLURM_START_TIMEOUT:-60}   # seconds to wait for the node to be idle

die() { local code=$1; shift; echo "cluster.sh: $*" >&2; exit "$code"; }
have_daemons() { command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null 2>&1

cmd_install() {
    have_daemons && { echo "cluster.sh: slurmctld, slurmd and munged already installed"; return 0; }
    [ "$(id -u)" = 0 ] || die $EXIT_INSTALL "slurm-wlm/munge are missing and installing them needs root"
    command -v apt-get >/dev/null || die $EXIT_INSTALL "slurm-wlm/munge are missing and there is no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have empty package lists: update once if the first try fails.
    apt-get install -y -q slurm-wlm munge || { apt-get update -q && apt-get install -y -q slurm-wlm munge; } \
        || die $EXIT_INSTALL "apt-get install slurm-wlm munge failed"
    have_daemons || die $EXIT_INSTALL "installed slurm-wlm and munge but slurmctld/slurmd/munged are not on PATH"
}

free_port() { "$(command -v python3 || command -v python3.11 || echo python)" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Start "$@" in the background in its own session (so a Ctrl-C of the caller does not reach it), output
# to DIR/log/NAME.out, and record its pid in DIR/NAME.pid. Every daemon runs in the foreground (-F/-D),
# so $! is the daemon itself.
spawn() {
    local name=$1; shift
    setsid "$@" </dev/null >"$DIR/log/$name.out" 2>&1 &
    echo $! >"$DIR/$name.pid"
}

alive() { kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

# The last lines of every log, for a failure message.
logs() { for f in "$DIR"/log/*; do echo "--- $f"; tail -n 20 "$f"; done; }

cmd_start() {
    [ "$(id -u)" = 0 ] || die $EXIT_START "start needs root (slurmd and the jobs run as root)"
    have_daemons || die $EXIT_START "slurmctld/slurmd/munged not found: run '$0 install' first"
    mkdir -p "$DIR"/{log,spool,state,munge}
    DIR=$(cd "$DIR" && pwd)
    for d in munged slurmctld slurmd; do   # never lose track of running daemons by overwriting their pids
        [ -f "$DIR/$d.pid" ] && alive $d && die $EXIT_START "a cluster is already running in $DIR ($d)"
    done
    local node; node=$(hostname -s)
    local ctld_port; ctld_port=$(free_port)
    local slurmd_port; slurmd_port=$(free_port)
    while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done

    # munge: a fresh key and socket in DIR. munged runs as root here; --force lets it accept a socket
    # directory below one that only root may enter (pytest's tmp dirs are 0700), which is fine because
    # every client (slurm daemons, sbatch, srun) runs as root too.
    chmod 700 "$DIR/munge"
    [ -f "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key"
    spawn munged munged --foreground --force --socket="$DIR/munge/socket" --key-file="$DIR/munge/munge.key" \
        --log-file="$DIR/log/munged.log" --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/seed"
    for _ in $(seq 50); do [ -S "$DIR/munge/socket" ] && break; alive munged || break; sleep 0.1; done
    [ -S "$DIR/munge/socket" ] || { logs >&2; die $EXIT_START "munged did not create its socket"; }

    # CPUs=4 on a 2-core machine: config_overrides makes slurmd report what is declared here instead
    # of the hardware (otherwise slurmctld marks the node INVAL, "Low CPUs").
    cat >"$DIR/slurm.conf" <<EOF
ClusterName=dynatrain-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/socket
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
KillWait=5
MinJobAge=600
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/state/slurmctld.pidfile
SlurmdPidFile=$DIR/spool/slurmd.pidfile
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
EOF
    export SLURM_CONF=$DIR/slurm.conf
    spawn slurmctld slurmctld -D -c -f "$SLURM_CONF"   # -c: no state from an earlier cluster
    spawn slurmd slurmd -D -f "$SLURM_CONF" -N "$node"

    local state="" t0=$SECONDS
    while [ $((SECONDS - t0)) -lt "$START_TIMEOUT" ]; do
        for d in munged slurmctld slurmd; do
            alive $d || { logs >&2; die $EXIT_START "$d (pid $(cat "$DIR/$d.pid")) exited during start"; }
        done
        state=$(sinfo -h -N -n "$node" -o %t 2>/dev/null || true)
        [ "$state" = idle ] && { echo "SLURM_CONF=$SLURM_CONF"; return 0; }
        sleep 0.5
    done
    logs >&2
    die $EXIT_START "node $node not idle after ${START_TIMEOUT}s (sinfo state: '${state:-none}'); run '$0 stop $DIR'"
}

# Stop one recorded daemon: TERM, then KILL after 10 s. The pid is only signalled while its command
# line still names DIR (every daemon got a path in DIR), so a reused pid is never touched.
stop_one() {
    local f="$DIR/$1.pid" pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$DIR/"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && { echo "cluster.sh: $1 (pid $pid) ignored TERM, killing" >&2; kill -KILL "$pid"; }
    fi
    rm -f "$f"
}

cmd_stop() {
    DIR=$(cd "$DIR" && pwd)
    # Jobs still running would outlive slurmd (their slurmstepd is not its child): cancel them first.
    if [ -f "$DIR/slurmctld.pid" ] && alive slurmctld; then
        SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
        for _ in $(seq 50); do
            [ -z "$(SLURM_CONF=$DIR/slurm.conf timeout 5 squeue -h -t R,CG 2>/dev/null)" ] && break; sleep 0.2
        done
    fi
    # Each takes a second or two to exit: stop both slurm daemons together, munged (their auth) last.
    stop_one slurmd & stop_one slurmctld & wait
    stop_one munged
}

cmd=${1:-}; DIR=${2:-}
case $cmd in
    install) cmd_install ;;
    start|stop) [ -n "$DIR" ] || die 2 "usage: $0 $cmd DIR"; [ "$cmd" = stop ] && [ ! -d "$DIR" ] && exit 0; "cmd_$cmd" ;;
    *) die 2 "usage: $0 install | start DIR | stop DIR" ;;
esac
