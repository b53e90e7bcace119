#!/usr/bin/env bash
# A real four-node Slurm cluster on this one machine, for gems' tests and CI.
#
# Why: gems submits multi-node jobs through submitit/sbatch; testing that path needs
# a real controller and real slurmd daemons, not mocks. Debian's Slurm is built with
# MULTIPLE_SLURMD, so four `slurmd -N nodeK` daemons on one host act as four nodes
# (see shared/TESTBED.md). No systemd: the daemons are started by hand, as root.
#
# Usage: scripts/slurm_cluster.sh {start|stop|status|restart}
#   start    install slurm-wlm + munge if missing, write the config, start munged,
#            slurmctld and slurmd x4, wait until the nodes are idle. Idempotent:
#            on a running, healthy cluster it changes nothing.
#   stop     stop the daemons this script started (by their pid files).
#   status   print sinfo/squeue; exit 0 only when all four nodes answer.
#
# Environment: GEMS_SLURM_DIR (default /var/tmp/gems-slurm) holds state, spool,
# pid and log files; GEMS_SLURM_WAIT_S (default 60) bounds the wait for idle nodes.
set -euo pipefail

SLURM_DIR=${GEMS_SLURM_DIR:-/var/tmp/gems-slurm}
WAIT_S=${GEMS_SLURM_WAIT_S:-60}
CONF=/etc/slurm/slurm.conf
NODES=(node1 node2 node3 node4)
FIRST_PORT=17001
CTLD_PORT=6817

log() { printf 'slurm_cluster: %s\n' "$*"; }
die() { printf 'slurm_cluster: error: %s\n' "$*" >&2; exit 1; }

need_root() {
    [[ $(id -u) -eq 0 ]] || die "run as root (it installs packages, edits /etc/hosts and starts daemons)"
}

# --- packages ---------------------------------------------------------------------
install_packages() {
    local missing=()
    command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
    command -v slurmd >/dev/null 2>&1 || missing+=(slurm-wlm)
    command -v sbatch >/dev/null 2>&1 || missing+=(slurm-wlm)
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null 2>&1 || die "slurm-wlm/munge missing and no apt-get: install them by hand"
    log "installing slurm-wlm munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # the daemons' postinst scripts try to start services; there is no init here
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; created_policy=1
    fi
    if ! apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; then
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
            || { [[ $created_policy -eq 1 ]] && rm -f "$policy"; die "apt-get install slurm-wlm munge failed"; }
    fi
    [[ $created_policy -eq 1 ]] && rm -f "$policy"
    command -v slurmctld >/dev/null && command -v munged >/dev/null || die "slurm-wlm/munge still missing after apt-get"
}

# --- name resolution -----------------------------------------------------------------
ensure_hosts() {
    local host; host=$(hostname)
    # the node names (torch rendezvous at MASTER_ADDR=node1 needs them) and this host
    if ! grep -Eq '^127\.0\.0\.1[[:space:]]+node1[[:space:]]+node2[[:space:]]+node3[[:space:]]+node4([[:space:]]|$)' /etc/hosts; then
        log "adding node1..node4 to /etc/hosts"
        # /etc/hosts may be a bind mount: rewrite in place rather than replace the file
        printf '127.0.0.1 %s\n' "${NODES[*]}" >>/etc/hosts
    fi
    if ! getent hosts "$host" >/dev/null 2>&1; then
        log "adding $host to /etc/hosts"
        printf '127.0.0.1 %s\n' "$host" >>/etc/hosts
    fi
}

# --- munge ---------------------------------------------------------------------------
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then return 0; fi
    log "starting munged"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge /etc/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    # a stale pid/socket from a killed munged blocks a new one
    if [[ -f /run/munge/munged.pid ]] && ! kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
        rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    fi
    if command -v runuser >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged
    else
        su -s /bin/sh munge -c /usr/sbin/munged
    fi
    local i
    for ((i = 0; i < 50; i++)); do munge_ok && return 0; sleep 0.2; done
    die "munged did not come up (see /var/log/munge/munged.log)"
}

# --- slurm.conf ----------------------------------------------------------------------
write_conf() {
    local host last_port tmp
    host=$(hostname)
    last_port=$((FIRST_PORT + ${#NODES[@]} - 1))
    tmp=$(mktemp)
    cat >"$tmp" <<EOF
# Written by gems scripts/slurm_cluster.sh: a ${#NODES[@]}-node test cluster on one host.
ClusterName=gems
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=${SLURM_DIR}/state
SlurmctldPidFile=${SLURM_DIR}/run/slurmctld.pid
SlurmctldLogFile=${SLURM_DIR}/log/slurmctld.log
SlurmdSpoolDir=${SLURM_DIR}/spool/%n
SlurmdPidFile=${SLURM_DIR}/run/slurmd-%n.pid
SlurmdLogFile=${SLURM_DIR}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# finished jobs stay visible to squeue/scontrol this long (no accounting here)
MinJobAge=900
KillWait=5
InactiveLimit=0
Waittime=0
NodeName=node[1-${#NODES[@]}] NodeHostname=${host} NodeAddr=127.0.0.1 Port=${FIRST_PORT}-${last_port} CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=node[1-${#NODES[@]}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    mkdir -p /etc/slurm
    if [[ -f $CONF ]] && cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"; return 1  # unchanged
    fi
    log "writing $CONF"
    install -m 0644 "$tmp" "$CONF"
    rm -f "$tmp"
    return 0
}

# --- daemons -------------------------------------------------------------------------
# a pid file names a live daemon: the process exists, is not a zombie, and is that program
pid_alive() {
    local f=$1 pid state comm
    [[ -f $f ]] || return 1
    pid=$(cat "$f" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z && $state != X ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == slurm* ]]
}
ctld_pidfile() { echo "$SLURM_DIR/run/slurmctld.pid"; }
slurmd_pidfile() { echo "$SLURM_DIR/run/slurmd-$1.pid"; }

ctld_answers() { timeout 15 scontrol ping 2>/dev/null | grep -q 'is UP'; }

nodes_ready() {
    # every node answers and none is down/drained (idle, mixed, allocated are fine)
    local out
    out=$(timeout 15 sinfo -h -N -p debug -o '%N %t' 2>/dev/null) || return 1
    local n
    for n in "${NODES[@]}"; do
        grep -Eq "^$n (idle|mix|alloc|comp)\$" <<<"$out" || return 1
    done
}

start_daemons() {
    mkdir -p "$SLURM_DIR"/{state,run,log,spool}
    local n
    for n in "${NODES[@]}"; do mkdir -p "$SLURM_DIR/spool/$n"; done
    if ! pid_alive "$(ctld_pidfile)"; then
        log "starting slurmctld"
        /usr/sbin/slurmctld
    fi
    local i
    for ((i = 0; i < 75; i++)); do ctld_answers && break; sleep 0.2; done
    ctld_answers || die "slurmctld does not answer (see $SLURM_DIR/log/slurmctld.log)"
    for n in "${NODES[@]}"; do
        if ! pid_alive "$(slurmd_pidfile "$n")"; then
            log "starting slurmd -N $n"
            /usr/sbin/slurmd -N "$n"
        fi
    done
}

wait_idle() {
    local deadline=$((SECONDS + WAIT_S)) resumed=0
    while ((SECONDS < deadline)); do
        nodes_ready && return 0
        # nodes left DOWN by an earlier unclean stop come back with a resume
        if ((resumed == 0)) && sinfo -h -N -o '%N %t' 2>/dev/null | grep -Eq ' (down|drain|drng|fail)'; then
            scontrol update NodeName="node[1-${#NODES[@]}]" State=RESUME 2>/dev/null || true
            resumed=1
        fi
        sleep 0.5
    done
    sinfo -N -l >&2 || true
    die "nodes not idle after ${WAIT_S}s (logs: $SLURM_DIR/log/; more time: GEMS_SLURM_WAIT_S)"
}

stop_pidfile() {
    local f=$1 name=$2 pid i
    pid_alive "$f" || { rm -f "$f"; return 0; }
    pid=$(cat "$f")
    log "stopping $name (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do pid_alive "$f" || break; sleep 0.2; done
    pid_alive "$f" && kill -9 "$pid" 2>/dev/null || true
    rm -f "$f"
}

cmd_start() {
    need_root
    install_packages
    ensure_hosts
    start_munge
    local changed=0
    write_conf && changed=1
    if ((changed)) && pid_alive "$(ctld_pidfile)"; then
        log "configuration changed: restarting the daemons"
        cmd_stop_daemons
    fi
    start_daemons
    wait_idle
    # the nodes really run tasks (sinfo may show a restored state before every slurmd answers)
    timeout "$WAIT_S" srun --nodes=${#NODES[@]} --ntasks=${#NODES[@]} --job-name=gems-smoke true \
        || die "a ${#NODES[@]}-node srun did not run within ${WAIT_S}s (logs: $SLURM_DIR/log/)"
    log "up: $(sinfo -h -o '%P %D nodes %t' | tr '\n' ' ')"
}

cmd_stop_daemons() {
    local n
    for n in "${NODES[@]}"; do stop_pidfile "$(slurmd_pidfile "$n")" "slurmd $n"; done
    stop_pidfile "$(ctld_pidfile)" slurmctld
}

cmd_stop() {
    need_root
    cmd_stop_daemons
    # munged is left running: other software on the host may use it
}

cmd_status() {
    local ok=0
    ctld_answers || { echo "slurmctld: not answering"; ok=1; }
    local n
    for n in "${NODES[@]}"; do
        pid_alive "$(slurmd_pidfile "$n")" || { echo "slurmd $n: not running"; ok=1; }
    done
    if ((ok == 0)); then
        sinfo -N -o '%N %P %t %C' || true
        squeue || true
        nodes_ready || { echo "nodes: not all idle"; ok=1; }
    fi
    return $ok
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    restart) cmd_stop; cmd_start ;;
    status) cmd_status ;;
    *) echo "usage: $0 {start|stop|status|restart}" >&2; exit 2 ;;
esac
