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

from trainmover.slurm import commands, expansion_fix, parse, rights

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


def standby_mode(reservation: str, fix_setting: str, env: Mapping[str, str] | None = None,
                 run: Callable = commands.run, in_job: int = 0) -> str:
    """One line for the user: where a job's standbys would come from on this cluster
    (slurm/pool_mode.py), from `scontrol show config`, the reservation and the admin's
    declaration of a fixed release; or why that is not known. Whether the reservation admits
    the job's account is checked when the job starts (its account is not known here). `in_job`:
    the standbys the job brings in its own allocation (TM_INJOB_STANDBYS): where grow is not
    possible its mode is in-job."""
    conf = run(["scontrol", "show", "config"], timeout=TIMEOUT_S, env=env, check=False)
    if conf.returncode != 0:
        return f"trainmover: standby mode not known: scontrol show config: {(conf.stderr or conf.stdout).strip()[:200]}"
    config = rights.parse_config(conf.stdout)
    resv = run(["scontrol", "-o", "show", "reservation", reservation], timeout=TIMEOUT_S, env=env, check=False)
    found = parse.parse_reservation_text(resv.stdout).get(reservation)
    where = expansion_fix.location(fix_setting, commands.build_env(env).get("SLURM_CONF"))
    pool, _ = rights.choose_pool(config.get("SchedulerParameters", ""), config.get("SLURM_VERSION", ""),
                                 expansion_fix.read(where), reservation,
                                 None if found else f"reservation {reservation} not found", in_job=in_job)
    return f"trainmover: this job's {pool.line()}"


def submit(argv: list[str], env: Mapping[str, str] | None = None,
           run: Callable = commands.run, reservation: str = "trainmover_standby",
           fix_setting: str = "auto", in_job: int = 0) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the submission, or of the refusal. A submitted job's
    stderr ends with its standby mode (standby_mode): what the job will get, said before it
    runs. `reservation`, `fix_setting`, `in_job`: TM_RESERVATION, TM_SLURM_EXPANSION_FIX and
    TM_INJOB_STANDBYS."""
    test = run(["sbatch", "--test-only", *argv], timeout=TIMEOUT_S, env=env, check=False)
    if test.returncode != 0:
        parts = run(["sinfo", "-h", "-o", "%R %D"], timeout=TIMEOUT_S, env=env, check=False).stdout
        resv = run(["scontrol", "-o", "show", "reservation"], timeout=TIMEOUT_S, env=env, check=False).stdout
        feats = run(["sinfo", "-h", "-N", "-o", "%N %f"], timeout=TIMEOUT_S, env=env, check=False).stdout
        keepers = len({ln.split()[0] for ln in feats.splitlines()
                       if len(ln.split()) == 2 and "tm_keeper" in ln.split()[1].split(",")})
        return test.returncode, "", explain(test.stderr, parts, resv, keepers)
    done = run(["sbatch", *argv], timeout=TIMEOUT_S, env=env, check=False)
    if done.returncode != 0:
        return done.returncode, done.stdout, done.stderr
    mode = standby_mode(reservation, fix_setting, env, run, in_job=in_job)
    return done.returncode, done.stdout, (done.stderr.rstrip("\n") + "\n" if done.stderr.strip() else "") + mode + "\n"
