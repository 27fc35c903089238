#!/usr/bin/env bash
# A single-node SLURM cluster on this (Debian) machine, for testing the SLURM profiles:
# a `cpu` partition (the default) and a `gpu` partition on one node that declares fake GPU
# gres, no accounting database (no slurmdbd).
#
#   scripts/slurm_local_cluster.sh install   # apt-get slurmctld slurmd slurm-client munge (root) if missing
#   scripts/slurm_local_cluster.sh start     # write the config, start munged + slurmctld + slurmd
#   eval "$(scripts/slurm_local_cluster.sh env)"   # SLURM_CONF (+ PATH, see bin/srun) for sbatch/snakemake
#   scripts/slurm_local_cluster.sh status
#   scripts/slurm_local_cluster.sh stop      # stop the three daemons (by their pidfiles)
#
# Everything lives under $SLURM_LOCAL_DIR (default /tmp/dflash-eval-slurm): etc/ (slurm.conf,
# gres.conf, munge key), run/ (pidfiles, munge socket), spool/, log/ (daemon logs and
# log/jobcomp.log, SLURM's record of every finished job). Nothing under /etc is changed, and
# a system munged/slurmd is left alone (own munge socket; ports $SLURM_LOCAL_PORT, default
# 6817, and $SLURM_LOCAL_SLURMD_PORT, default the next one, must be free), so several such
# clusters can run side by side in different directories.
#
# bin/srun: snakemake-executor-plugin-slurm-jobstep removes every SLURM_* variable,
# SLURM_CONF included, before it calls srun inside a job. A real cluster's srun then finds
# /etc/slurm/slurm.conf or slurmd's configless cache; this cluster's config is elsewhere,
# so `env` puts $SLURM_LOCAL_DIR/bin first on PATH, where an srun wrapper sets SLURM_CONF
# again and runs the real srun.
#
# The node is declared, not detected (SlurmdParameters=config_overrides): by default 16 CPUs,
# 128 GiB and 2 GPUs (GresTypes=gpu; the GPU "device files" are links to /dev/null), so jobs asking what profiles/slurm-gpu asks are accepted on a small machine;
# they then share its real cores. Change with SLURM_LOCAL_CPUS / _MEM_MB / _GPUS before `start`
# (SLURM_LOCAL_GPUS=0: a cluster without GPU gres, where `--gpus` requests are rejected).
# Without slurmdbd there is no `sacct`: finished jobs stay visible to `squeue` and
# `scontrol show job` for MinJobAge=3600 s, and each is written to log/jobcomp.log
# (JobCompType=jobcomp/filetxt) with its JobState, Partition and TRES.
#
# Needs root (slurmd starts job steps as the submitting user; the daemons run as root here).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/dflash-eval-slurm}
PORT=${SLURM_LOCAL_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-$((PORT + 1))}
CPUS=${SLURM_LOCAL_CPUS:-16}
MEM_MB=${SLURM_LOCAL_MEM_MB:-131072}
GPUS=${SLURM_LOCAL_GPUS:-2}
NODE=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge)
BINARIES=(slurmctld slurmd sbatch squeue scontrol sinfo munged)

die() { echo "slurm_local_cluster: $*" >&2; exit 1; }

missing_binaries() {
    local b out=()
    for b in "${BINARIES[@]}"; do
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || out+=("$b")
    done
    echo "${out[@]:-}"
}

cmd_install() {
    local missing
    missing=$(missing_binaries)
    if [ -z "$missing" ]; then
        echo "slurm_local_cluster: SLURM and munge already installed"
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "missing: $missing; installing needs root (apt-get install ${PACKAGES[*]})"
    command -v apt-get >/dev/null || die "missing: $missing and no apt-get (Debian/Ubuntu only)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
    missing=$(missing_binaries)
    [ -z "$missing" ] || die "still missing after apt-get install: $missing"
    echo "slurm_local_cluster: installed ${PACKAGES[*]}"
}

write_config() {
    mkdir -p "$DIR"/{etc,run,log,dev} "$DIR"/spool/{ctld,d}
    chmod 0700 "$DIR/etc"
    chmod 0755 "$DIR/run"  # munge clients need to reach the socket
    local i
    for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$DIR/dev/gpu$i"; done
    mkdir -p "$DIR/bin"
    cat > "$DIR/bin/srun" <<EOF
#!/bin/sh
# srun with this cluster's config (see scripts/slurm_local_cluster.sh: bin/srun)
SLURM_CONF="$DIR/etc/slurm.conf" exec "$(command -v srun)" "\$@"
EOF
    chmod 0755 "$DIR/bin/srun"
    if [ ! -s "$DIR/etc/munge.key" ]; then
        (umask 077 && head -c 1024 /dev/urandom > "$DIR/etc/munge.key")
    fi
    cat > "$DIR/etc/slurm.conf" <<EOF
# Written by scripts/slurm_local_cluster.sh: a single-node test cluster, no accounting.
ClusterName=dflash-local
SlurmctldHost=${NODE}(127.0.0.1)
SlurmctldPort=${PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${DIR}/run/munge.socket
StateSaveLocation=${DIR}/spool/ctld
SlurmdSpoolDir=${DIR}/spool/d
SlurmctldPidFile=${DIR}/run/slurmctld.pid
SlurmdPidFile=${DIR}/run/slurmd.pid
SlurmctldLogFile=${DIR}/log/slurmctld.log
SlurmdLogFile=${DIR}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=${DIR}/log/jobcomp.log
MinJobAge=3600
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM_MB}$([ "$GPUS" -gt 0 ] && echo " Gres=gpu:${GPUS}") State=UNKNOWN
PartitionName=cpu Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=${NODE} MaxTime=INFINITE State=UP
EOF
    [ "$GPUS" -gt 0 ] || { : > "$DIR/etc/gres.conf"; return 0; }
    cat > "$DIR/etc/gres.conf" <<EOF
# Fake GPUs: slurmd drops GPUs without a File, and a File must be a character device;
# links to /dev/null pass that check. Jobs get CUDA_VISIBLE_DEVICES=<index> as usual.
AutoDetect=off
NodeName=${NODE} Name=gpu File=${DIR}/dev/gpu[0-$((GPUS - 1))]
EOF
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2; shift 2
    local i
    for ((i = 0; i < seconds * 4; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.25
    done
    return 1
}

node_ready() {
    local state
    state=$(sinfo -h -N -n "$NODE" -o %t 2>/dev/null | head -1)
    case "$state" in idle|mix|alloc) return 0 ;; *) return 1 ;; esac
}

fail_start() {
    echo "slurm_local_cluster: $1; last log lines:" >&2
    local f
    for f in "$DIR"/log/munged.log "$DIR"/log/slurmctld.log "$DIR"/log/slurmd.log; do
        [ -f "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }
    done
    cmd_stop >/dev/null 2>&1 || true
    exit 1
}

cmd_start() {
    local missing
    missing=$(missing_binaries)
    [ -z "$missing" ] || die "missing: $missing (run: $0 install, as root)"
    [ "$(id -u)" = 0 ] || die "the daemons must run as root (slurmd starts job steps as the submitting user)"
    write_config
    export SLURM_CONF="$DIR/etc/slurm.conf"
    if ! pid_alive "$DIR/run/munged.pid"; then
        munged --force --socket="$DIR/run/munge.socket" --key-file="$DIR/etc/munge.key" \
            --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
            --seed-file="$DIR/run/munged.seed" || fail_start "munged did not start"
    fi
    wait_for 10 munge test -S "$DIR/run/munge.socket" || fail_start "no munge socket"
    if ! pid_alive "$DIR/run/slurmctld.pid"; then
        # -c: start from a clean state (no jobs or node states left from an earlier start)
        slurmctld -c -f "$SLURM_CONF" || fail_start "slurmctld did not start"
    fi
    wait_for 30 slurmctld scontrol ping || fail_start "slurmctld does not answer scontrol ping"
    if ! pid_alive "$DIR/run/slurmd.pid"; then
        slurmd -f "$SLURM_CONF" || fail_start "slurmd did not start"
    fi
    wait_for 60 node node_ready || fail_start "node $NODE did not become idle"
    echo "slurm_local_cluster: up (node $NODE: $CPUS CPUs, $MEM_MB MB, gpu:$GPUS; partitions cpu, gpu)"
    cmd_env
}

cmd_env() {
    echo "export SLURM_CONF=$DIR/etc/slurm.conf PATH=$DIR/bin:\$PATH"
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE
    local name=$1 pidfile=$2 pid i
    [ -s "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for ((i = 0; i < 80; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
        echo "slurm_local_cluster: stopped $name ($pid)"
    fi
    rm -f "$pidfile"
}

cmd_stop() {
    stop_pidfile slurmd "$DIR/run/slurmd.pid"
    stop_pidfile slurmctld "$DIR/run/slurmctld.pid"
    stop_pidfile munged "$DIR/run/munged.pid"
}

cmd_status() {
    local name
    for name in munged slurmctld slurmd; do
        if pid_alive "$DIR/run/$name.pid"; then echo "$name: running ($(cat "$DIR/run/$name.pid"))"
        else echo "$name: stopped"; fi
    done
    if pid_alive "$DIR/run/slurmctld.pid"; then SLURM_CONF="$DIR/etc/slurm.conf" sinfo; fi
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
