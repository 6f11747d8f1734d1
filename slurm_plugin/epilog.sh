#!/bin/sh
# TrainMover's node Epilog: a node the ending job held after fencing it goes back drained.
#
#   Epilog=/opt/trainmover/slurm_plugin/epilog.sh      (slurm.conf, every node; Epilog takes no arguments)
#
# slurmd runs it as root on each of the job's nodes when the job ends, with SLURMD_NODENAME,
# SLURM_JOB_ID, SLURM_JOB_UID and SLURM_JOB_WORK_DIR. A TrainMover job that holds a node marks it
# (runs/<job>/held-<node>.json below its working directory, beside its status.json); without that
# mark the script ends at once, so every other job's end costs nothing (no Python: on a loaded node
# a check at every job's end kept nodes COMPLETING for seconds). With it, it runs healthcheck.sh (beside it, with
# its healthcheck.env) with --fence-record, which reads the record as the job's user's plain
# files only (trainmover/healthcheck/fence_record.py) and drains the node with a reason
# "trainmover: healthcheck fenced: job J (uid U) held this node ..." when the job held it.
#
# Exit: always 0. A fault found drained the node with the check's own reason (a non-zero Epilog
# would make slurmctld overwrite it with "Epilog error"). A check that could not run or timed out
# (healthcheck.sh's 2, 124, 137: an untrusted interpreter, a hung file system) is said on stderr
# (slurmd's log) and the node goes back: a misconfigured check must not drain every node at every
# job's end. Such a node, if the job held it, is named in that job's status.json (fenced_nodes).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd -P) || exit 2
cd / || exit 2
case ${SLURM_JOB_ID:-} in '' | *[!0-9]*) exit 0 ;; esac
case ${SLURM_JOB_WORK_DIR:-} in /*) ;; *) exit 0 ;; esac
case ${SLURMD_NODENAME:-} in '' | */* | .*) exit 0 ;; esac
# Only whether the mark is there: nothing of the user's is opened or read by the shell (a mark a
# user planted costs them one check run; the check itself trusts only status.json, read safely).
[ -f "$SLURM_JOB_WORK_DIR/runs/$SLURM_JOB_ID/held-$SLURMD_NODENAME.json" ] || exit 0
"$here/healthcheck.sh" --fence-record
rc=$?
case $rc in
    0 | 1) ;;
    *) echo "trainmover epilog.sh: job $SLURM_JOB_ID: the health check did not run (exit $rc); a node this job held is not drained" >&2 ;;
esac
exit 0
