"""TrainMover: move a training rank to a pre-warmed standby node inside a running Slurm job."""

__version__ = "0.1.0"
