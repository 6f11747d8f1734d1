#!/bin/sh
# TrainMover's node Epilog: a node the ending job held after fencing it goes back drained.
#
#   Epilog=/opt/trainmover/slurm_plugin/epilog.sh      (slurm.conf, every node; Epilog takes no arguments)
#
# slurmd runs it as root on each of the job's nodes when the job ends, with SLURMD_NODENAME,
# SLURM_JOB_ID, SLURM_JOB_UID and SLURM_JOB_WORK_DIR. A job that left no TrainMover record
# (runs/<job>/status.json below its working directory) cannot have held a node: the script ends
# at once, so other jobs' ends cost nothing. Otherwise it runs healthcheck.sh (beside it, with
# its healthcheck.env) with --fence-record, which reads the record as the job's user's plain
# files only (trainmover/healthcheck/fence_record.py) and drains the node with a reason
# "trainmover: healthcheck fenced: job J (uid U) held this node ..." when the job held it.
#
# Exit: 0 when the check ran, whatever it found (a fault drained the node with its own reason;
# a non-zero Epilog would make slurmctld overwrite that reason with "Epilog error"); the check's
# own code when it could not run or timed out (2, 124, 137): slurmctld then drains the node
# ("Epilog error"), since a node the job may have held must not go back unchecked.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd -P) || exit 2
cd / || exit 2
case ${SLURM_JOB_ID:-} in '' | *[!0-9]*) exit 0 ;; esac
case ${SLURM_JOB_WORK_DIR:-} in /*) ;; *) exit 0 ;; esac
# Only whether a plain file is there: nothing of the user's is opened or read by the shell.
[ -f "$SLURM_JOB_WORK_DIR/runs/$SLURM_JOB_ID/status.json" ] || exit 0
"$here/healthcheck.sh" --fence-record
rc=$?
case $rc in 0 | 1) exit 0 ;; *) exit "$rc" ;; esac
