"""The checkpoint-restart baseline that TrainMover is measured against (issue #9).

The same workload (`gpt_demo`), trained the way a job runs without TrainMover: plain DDP,
checkpoints to the job's shared directory, and on an event the whole job stops and a new
job starts from the last committed checkpoint on healthy nodes:

    trainer.py     one rank: rendezvous, build, load, train, checkpoint on SIGUSR1 / every K steps
    checkpoint.py  the checkpoint format on shared storage (atomic commit, `latest` pointer)
    phases.py      pure: per-rank event records -> phase breakdown and downtime
    slurm_ops.py   the Slurm side (submit, signal, node down, wait for a job to leave RUNNING),
                   every command through trainmover.slurm.commands (no shell, timeouts)
"""
