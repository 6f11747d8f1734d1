#!/bin/sh
# TrainMover node health check, for slurm.conf's HealthCheckProgram or for LBNL NHC.
#
#   HealthCheckProgram=/opt/trainmover/slurm_plugin/healthcheck.sh
#   HealthCheckInterval=60
#   HealthCheckNodeState=ANY,CYCLE
#
# slurmd runs it as root with SLURMD_NODENAME and nothing else: no PATH, no SLURM_CONF.
# Site settings come from /etc/trainmover/healthcheck.env, then healthcheck.env next to
# this script (both optional, shell syntax):
#   SLURM_CONF=/etc/slurm/slurm.conf            the cluster to drain the node in
#   TRAINMOVER_PYTHON=/opt/trainmover/.venv/bin/python
#   TRAINMOVER_HEALTHCHECK_ARGS="--state-dir /var/lib/trainmover/healthcheck --min-free-gb 5"
# Arguments given to the script are passed on (NHC: add --no-drain, NHC drains itself).
# Exit 0: healthy; 1: fault (node drained with a reason starting "trainmover:").
# Never runs longer than 10 s (timeout 9 s, then SIGKILL 1 s later).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
for f in /etc/trainmover/healthcheck.env "$here/healthcheck.env"; do
    # shellcheck disable=SC1090
    [ -r "$f" ] && . "$f"
done
SLURM_CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
export SLURM_CONF
python=${TRAINMOVER_PYTHON:-$here/../.venv/bin/python}
node=${SLURMD_NODENAME:-$(hostname -s)}
# shellcheck disable=SC2086
exec timeout -k 1 9 "$python" -m trainmover.cli healthcheck --node "$node" ${TRAINMOVER_HEALTHCHECK_ARGS:-} "$@"
