"""An embedded, real Slurm cluster on one machine, for demos and tests: Slurm 22.05,
24.11, 25.11 (built from source) or 26.05, the host's or from a Debian root filesystem (rootfs.py).

    info = up(nodes=4, standby=2)      # train[1-4] + spare[1-2], reservation trainmover_standby
    info = up(slurm="24.11")           # the same on Slurm 24.11; info.slurm says which
    print(env_lines())                 # export SLURM_CONF=...
    status(); down()

State lives in `state_dir`, else $TM_CLUSTER_DIR, else /var/tmp/trainmover-cluster
(-<release> when one is named). See docs/admin.md for the Slurm settings it uses.
"""

from trainmover.cluster.lifecycle import ClusterInfo, attach, down, env_lines, resolve_dir, status, up
from trainmover.cluster.procs import ClusterError

__all__ = ["ClusterInfo", "ClusterError", "attach", "up", "down", "status", "env_lines", "resolve_dir"]
