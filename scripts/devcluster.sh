#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this one host, for development and tests (Debian 12, no systemd).
#
#   scripts/devcluster.sh up|down|status|env
#
# "up" installs what is missing (munge, slurmctld, slurmd, slurmdbd, MariaDB, Open MPI), writes the
# configuration, starts munged, a private MariaDB, slurmdbd (real accounting: sacct and submitit's job
# states work), slurmctld and one slurmd per node, then proves readiness with a real srun on every node.
# It is idempotent: daemons that are already running are left alone.
#
# Nodes (all on this host, each its own slurmd):  n1 n2 -> features train,h100   (partition train)
#                                                 n3 n4 -> features rollout,l40s (partition rollout)
# Partition "urgent" spans every node with a higher PriorityTier and preempts the others by requeue.
#
# Environment: SFHPC_DEVCLUSTER_DIR (default /var/tmp/sfhpc-devcluster; MariaDB runs as user mysql, so
# the folder must not sit under a mode-700 directory such as /root), CPUS_PER_NODE (default 4: more than
# the real cores is fine, SlurmdParameters=config_overrides), SFHPC_DEVCLUSTER_DBPORT (13306),
# SFHPC_DEVCLUSTER_DBDPORT (6819). Clients need SLURM_CONF: `eval "$(scripts/devcluster.sh env)"`.
set -euo pipefail
D=${SFHPC_DEVCLUSTER_DIR:-/var/tmp/sfhpc-devcluster}
NODES=(n1 n2 n3 n4)
CPUS_PER_NODE=${CPUS_PER_NODE:-4}
MEM_PER_NODE_MB=4000
DBPORT=${SFHPC_DEVCLUSTER_DBPORT:-13306}
DBDPORT=${SFHPC_DEVCLUSTER_DBDPORT:-6819}
DB=$D/db
export SLURM_CONF=$D/etc/slurm.conf
HOST=$(hostname -s)

log() { echo "devcluster: $*" >&2; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  local wanted=(slurmctld slurmd slurmdbd slurm-client munge mariadb-server openmpi-bin libopenmpi-dev)
  local missing=()
  for p in "${wanted[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  # Keep the packages' postinst scripts from starting daemons through init.d: we start them ourselves.
  local added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; added_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ $added_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

node_line() {  # name port features
  echo "NodeName=$1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$2 CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE_MB Features=$3"
}

write_config() {
  mkdir -p "$D"/{etc,state,log,run}
  for n in "${NODES[@]}"; do mkdir -p "$D/spool/$n" "$D/tmp/$n"; done
  cat > "$SLURM_CONF.new" <<CONF
# Written by sfhpc scripts/devcluster.sh: a single-host cluster for development and tests.
ClusterName=sfhpcdev
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Short credential lifetime: a requeued job may start again cred_expire + 1 s after its requeue (Slurm's
# default, 120, would keep it waiting two minutes; 5 is the least Slurm accepts).
AuthInfo=cred_expire=5
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Heterogeneous jobs are started by the backfill scheduler only: run it every second.
SchedulerParameters=bf_interval=1
MpiDefault=none
ReturnToService=2
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBDPORT
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
MailProg=/bin/true
# One TmpFS per node: mpi/pmix keeps per-step folders there, and a shared /tmp collides between slurmds.
TmpFS=$D/tmp/%n
# slurmctld pings the nodes every SlurmdTimeout/3 s, and a requeued job waits for the first scheduling pass
# after its begin time: the backfill scheduler passes only when a job, node or partition changed, and a
# node's answer to a ping is such a change. 15 (pings every 5 s) starts a requeued job within ~10 s of its
# requeue instead of ~20 s at 30, and still leaves a loaded host's slurmd time to answer.
SlurmdTimeout=15
InactiveLimit=0
KillWait=10
MinJobAge=300
$(node_line n1 17001 train,h100)
$(node_line n2 17002 train,h100)
$(node_line n3 17003 rollout,l40s)
$(node_line n4 17004 rollout,l40s)
PartitionName=train   Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=5
PartitionName=rollout Nodes=n[3-4] MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=5
PartitionName=urgent  Nodes=n[1-4] MaxTime=INFINITE State=UP PriorityTier=10
CONF
  mv "$SLURM_CONF.new" "$SLURM_CONF"
  # slurmdbd has no -f: it reads slurmdbd.conf next to \$SLURM_CONF, which must be mode 600.
  ( umask 077; cat > "$D/etc/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBDPORT
SlurmUser=root
PidFile=$D/run/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=sfhpcdev
StorageLoc=slurm_acct_db
CONF
  )
  chmod 600 "$D/etc/slurmdbd.conf"
}

start_munge() {
  alive /run/munge/munged.pid && return 0
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge; chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --force 2>/dev/null || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "munged did not start (see /var/log/munge/munged.log)"; return 1
}

start_database() {  # a private MariaDB on 127.0.0.1:$DBPORT, with its own data folder and no /etc/mysql
  alive "$DB/mysqld.pid" && return 0
  local sql=(mariadb --no-defaults -S "$DB/mysqld.sock" -uroot)
  mkdir -p "$DB"; chown mysql:mysql "$DB"
  if [ ! -d "$DB/data/mysql" ]; then
    mariadb-install-db --no-defaults --user=mysql --datadir="$DB/data" --skip-test-db >"$DB/install-db.log" 2>&1
  fi
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB/data" --socket="$DB/mysqld.sock" \
      --pid-file="$DB/mysqld.pid" --log-error="$DB/mysqld.err" --bind-address=127.0.0.1 --port="$DBPORT" \
      --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
  for _ in $(seq 150); do "${sql[@]}" -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
  "${sql[@]}" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'sfhpcdev';
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'sfhpcdev';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" \
    || { log "MariaDB did not start (see $DB/mysqld.err)"; return 1; }
}

start_slurmdbd() {
  alive "$D/run/slurmdbd.pid" || /usr/sbin/slurmdbd
  for _ in $(seq 150); do sacctmgr -n -P list cluster >/dev/null 2>&1 && return 0; sleep 0.2; done
  log "slurmdbd did not start (see $D/log/slurmdbd.log)"; return 1
}

start_slurm() {
  alive "$D/run/slurmctld.pid" || /usr/sbin/slurmctld -f "$SLURM_CONF"
  for n in "${NODES[@]}"; do alive "$D/run/slurmd-$n.pid" || /usr/sbin/slurmd -f "$SLURM_CONF" -N "$n"; done
  # sinfo alone can report "idle" restored from saved state before a slurmd registered: the proof is a
  # real job step on every node.
  for _ in $(seq 120); do
    [ "$(sinfo -h -N -o %t 2>/dev/null | sort -u)" = "idle" ] && break; sleep 0.5
  done
  if timeout 90 srun -p urgent -N "${#NODES[@]}" -t 1 true; then return 0; fi
  log "cluster not ready: a step on all ${#NODES[@]} nodes failed (logs in $D/log)"; sinfo -N -l >&2 || true
  return 1
}

stop_all() {
  for f in "$D"/run/slurmd-*.pid "$D/run/slurmctld.pid" "$D/run/slurmdbd.pid" "$DB/mysqld.pid" /run/munge/munged.pid; do
    if alive "$f"; then
      local pid; pid=$(cat "$f"); kill "$pid" 2>/dev/null || true
      for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
  done
}

case "${1:-up}" in
  up)
    t0=$(date +%s); install_packages; t1=$(date +%s)
    write_config; start_munge; start_database; start_slurmdbd; start_slurm
    log "ready: ${#NODES[@]} nodes (install $((t1 - t0)) s, start $(( $(date +%s) - t1 )) s)"
    echo "export SLURM_CONF=$SLURM_CONF" ;;
  down) stop_all; log "stopped" ;;
  status) sinfo -N -o "%N %P %t %f %c %m" ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
