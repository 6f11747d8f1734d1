"""`trainmover submit [sbatch options] SCRIPT [ARGS]`: sbatch, after asking Slurm whether the
job could ever start on this cluster.

Why: Slurm 22.05 accepts a job that fits its partition only with the nodes a reservation holds
(TrainMover's standbys) and keeps it pending for ever ("ReqNodeNotAvail, May be reserved for
other job"); without `EnforcePartLimits` it does the same with more nodes than the partition
has ("PartitionNodeLimit"). `sbatch --test-only` asks the scheduler itself, which knows
partitions, reservations, GRES and limits: a job it cannot place fails here, at submit, with
Slurm's reason and what the cluster has.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from trainmover.slurm import commands

TIMEOUT_S = 30.0


def explain(slurm_error: str, partitions: str, reservations: str, keepers: int = 0) -> str:
    """The refusal in words (pure). `partitions`: `sinfo -h -o '%R %D'` output; `reservations`:
    `scontrol -o show reservation` output; `keepers`: nodes with the feature tm_keeper (a job's
    batch script runs on one of them and it trains on none: docs/admin.md)."""
    reason = " ".join(ln.strip() for ln in slurm_error.splitlines() if ln.strip()) or "no reason given"
    lines = [f"Slurm says this job could never start here: {reason}"]
    sizes = [ln.split() for ln in partitions.splitlines() if len(ln.split()) == 2]
    held = [(m.group(1), int(n.group(1)), nodes.group(1))
            for ln in reservations.splitlines()
            if (m := re.search(r"ReservationName=(\S+)", ln)) and (n := re.search(r"NodeCnt=(\d+)", ln))
            and (nodes := re.search(r"\bNodes=(\S+)", ln))]
    if "gres" in reason.lower():
        lines.append("this cluster has no such GPUs (GRES): leave out --gpus-per-node on CPU nodes")
        return "\n".join(lines)
    reserved = sum(n for _, n, _ in held)
    for name, total in sizes:
        usable = int(total) - reserved - keepers
        held_text = "; ".join(f"{nodes} held by reservation {r}" for r, _, nodes in held)
        how = (f"--nodes={usable + 1} --constraint=[tm_keeper*1&tm_train*{usable}] (its keeper node included)"
               if keepers else f"--nodes={usable}")
        lines.append(f"partition {name}: {total} nodes" + (f" ({held_text}, for standbys)" if held else "")
                     + (f", {keepers} keeper node(s)" if keepers else "")
                     + f", so a job gets at most {usable} training nodes: submit with {how} or fewer"
                       " (TrainMover adds its standbys from the reservation itself)")
    return "\n".join(lines)


def submit(argv: list[str], env: Mapping[str, str] | None = None,
           run: Callable = commands.run) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the submission, or of the refusal."""
    test = run(["sbatch", "--test-only", *argv], timeout=TIMEOUT_S, env=env, check=False)
    if test.returncode != 0:
        parts = run(["sinfo", "-h", "-o", "%R %D"], timeout=TIMEOUT_S, env=env, check=False).stdout
        resv = run(["scontrol", "-o", "show", "reservation"], timeout=TIMEOUT_S, env=env, check=False).stdout
        feats = run(["sinfo", "-h", "-N", "-o", "%N %f"], timeout=TIMEOUT_S, env=env, check=False).stdout
        keepers = len({ln.split()[0] for ln in feats.splitlines()
                       if len(ln.split()) == 2 and "tm_keeper" in ln.split()[1].split(",")})
        return test.returncode, "", explain(test.stderr, parts, resv, keepers)
    done = run(["sbatch", *argv], timeout=TIMEOUT_S, env=env, check=False)
    return done.returncode, done.stdout, done.stderr
