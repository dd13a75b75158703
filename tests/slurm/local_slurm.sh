#!/usr/bin/env bash
# local_slurm.sh - a throw-away Slurm cluster on this one host, for AstraFlow's Slurm test tier.
#
# Why: the Slurm backend is tested against a real slurmctld/slurmd, not a mock. This script gives
# CI and developers the same small cluster in ~5-10 s: several partitions on distinct *virtual*
# nodes (one slurmd per node, each on its own port, all on 127.0.0.1), fake GPUs as GRES.
#
#   tests/slurm/local_slurm.sh [start|stop|status]        (default: start; needs root)
#
# Environment (all optional):
#   LOCAL_SLURM_DIR=/tmp/astraflow-slurm       state, spool, logs, pid files
#   LOCAL_SLURM_PARTITIONS="h100:2 a100:1 cpu:1"  partition:node-count; the first one is the default
#   LOCAL_SLURM_CPUS=8                         CPUs advertised per virtual node (may exceed real cores)
#   LOCAL_SLURM_GPUS=4                         fake GRES gpu:<partition>:N on every non-"cpu" partition (0: none)
#   LOCAL_SLURM_NO_APT=0                       1: fail instead of calling apt-get
#   LOCAL_SLURM_CRED_EXPIRE=15                 job credential lifetime (s); a requeued job waits this long
#                                              before it starts again (Slurm's default, 120 s, would make
#                                              the requeue test sit idle; a job started sooner is refused)
#
# The scheduling loops run every second (Slurm's defaults, 60 s and 30 s, would leave a requeued job
# pending that long after its credential wait; a few nodes cost the controller nothing to scan).
#
# start is idempotent: with the same settings and the daemons alive it only waits for idle nodes.
# stop kills only the daemons whose pid files this script's config names (and munged if it started it).
set -euo pipefail

ACTION=${1:-start}
D=${LOCAL_SLURM_DIR:-/tmp/astraflow-slurm}
PARTS=${LOCAL_SLURM_PARTITIONS:-"h100:2 a100:1 cpu:1"}
CPUS=${LOCAL_SLURM_CPUS:-8}
GPUS=${LOCAL_SLURM_GPUS:-4}
CRED_EXPIRE=${LOCAL_SLURM_CRED_EXPIRE:-15}
HOST=$(hostname -s)
T0=$(date +%s%N)

say() { echo "[local_slurm $(( ($(date +%s%N) - T0) / 1000000 ))ms] $*"; }
die() { say "ERROR: $*" >&2; exit 1; }
# a pid file counts only if its process runs and is a slurm/munge daemon (pids are reused)
alive() { local p; [ -f "$1" ] && p=$(cat "$1" 2>/dev/null) && [ -n "$p" ] && kill -0 "$p" 2>/dev/null &&
          grep -qE '^(slurmctld|slurmd|munged)$' "/proc/$p/comm" 2>/dev/null &&
          [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ]; }  # a zombie has already exited
stop_pidfile() {  # SIGTERM, wait up to 5 s, then SIGKILL
  local f=$1 p
  alive "$f" || { rm -f "$f"; return 0; }
  p=$(cat "$f"); say "stopping $(basename "$f" .pid) (pid $p)"; kill "$p"
  for _ in $(seq 50); do alive "$f" || break; sleep 0.1; done
  if alive "$f"; then kill -9 "$p"; fi
  rm -f "$f"
}
nodes() {  # "node partition" lines: h100-1 h100, h100-2 h100, ...
  local pn p n i
  for pn in $PARTS; do p=${pn%%:*}; n=${pn##*:}; [ "$n" = "$p" ] && n=1
    for i in $(seq "$n"); do echo "$p-$i $p"; done; done
}
stop_slurm() { local f; for f in "$D"/run/slurmd-*.pid "$D"/run/slurmctld.pid; do [ -e "$f" ] && stop_pidfile "$f"; done; rm -f "$D/run/config.sha"; }

[ "$(id -u)" = 0 ] || die "must run as root (it starts slurmctld/slurmd as root)"
case "$ACTION" in
  stop)
    stop_slurm
    if [ -f "$D/run/munged.ours" ]; then stop_pidfile /run/munge/munged.pid; rm -f "$D/run/munged.ours"; fi
    exit 0 ;;
  status)
    for f in "$D"/run/*.pid; do [ -e "$f" ] || continue
      if alive "$f"; then echo "up   $(basename "$f" .pid) pid $(cat "$f")"; else echo "down $(basename "$f" .pid)"; fi; done
    sinfo -N -o '%N %P %T %c %G' 2>/dev/null || true
    exit 0 ;;
  start) ;;
  *) die "unknown action '$ACTION': use start, stop or status" ;;
esac

# 1. packages ------------------------------------------------------------------------------
missing=""
for p in slurm-wlm munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  [ "${LOCAL_SLURM_NO_APT:-0}" = 1 ] && die "missing packages:$missing (LOCAL_SLURM_NO_APT=1)"
  say "apt-get install$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# 2. munge ---------------------------------------------------------------------------------
mkdir -p "$D/run" /etc/munge /run/munge /var/lib/munge /var/log/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown munge:munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged
  touch "$D/run/munged.ours"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munged does not answer"
  say "munged started"
fi

# 3. slurm.conf (+ gres.conf) ----------------------------------------------------------------
node_lines=""; part_lines=""; gres_lines=""; port=17100; first=YES
for pn in $PARTS; do p=${pn%%:*}
  members=$(nodes | awk -v p="$p" '$2==p {print $1}' | paste -sd, -)
  part_lines+="PartitionName=$p Nodes=$members Default=$first MaxTime=INFINITE State=UP"$'\n'; first=NO
done
while read -r n p; do
  port=$((port + 1)); gres=""
  if [ "$GPUS" -gt 0 ] && [ "$p" != cpu ]; then
    # slurmd wants one device file per GPU; symlinks to /dev/null pass (regular files do not)
    mkdir -p "$D/dev"; for i in $(seq 0 $((GPUS - 1))); do ln -sfn /dev/null "$D/dev/$n-gpu$i"; done
    gres=" Gres=gpu:$p:$GPUS"
    gres_lines+="NodeName=$n Name=gpu Type=$p File=$D/dev/$n-gpu[0-$((GPUS - 1))]"$'\n'
  fi
  node_lines+="NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=8192$gres State=UNKNOWN"$'\n'
done < <(nodes)
gres_types=""; [ -n "$gres_lines" ] && gres_types="GresTypes=gpu"
conf="# written by AstraFlow tests/slurm/local_slurm.sh - do not edit
ClusterName=astraflow
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$D/log/jobcomp.txt
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
$gres_types
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
$node_lines$part_lines"
gres_conf=""; [ -n "$gres_lines" ] && gres_conf="AutoDetect=off
$gres_lines"
sha=$(printf '%s\n%s' "$conf" "$gres_conf" | sha256sum | cut -c1-16)

want=$(nodes | wc -l)
up=1; alive "$D/run/slurmctld.pid" || up=0
while read -r n _; do alive "$D/run/slurmd-$n.pid" || up=0; done < <(nodes)
if [ "$up" = 1 ] && [ "$(cat "$D/run/config.sha" 2>/dev/null)" = "$sha" ]; then
  say "already running with the same config"
else
  stop_slurm
  rm -rf "$D/state" "$D/spool" "$D/log"
  mkdir -p /etc/slurm "$D/state" "$D/log"
  printf '%s\n' "$conf" > /etc/slurm/slurm.conf
  if [ -n "$gres_conf" ]; then printf '%s\n' "$gres_conf" > /etc/slurm/gres.conf; else rm -f /etc/slurm/gres.conf; fi
  slurmctld
  while read -r n _; do mkdir -p "$D/spool/$n"; slurmd -N "$n"; done < <(nodes)
  echo "$sha" > "$D/run/config.sha"
  say "slurmctld + $want slurmd started"
fi

# 4. wait until every node is idle (deadline 30 s) ------------------------------------------
for _ in $(seq 300); do
  ready=$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 ~ /^(idle|mixed|allocated)$/ {print $1}' | sort -u | wc -l)
  [ "$ready" -ge "$want" ] && break
  sleep 0.1
done
[ "$ready" -ge "$want" ] || { sinfo -N -l >&2; die "only $ready of $want nodes idle after 30 s; logs in $D/log"; }
say "ready: $want nodes in partitions: $(for pn in $PARTS; do printf '%s ' "${pn%%:*}"; done)"
