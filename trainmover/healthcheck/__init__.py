"""`trainmover healthcheck`: node checks for Slurm's HealthCheckProgram and LBNL NHC.

The GPU side flows: source -> reading -> (injected faults) -> verdict against the kept state.

source.py    where the GPU reading comes from: NVML, DCGM health watches + NVML, a recorded file
nvml.py      the NVML reader (ECC, retirement/remap, lost GPUs, throttling, link counters, XID events)
dcgm.py      the DCGM reader (dcgmi health -c incidents)
kmsg.py      XIDs from the kernel log
readings.py  what a source read: plain values
inject.py    the fault-injection hook (inject-fault-<node>): faults applied to a reading as data
rates.py     link error counters judged by rate (pure)
verdict.py   a reading against the last run's state -> findings + state to keep (pure)
state.py     the state directory: trusted reads, atomic writes
checks.py    the other checks (disk, straggler verdicts, the hook's text form)
decide.py    findings + the node's Slurm state -> what to do (pure)
run.py       runs the checks under one deadline, applies the decision through trainmover.slurm
"""
from trainmover.healthcheck.checks import Finding
from trainmover.healthcheck.decide import Action, decide
from trainmover.healthcheck.run import Options, Report, run

__all__ = ["Finding", "Action", "decide", "Options", "Report", "run"]
