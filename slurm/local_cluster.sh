#!/usr/bin/env bash
# A real 2-node SLURM cluster on this one host, for CI and for trying slurm/llama.sbatch by hand.
# Nodes n1 and n2 are two slurmd daemons on 127.0.0.1 (own port, own spool dir), 1 CPU each.
# Needs root and Debian's packages. Idempotent: on a cluster that is already up it only checks.
#   bash slurm/local_cluster.sh          # then: sbatch -N 2 slurm/llama.sbatch ...
set -euo pipefail
host=$(hostname)
conf=/etc/slurm/slurm.conf
log() { echo "local_cluster: $*"; }
# Is daemon $2 running under the pid in file $1? (The name check: a stale file's pid may be reused.)
alive() { local pid; pid=$(cat "$1" 2>/dev/null) && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]; }

# 1. Packages (no recommends: the plugin -dev packages are not needed).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi
log "packages: $(slurmctld -V)"

# 2. slurm.conf. Both nodes are this host: same NodeHostname, own NodeAddr port, so slurmd is
# started with -N to say which node it is. CPUs=1: one launcher task per node is all a job runs.
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd/n1 /var/spool/slurmd/n2 /var/log/slurm
new=$(cat <<CONF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmdPidFile=/run/slurmd.%n.pid
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (defaults 30 and 60 s): a requeued job starts soon after its BeginTime.
SchedulerParameters=bf_interval=2,sched_interval=2
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobRequeue=1
ReturnToService=2
KillWait=30
MailProg=/bin/true
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=17001 CPUs=1 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=17002 CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
)
if [[ ! -f $conf || "$(cat "$conf")" != "$new" ]]; then
  # A changed conf on a running cluster: stop its daemons (by pid file) so they restart with it.
  for d in slurmctld:/run/slurmctld.pid slurmd:/run/slurmd.n1.pid slurmd:/run/slurmd.n2.pid; do
    name=${d%%:*} pidfile=${d#*:}
    if alive "$pidfile" "$name"; then kill "$(cat "$pidfile")"; while alive "$pidfile" "$name"; do sleep 0.2; done; fi
  done
  printf '%s\n' "$new" >"$conf"
  log "wrote $conf"
else
  log "$conf up to date"
fi

# 3. Hostnames n1, n2 (srun and the sbatch script address nodes by name).
if ! grep -qE '^127\.0\.0\.1\s.*\bn1\b.*\bn2\b' /etc/hosts; then
  echo "127.0.0.1 n1 n2" >>/etc/hosts
  log "added n1 n2 to /etc/hosts"
fi

# 4. munge: a key (the package usually makes one), then munged as the munge user.
if [[ ! -s /etc/munge/munge.key ]]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
  log "made a munge key"
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- munged
  log "started munged"
fi
munge -n | unmunge >/dev/null || { echo "local_cluster: munge does not work" >&2; exit 1; }

# 5. The controller and the two node daemons (each forks into the background, writes its pid file).
if ! alive /run/slurmctld.pid slurmctld; then slurmctld && log "started slurmctld"; fi
for n in n1 n2; do
  if ! alive /run/slurmd.$n.pid slurmd; then slurmd -N $n && log "started slurmd -N $n"; fi
done

# 6. Wait until both nodes are idle (they register within a few seconds).
for _ in $(seq 1 60); do
  idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
  [[ $idle -eq 2 ]] && break
  sleep 1
done
if [[ $idle -ne 2 ]]; then
  echo "local_cluster: after 60 s only $idle of 2 nodes are idle:" >&2
  sinfo -N -l >&2 || true
  tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.n1.log >&2 || true
  exit 1
fi
log "ready: $(sinfo -h -o '%D nodes %t in partition %P')"
