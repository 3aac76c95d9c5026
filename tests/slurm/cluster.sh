#!/usr/bin/env bash
# A SLURM test cluster of N nodes on one host (Debian slurm-wlm + munge), for the SLURM tests.
#
#   tests/slurm/cluster.sh start    install if missing, (re)configure, start, wait for every node
#   tests/slurm/cluster.sh stop     cancel jobs, stop the daemons, remove the nodes' namespaces
#   tests/slurm/cluster.sh status   show daemons / sinfo, exit 0 when every node is usable
#
# Must run as root.  Idempotent: "start" on a running, correctly configured
# cluster only waits for the nodes; a changed config restarts the daemons.
#
# Each node is a Linux network namespace (`ip netns`) with an address of its own
# on a bridge, and a UTS namespace with a hostname of its own; one slurmd runs in
# each (NodeName/NodeAddr per node, spool, pid and log files per node with %n).
# slurmctld and munged are shared and run in the host's namespaces; slurmctld is
# reached on the bridge's address.  Every job task starts in its node's
# namespaces (slurmd's children), so what crosses nodes (srun's I/O, torchrun's
# rendezvous, gloo) crosses a real TCP boundary between distinct addresses.  The
# nodes have no route beyond the bridge's subnet: nothing else is contacted.
# tests/slurm/README.md draws the wiring.
#
# The generated /etc/slurm/slurm.conf carries a marker line; a slurm.conf
# without it (a real site config) is never overwritten unless
# SLURM_TEST_FORCE=1.
#
# By default no GRES is configured: a job asking for --gpus/--gres=gpu is
# rejected at submission by sbatch with
#   "sbatch: error: Invalid generic resource (gres) specification".
# SLURM_TEST_FAKE_GPUS=N (N>0) instead declares N fake GPUs per node (character
# devices aliasing /dev/null under /run/slurm-test): jobs asking --gpus=K are then
# accepted and get CUDA_VISIBLE_DEVICES=0..K-1, but there is no real GPU
# behind them (torch.cuda.is_available() stays False on a CPU machine).
#
# Environment knobs (all optional):
#   SLURM_TEST_NODES           nodes (2; at most 9)
#   SLURM_TEST_SUBNET          the bridge's /24, as its first three octets (10.77.77): the
#                              controller is .1, node i is .(10+i)
#   SLURM_TEST_START_TIMEOUT   seconds to wait for the nodes to become idle (90)
#   SLURM_TEST_MIN_JOB_AGE     MinJobAge in seconds (300; squeue status needs >= 120)
#   SLURM_TEST_FAKE_GPUS       number of fake GPUs per node (0 = none, the default)
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
MUNGE_PID=/run/munge/munged.pid
START_TIMEOUT="${SLURM_TEST_START_TIMEOUT:-90}"
MIN_JOB_AGE="${SLURM_TEST_MIN_JOB_AGE:-300}"
FAKE_GPUS="${SLURM_TEST_FAKE_GPUS:-0}"
NODES="${SLURM_TEST_NODES:-2}"
SUBNET="${SLURM_TEST_SUBNET:-10.77.77}"
SECOND_PARTITION=gpu  # besides the default "debug" (tests/slurm/conftest.py names both)
# Network: a bridge in the host's namespace (the controller's address), one veth pair per node,
# its inner end named eth0 in the node's namespace. Names start with "sft" so they are ours.
BRIDGE=sftbr0
NODE_PREFIX=sft-n       # node i: NodeName, hostname and netns sft-n<i>
NODE_IFACE=eth0         # the node's interface (inside its namespace)
CTL_ADDR="$SUBNET.1"
# Every node this script may have made (a smaller SLURM_TEST_NODES still tears down all of them).
ALL_NODES=9

log() { echo "[cluster.sh] $*" >&2; }
die() { echo "[cluster.sh] ERROR: $*" >&2; exit 1; }

need_root() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (uid 0)"
}

# ---------------------------------------------------------------- install
install_packages() {
    local missing=() packages=()
    command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
    command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
    command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    [ "${#missing[@]}" -eq 0 ] || packages+=(slurm-wlm munge)
    # The nodes' namespaces: ip (iproute2), nsenter and unshare (util-linux).
    command -v ip >/dev/null 2>&1 || { missing+=(ip); packages+=(iproute2); }
    command -v nsenter >/dev/null 2>&1 || { missing+=(nsenter); packages+=(util-linux); }
    [ "${#missing[@]}" -eq 0 ] && return 0
    command -v apt-get >/dev/null 2>&1 || die "apt-get not available; install ${packages[*]} yourself"
    log "installing ${packages[*]} (missing: ${missing[*]})"
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
            apt-get install -y -q --no-install-recommends "${packages[@]}"
    } >"$apt_log" 2>&1 || rc=$?
    if [ "$created_policy" -eq 1 ]; then
        rm -f /usr/sbin/policy-rc.d
    fi
    if [ "$rc" -ne 0 ]; then
        tail -n 30 "$apt_log" >&2 || true
        die "apt-get install ${packages[*]} failed (rc=$rc, full log: $apt_log)"
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
node_name() { echo "$NODE_PREFIX$1"; }
node_addr() { echo "$SUBNET.$((10 + $1))"; }
slurmd_pid() { echo "$RUN_DIR/slurmd-$(node_name "$1").pid"; }
node_list() { if [ "$NODES" -eq 1 ]; then node_name 1; else echo "$NODE_PREFIX[1-$NODES]"; fi; }

check_knobs() {
    [[ "$NODES" =~ ^[1-9]$ ]] || die "SLURM_TEST_NODES must be 1..$ALL_NODES, got '$NODES'"
    [[ "$SUBNET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
        die "SLURM_TEST_SUBNET must be three octets (say 10.77.77), got '$SUBNET'"
    [[ "$FAKE_GPUS" =~ ^[0-9]+$ ]] || die "SLURM_TEST_FAKE_GPUS must be a number, got '$FAKE_GPUS'"
}

# ---------------------------------------------------------------- network
# The subnet must be ours alone: a route to it through another device would mean the
# machine uses those addresses already.
check_subnet_free() {
    local routes
    routes="$(ip -4 route show to match "$CTL_ADDR" 2>/dev/null | grep -v "dev $BRIDGE" | grep -v '^default' || true)"
    [ -z "$routes" ] || die "$SUBNET.0/24 is in use here ($routes); pick another SLURM_TEST_SUBNET"
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

write_hosts() {  # /etc/netns/<ns>/hosts: the node's /etc/hosts (in_node; `ip netns exec` reads it too)
    local ns="$1" i tmp
    tmp="$(mktemp)"
    {
        echo "$MARKER"
        echo "127.0.0.1 localhost"
        echo "$CTL_ADDR $(short_host)"
        for i in $(seq 1 "$NODES"); do echo "$(node_addr "$i") $(node_name "$i")"; done
    } >"$tmp"
    mkdir -p "/etc/netns/$ns"
    install -m 0644 "$tmp" "/etc/netns/$ns/hosts"
    rm -f "$tmp"
}

net_up() {
    check_subnet_free
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        log "creating bridge $BRIDGE ($CTL_ADDR/24)"
        ip link add "$BRIDGE" type bridge
    fi
    ip addr replace "$CTL_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    # Where bridged frames pass iptables (br_netfilter) and FORWARD drops by default (a Docker
    # host), let the nodes' traffic through; "stop" removes the rule.
    if command -v iptables >/dev/null 2>&1; then
        iptables -C FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT 2>/dev/null ||
            iptables -I FORWARD 1 -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT 2>/dev/null || true
    fi
    local i ns veth
    for i in $(seq 1 "$NODES"); do
        ns="$(node_name "$i")"
        veth="sftv$i"
        ns_exists "$ns" || ip netns add "$ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            log "node $ns: $(node_addr "$i") on $BRIDGE"
            ip link add "$veth" type veth peer name "sftp$i"
            ip link set "sftp$i" netns "$ns"
            ip -n "$ns" link set "sftp$i" name "$NODE_IFACE"
        fi
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" addr replace "$(node_addr "$i")/24" dev "$NODE_IFACE"
        ip -n "$ns" link set "$NODE_IFACE" up
        ip -n "$ns" link set lo up
        write_hosts "$ns"
    done
}

net_down() {
    local i ns pid
    for i in $(seq 1 "$ALL_NODES"); do
        ns="$(node_name "$i")"
        if ns_exists "$ns"; then
            # What still runs in the node (a job's leftovers) ends with it.
            for pid in $(ip netns pids "$ns" 2>/dev/null); do
                kill -KILL "$pid" 2>/dev/null || true
            done
            ip netns del "$ns" 2>/dev/null || true
        fi
        ip link del "sftv$i" 2>/dev/null || true
        if [ -f "/etc/netns/$ns/hosts" ] && grep -qF "$MARKER" "/etc/netns/$ns/hosts"; then
            rm -rf "/etc/netns/$ns"
        fi
    done
    if command -v iptables >/dev/null 2>&1; then
        iptables -D FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT 2>/dev/null || true
    fi
    ip link del "$BRIDGE" 2>/dev/null || true
    rmdir /etc/netns 2>/dev/null || true  # when nothing else is left there
}

in_node() {  # in_node I CMD...: run CMD as node I: its network namespace, its hostname, its /etc/hosts
    # Not `ip netns exec`, which mounts a sysfs of the namespace's own on /sys and so hides
    # /sys/fs/cgroup, without which slurmd does not start; the hosts file is bound the same way
    # in a mount namespace of the node's own.
    local name
    name="$(node_name "$1")"
    shift
    nsenter --net="/run/netns/$name" unshare --mount --uts --propagation private \
        sh -c 'mount --bind "/etc/netns/$0/hosts" /etc/hosts && hostname "$0" && exec "$@"' "$name" "$@"
}

# ---------------------------------------------------------------- config
write_config() {  # prints "changed" on stdout when slurm.conf was (re)written
    local host cpus mem sockets cores threads tmp
    host="$(short_host)"
    [ -n "$host" ] || die "hostname -s is empty"
    mkdir -p "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/d" "$LOG_DIR" "$RUN_DIR"

    if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF" && [ "${SLURM_TEST_FORCE:-0}" != 1 ]; then
        die "$CONF exists and was not written by this script; refusing to overwrite (SLURM_TEST_FORCE=1 to override)"
    fi

    # Hardware as slurmd sees it (falls back to nproc / /proc/meminfo). Every node is this
    # host and declares all of it: the nodes share what they declare.
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

    local gres_types="" node_gres="" changed=0 nodes
    nodes="$(node_list)"
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
            "$MARKER" "$nodes" "$RUN_DIR" $((FAKE_GPUS - 1)) >"$tmp"
        if ! cmp -s "$tmp" "$GRES_CONF"; then
            install -m 0644 "$tmp" "$GRES_CONF"
            changed=1
        fi
        rm -f "$tmp"
    elif [ -e "$GRES_CONF" ] && grep -qF "$MARKER" "$GRES_CONF"; then
        rm -f "$GRES_CONF"
        changed=1
    fi

    local node_lines="" i
    for i in $(seq 1 "$NODES"); do
        node_lines+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") CPUs=$cpus$topo RealMemory=$mem$node_gres State=UNKNOWN"$'\n'
    done

    tmp="$(mktemp)"
    cat >"$tmp" <<EOF
$MARKER
# Test cluster of $NODES node(s) on one host.  Regenerated by "cluster.sh start"; edits are lost.
ClusterName=testcluster
SlurmctldHost=$host($CTL_ADDR)
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
SlurmdSpoolDir=$STATE_DIR/d/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
${node_lines}PartitionName=debug Nodes=$nodes Default=YES MaxTime=INFINITE State=UP
# A second partition on the same nodes: a profile that names it shows where a job was sent.
PartitionName=$SECOND_PARTITION Nodes=$nodes Default=NO MaxTime=INFINITE State=UP
EOF
    if [ -e "$CONF" ] && cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
    else
        install -m 0644 "$tmp" "$CONF"
        rm -f "$tmp"
        log "wrote $CONF ($nodes on $SUBNET.0/24: CPUs=$cpus RealMemory=$mem fake GPUs=$FAKE_GPUS each)"
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
stop_slurmds() {
    local i
    for i in $(seq 1 "$ALL_NODES"); do
        stop_pidfile "$(slurmd_pid "$i")" slurmd
    done
    stop_pidfile "$RUN_DIR/slurmd.pid" slurmd  # the single-node cluster of earlier versions
}

start_slurm() {
    local restart="$1"
    if [ "$restart" = 1 ]; then
        stop_slurmds
        stop_pidfile "$CTLD_PID" slurmctld
        # Other nodes than before: forget the old nodes and their jobs rather than recover them.
        rm -rf "${STATE_DIR:?}/ctld" && mkdir -p "$STATE_DIR/ctld"
    fi
    if ! pid_alive "$CTLD_PID" slurmctld; then
        log "starting slurmctld"
        slurmctld
    fi
    local _ i
    for _ in $(seq 1 100); do
        scontrol ping 2>/dev/null | grep -q UP && break
        sleep 0.2
    done
    scontrol ping 2>/dev/null | grep -q UP || die "slurmctld not responding (see $LOG_DIR/slurmctld.log)"
    for i in $(seq 1 "$NODES"); do
        if ! pid_alive "$(slurmd_pid "$i")" slurmd; then
            log "starting slurmd of $(node_name "$i") in its namespace"
            mkdir -p "$STATE_DIR/d/$(node_name "$i")"
            in_node "$i" slurmd -N "$(node_name "$i")"
        fi
    done
}

node_state() { sinfo -h -N -n "$1" -o '%T' 2>/dev/null | head -1; }

wait_idle() {  # wait_idle I
    local node state deadline resumed=0
    node="$(node_name "$1")"
    deadline=$(( $(date +%s) + START_TIMEOUT ))
    while :; do
        state="$(node_state "$node" || true)"
        case "$state" in
            idle | mixed | allocated | completing) log "node $node is $state"; return 0 ;;
            *drain* | down* | *fail* | invalid* | unknown*)
                # Leftover DOWN/DRAIN state from an earlier run: put it back.
                if [ "$resumed" -lt 3 ] && pid_alive "$(slurmd_pid "$1")" slurmd; then
                    scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 ||
                        scontrol update NodeName="$node" State=IDLE >/dev/null 2>&1 || true
                    resumed=$((resumed + 1))
                fi
                ;;
        esac
        if [ "$(date +%s)" -ge "$deadline" ]; then
            sinfo -N -l >&2 || true
            tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd-$node.log" >&2 || true
            die "node $node not idle after ${START_TIMEOUT}s (state '${state}')"
        fi
        sleep 0.5
    done
}

check_links() {  # every node reaches every other node's slurmd across the bridge
    local i j
    for i in $(seq 1 "$NODES"); do
        for j in $(seq 1 "$NODES"); do
            [ "$i" = "$j" ] && continue
            ip netns exec "$(node_name "$i")" timeout 5 bash -c "exec 3<>/dev/tcp/$(node_addr "$j")/6818" 2>/dev/null ||
                die "node $(node_name "$i") cannot reach $(node_name "$j") at $(node_addr "$j"):6818 across $BRIDGE (a firewall on bridged traffic?)"
        done
    done
}

do_start() {
    need_root
    check_knobs
    install_packages
    local changed i
    changed="$(write_config)"
    net_up
    start_munge
    start_slurm "$([ "$changed" = changed ] && echo 1 || echo 0)"
    for i in $(seq 1 "$NODES"); do
        wait_idle "$i"
    done
    check_links
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
    stop_slurmds
    stop_pidfile "$CTLD_PID" slurmctld
    stop_pidfile "$MUNGE_PID" munged
    net_down
    log "stopped"
}

do_status() {
    local ok=0 entry i
    local entries=("munged:$MUNGE_PID" "slurmctld:$CTLD_PID")
    for i in $(seq 1 "$NODES"); do entries+=("slurmd:$(slurmd_pid "$i")"); done
    for entry in "${entries[@]}"; do
        if pid_alive "${entry#*:}" "${entry%%:*}"; then
            echo "${entry%%:*} ${entry#*:}: running (pid $(cat "${entry#*:}"))"
        else
            echo "${entry%%:*} ${entry#*:}: stopped"
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
