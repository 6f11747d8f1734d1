"""`trainmover healthcheck`: node checks for Slurm's HealthCheckProgram and LBNL NHC.

checks.py   each check, a pure function of what it reads (injectable for tests)
gpu.py      NVML checks (XID, ECC/retired pages/remapped rows, throttling, NVLink errors)
decide.py   findings + the node's Slurm state -> what to do (pure)
run.py      runs the checks under one deadline, applies the decision through trainmover.slurm
"""
from trainmover.healthcheck.checks import Finding
from trainmover.healthcheck.decide import Action, decide
from trainmover.healthcheck.run import Options, Report, run

__all__ = ["Finding", "Action", "decide", "Options", "Report", "run"]
