#!/usr/bin/env bash
# Single-host SLURM test cluster (Debian slurm-wlm + munge) for the SLURM tests.
#
#   tests/slurm/cluster.sh start    install if missing, (re)configure, start, wait idle
#   tests/slurm/cluster.sh stop     cancel jobs, stop slurmd, slurmctld, munged
#   tests/slurm/cluster.sh status   show daemons / sinfo, exit 0 when the node is usable
#
# Must run as root.  Idempotent: "start" on a running, correctly configured
# cluster only waits for the node; a changed config restarts the daemons.
#
# The generated /etc/slurm/slurm.conf carries a marker line; a slurm.conf
# without it (a real site config) is never overwritten unless
# SLURM_TEST_FORCE=1.
#
# By default no GRES is configured: a job asking for --gpus/--gres=gpu is
# rejected at submission by sbatch with
#   "sbatch: error: Invalid generic resource (gres) specification".
# SLURM_TEST_FAKE_GPUS=N (N>0) instead declares N fake GPUs (character devices
# aliasing /dev/null under /run/slurm-test): jobs asking --gpus=K are then
# accepted and get CUDA_VISIBLE_DEVICES=0..K-1, but there is no real GPU
# behind them (torch.cuda.is_available() stays False on a CPU machine).
#
# Environment knobs (all optional):
#   SLURM_TEST_START_TIMEOUT   seconds to wait for the node to become idle (90)
#   SLURM_TEST_MIN_JOB_AGE     MinJobAge in seconds (300; squeue status needs >= 120)
#   SLURM_TEST_FAKE_GPUS       number of fake GPUs to declare (0 = none, the default)
#   SLURM_TEST_FORCE=1         overwrite a slurm.conf not written by this script
set -euo pipefail

ACTION="${1:-start}"
MARKER="# managed-by: tests/slurm/cluster.sh"
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
GRES_CONF="$CONF_DIR/gres.conf"
STATE_DIR=/var/lib/slurm-test
LOG_DIR=/var/log/slurm-test
RUN_DIR=/run/slurm-test
CTLD_PID="$RUN_DIR/slurmctld.pid"
SLURMD_PID="$RUN_DIR/slurmd.pid"
MUNGE_PID=/run/munge/munged.pid
START_TIMEOUT="${SLURM_TEST_START_TIMEOUT:-90}"
MIN_JOB_AGE="${SLURM_TEST_MIN_JOB_AGE:-300}"
FAKE_GPUS="${SLURM_TEST_FAKE_GPUS:-0}"
SECOND_PARTITION=gpu  # besides the default "debug" (tests/slurm/conftest.py names both)

log() { echo "[cluster.sh] $*" >&2; }
die() { echo "[cluster.sh] ERROR: $*" >&2; exit 1; }

need_root() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (uid 0)"
}

# ---------------------------------------------------------------- install
install_packages() {
    local missing=()
    command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
    command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
    command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    [ "${#missing[@]}" -eq 0 ] && return 0
    command -v apt-get >/dev/null 2>&1 || die "apt-get not available; install slurm-wlm and munge yourself"
    log "installing slurm-wlm munge (missing: ${missing[*]})"
    # Keep the packages' init scripts from starting daemons during install:
    # this script starts (and stops) them itself.
    local created_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    local rc=0 apt_log
    mkdir -p "$LOG_DIR"
    apt_log="$LOG_DIR/apt-get.log"
    {
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q &&
            apt-get install -y -q --no-install-recommends slurm-wlm munge
    } >"$apt_log" 2>&1 || rc=$?
    if [ "$created_policy" -eq 1 ]; then
        rm -f /usr/sbin/policy-rc.d
    fi
    if [ "$rc" -ne 0 ]; then
        tail -n 30 "$apt_log" >&2 || true
        die "apt-get install slurm-wlm munge failed (rc=$rc, full log: $apt_log)"
    fi
}

# ---------------------------------------------------------------- helpers
pid_alive() {  # pid_alive PIDFILE NAME -> 0 when the pid in PIDFILE is a live NAME
    local f="$1" name="$2" pid
    [ -s "$f" ] || return 1
    pid="$(cat "$f" 2>/dev/null)" || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [ -r "/proc/$pid/comm" ] || return 1
    [ "$(cat "/proc/$pid/comm")" = "$name" ]
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME
    local f="$1" name="$2" pid _
    if pid_alive "$f" "$name"; then
        pid="$(cat "$f")"
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do
            [ -e "/proc/$pid" ] || break
            sleep 0.2
        done
        if [ -e "/proc/$pid" ]; then
            log "$name (pid $pid) ignored SIGTERM, sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$f"
}

short_host() { hostname -s; }

# ---------------------------------------------------------------- config
write_config() {  # prints "changed" on stdout when slurm.conf was (re)written
    local host cpus mem sockets cores threads tmp
    host="$(short_host)"
    [ -n "$host" ] || die "hostname -s is empty"
    mkdir -p "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/d" "$LOG_DIR" "$RUN_DIR"

    if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF" && [ "${SLURM_TEST_FORCE:-0}" != 1 ]; then
        die "$CONF exists and was not written by this script; refusing to overwrite (SLURM_TEST_FORCE=1 to override)"
    fi

    # Hardware as slurmd sees it (falls back to nproc / /proc/meminfo).
    local hw
    hw="$(slurmd -C 2>/dev/null | head -1 || true)"
    cpus="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
    sockets="$(sed -n 's/.*SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$hw")"
    cores="$(sed -n 's/.*CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$hw")"
    threads="$(sed -n 's/.*ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$hw")"
    mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
    [ -n "$cpus" ] || cpus="$(nproc)"
    [ -n "$mem" ] || mem="$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo)"
    # Leave a little head-room so the node is never marked INVALID for memory.
    mem=$(( mem * 95 / 100 ))
    local topo=""
    if [ -n "$sockets" ] && [ -n "$cores" ] && [ -n "$threads" ] &&
        [ $(( sockets * cores * threads )) -eq "$cpus" ]; then
        topo=" Sockets=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads"
    fi

    [[ "$FAKE_GPUS" =~ ^[0-9]+$ ]] || die "SLURM_TEST_FAKE_GPUS must be a number, got '$FAKE_GPUS'"
    local gres_types="" node_gres="" changed=0
    if [ "$FAKE_GPUS" -gt 0 ]; then
        local g
        for g in $(seq 0 $((FAKE_GPUS - 1))); do
            if [ ! -c "$RUN_DIR/fakegpu$g" ]; then
                rm -f "$RUN_DIR/fakegpu$g"
                mknod "$RUN_DIR/fakegpu$g" c 1 3 || die "mknod $RUN_DIR/fakegpu$g failed (needed for SLURM_TEST_FAKE_GPUS)"
            fi
        done
        gres_types="GresTypes=gpu"
        node_gres=" Gres=gpu:$FAKE_GPUS"
        tmp="$(mktemp)"
        printf '%s\nNodeName=%s Name=gpu File=%s/fakegpu[0-%d]\n' \
            "$MARKER" "$host" "$RUN_DIR" $((FAKE_GPUS - 1)) >"$tmp"
        if ! cmp -s "$tmp" "$GRES_CONF"; then
            install -m 0644 "$tmp" "$GRES_CONF"
            changed=1
        fi
        rm -f "$tmp"
    elif [ -e "$GRES_CONF" ] && grep -qF "$MARKER" "$GRES_CONF"; then
        rm -f "$GRES_CONF"
        changed=1
    fi

    tmp="$(mktemp)"
    cat >"$tmp" <<EOF
$MARKER
# Single-host test cluster.  Regenerated by "cluster.sh start"; edits are lost.
ClusterName=testcluster
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
$gres_types
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
# Reject at submission (not pend forever) jobs no node/partition can satisfy.
EnforcePartLimits=ALL
# Jobs without --mem get this much per CPU instead of the whole node.
DefMemPerCPU=512
# Finished jobs stay visible to squeue this long (no slurmdbd -> no sacct).
MinJobAge=$MIN_JOB_AGE
ReturnToService=2
SlurmctldTimeout=60
SlurmdTimeout=120
InactiveLimit=0
KillWait=30
Waittime=0
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus$topo RealMemory=$mem$node_gres State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
# A second partition on the same node: a profile that names it shows where a job was sent.
PartitionName=$SECOND_PARTITION Nodes=$host Default=NO MaxTime=INFINITE State=UP
EOF
    if [ -e "$CONF" ] && cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
    else
        install -m 0644 "$tmp" "$CONF"
        rm -f "$tmp"
        log "wrote $CONF (node $host: CPUs=$cpus RealMemory=$mem fake GPUs=$FAKE_GPUS)"
        changed=1
    fi
    [ "$changed" -eq 1 ] && echo changed
    return 0
}

# ---------------------------------------------------------------- munge
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then
        return 0
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    local u=munge
    id munge >/dev/null 2>&1 || u=root
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown "$u:" /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    chmod 0400 /etc/munge/munge.key
    rm -f "$MUNGE_PID"
    log "starting munged (user $u)"
    if [ "$u" = root ]; then
        munged --force
    else
        runuser -u munge -- munged --force
    fi
    local _
    for _ in $(seq 1 50); do
        munge_ok && return 0
        sleep 0.2
    done
    die "munged did not come up (see /var/log/munge/munged.log)"
}

# ---------------------------------------------------------------- slurm
start_slurm() {
    local restart="$1"
    if [ "$restart" = 1 ]; then
        stop_pidfile "$SLURMD_PID" slurmd
        stop_pidfile "$CTLD_PID" slurmctld
    fi
    if ! pid_alive "$CTLD_PID" slurmctld; then
        log "starting slurmctld"
        slurmctld
    fi
    local _
    for _ in $(seq 1 100); do
        scontrol ping 2>/dev/null | grep -q UP && break
        sleep 0.2
    done
    scontrol ping 2>/dev/null | grep -q UP || die "slurmctld not responding (see $LOG_DIR/slurmctld.log)"
    if ! pid_alive "$SLURMD_PID" slurmd; then
        log "starting slurmd"
        slurmd -N "$(short_host)"
    fi
}

node_state() { sinfo -h -N -n "$(short_host)" -o '%T' 2>/dev/null | head -1; }

wait_idle() {
    local host state deadline resumed=0
    host="$(short_host)"
    deadline=$(( $(date +%s) + START_TIMEOUT ))
    while :; do
        state="$(node_state || true)"
        case "$state" in
            idle | mixed | allocated | completing) log "node $host is $state"; return 0 ;;
            *drain* | down* | *fail* | invalid* | unknown*)
                # Leftover DOWN/DRAIN state from an earlier run: put it back.
                if [ "$resumed" -lt 3 ] && pid_alive "$SLURMD_PID" slurmd; then
                    scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 ||
                        scontrol update NodeName="$host" State=IDLE >/dev/null 2>&1 || true
                    resumed=$((resumed + 1))
                fi
                ;;
        esac
        if [ "$(date +%s)" -ge "$deadline" ]; then
            sinfo -N -l >&2 || true
            tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
            die "node $host not idle after ${START_TIMEOUT}s (state '${state}')"
        fi
        sleep 0.5
    done
}

do_start() {
    need_root
    install_packages
    local changed
    changed="$(write_config)"
    start_munge
    start_slurm "$([ "$changed" = changed ] && echo 1 || echo 0)"
    wait_idle
}

do_stop() {
    need_root
    if command -v squeue >/dev/null 2>&1 && pid_alive "$CTLD_PID" slurmctld; then
        local ids
        ids="$(squeue -h -o '%i' -t PENDING,RUNNING,SUSPENDED,CONFIGURING,COMPLETING 2>/dev/null | tr '\n' ' ')"
        if [ -n "${ids// /}" ]; then
            log "cancelling jobs: $ids"
            # shellcheck disable=SC2086
            scancel $ids 2>/dev/null || true
            local _
            for _ in $(seq 1 40); do
                [ -z "$(squeue -h -o '%i' -t PENDING,RUNNING,COMPLETING 2>/dev/null)" ] && break
                sleep 0.5
            done
        fi
    fi
    stop_pidfile "$SLURMD_PID" slurmd
    stop_pidfile "$CTLD_PID" slurmctld
    stop_pidfile "$MUNGE_PID" munged
    log "stopped"
}

do_status() {
    local ok=0 entry
    for entry in "munged:$MUNGE_PID" "slurmctld:$CTLD_PID" "slurmd:$SLURMD_PID"; do
        if pid_alive "${entry#*:}" "${entry%%:*}"; then
            echo "${entry%%:*}: running (pid $(cat "${entry#*:}"))"
        else
            echo "${entry%%:*}: stopped"
            ok=1
        fi
    done
    if [ "$ok" -eq 0 ]; then
        sinfo -N -l || ok=1
    fi
    return "$ok"
}

case "$ACTION" in
    start) do_start ;;
    stop) do_stop ;;
    restart) do_stop; do_start ;;
    status) do_status ;;
    *) die "usage: $0 {start|stop|restart|status}" ;;
esac
