"""`trainmover` command line.

    trainmover cluster {up,down,status,env} [--nodes N] [--standby S] [--dir D] [--slurm V]
    trainmover controller                  (inside a job: started by the sbatch templates)
    trainmover status --job J [--json]
    trainmover migrate --job J --node N
    trainmover config                      (every TM_* variable, its default and meaning)
    trainmover demo [--steps N] [--slurm V] [--verify] (cluster up, submit, drain, show the migration)
    trainmover healthcheck [--node N] ...  (node health; drains with a 'trainmover:' reason)
    trainmover drain NODE --reason TEXT   (admin: drain, and tell the jobs there at once)
    trainmover node-reader [--interval S]  (root service: every node's state for every job, one RPC)
    trainmover check-workload MODULE:CLASS [--steps N]  (would a migration be exact? one machine)
    trainmover submit [sbatch options] SCRIPT  (sbatch, refused at once if Slurm could never start it;
                                                says which standby mode the job gets)
    trainmover simulate --gpus N ...       (Monte-Carlo ETTR of three downtime models)
    trainmover plan --gpus N [--gpus-per-node G] [--cluster] ...  (how many standbys; docs/simulator.md;
                                                --cluster: and where they come from here)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainmover.errors import TrainMoverError


def _run_dir(job: str, run_dir: str | None) -> Path:
    if run_dir:
        return Path(run_dir)
    from trainmover.controller.durable.records import run_dir as default_dir
    from trainmover.slurm.client import CliSlurm
    try:
        work_dir = CliSlurm(timeout=10).job(int(job)).work_dir
    except TrainMoverError:
        work_dir = None  # Slurm has forgotten a finished job: look in the current directory
    path = default_dir(work_dir or ".", job)
    if not (path / "status.json").exists() and not (path / "controller.json").exists():
        raise TrainMoverError(f"no TrainMover run found for job {job} (looked in {path}); "
                              "is it a TrainMover job? pass --run-dir to point at runs/<job>")
    return path


def _read_run_file(path: Path, job: str, what: str) -> dict:
    """A job's file as its user wrote it: bounded, never through a link or blocking on a FIFO
    (an admin may run this as root on any user's job)."""
    from trainmover.protocol import files
    try:
        data = json.loads(files.read_limited(path, 16 << 20))
    except FileNotFoundError:
        raise TrainMoverError(f"job {job} has not written its {what} yet ({path})") from None
    except (OSError, ValueError) as exc:
        raise TrainMoverError(f"job {job}: its {what} at {path} is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise TrainMoverError(f"job {job}: its {what} at {path} is not a JSON object")
    return data


def _role(report: dict) -> str:
    return f"{report['role']} (rank {report['rank']})" if "role" in report else f"rank {report['rank']}"


def _say(line: str) -> None:
    """A line of `status`, whose strings (node names, notes, messages, a user's exception text)
    a job's user wrote: control characters printed escaped (\\x1b...), so that an admin's terminal
    runs no escape sequence another user planted."""
    print("".join(c if c.isprintable() else repr(c)[1:-1] for c in line))


def _held_run_dir(job: str, run_dir: str | None) -> Path:
    """The job's run directory held open (files.held_dir: no link followed), only if it is the
    job's user's and nobody else can write it: a `runs/` another user renamed and replaced in a
    shared submit directory is refused, not read (docs/security.md). The job's user is the one
    running this, or, for root, Slurm's `UserId=` (the directory's owner where Slurm has
    forgotten the job)."""
    from trainmover.protocol import files
    path = _run_dir(job, run_dir)
    owner = None
    if os.geteuid() == 0:
        try:
            owner = _job_uid(job)
        except TrainMoverError:
            owner = os.lstat(path).st_uid
    return files.held_dir(path, owner=owner)


def _status(args) -> int:
    status = _read_run_file(_held_run_dir(args.job, args.run_dir) / "status.json", args.job, "status")
    if args.json:
        print(json.dumps(status, indent=1))  # JSON escapes control characters itself
        return 0
    _say(f"job {status['job_id']}  world size {status['world_size']}  batch host {status['batch_host']}")
    for n in status["nodes"]:
        _say(f"  node {n['name']:<10} {n['role']:<9} ranks {n['ranks']}  slurm: {n['slurm_state']}")
    choice = status.get("standby_pool", {}).get("choice")
    if choice:
        _say(f"  standby pool: {choice['standbys']} ({choice['setting']}): {choice['why']}")
    for line in _capability_lines(status.get("capabilities") or {}):
        _say(line)
    line = _in_job_line(status.get("standby_pool") or {})
    if line:
        _say(line)
    for s in status["standbys"]:
        warm = f"warm in {s['warmup_s']:.1f}s" if s["warmup_s"] is not None else "warming up"
        shadow = s.get("shadow") or {}
        if shadow.get("replay") == "done" and shadow.get("loss_equal") is None:  # a re-recorded version
            warm += (f", {shadow['iterations']} shadow iterations on recording version {shadow['version']} "
                     f"(steps {shadow['first_step']}-{shadow['last_step']} of rank {shadow['rank']}; shapes checked)")
        elif shadow.get("replay") == "done":
            roles = shadow.get("roles") or [shadow]
            warm += (f", {sum(r['iterations'] for r in roles)} shadow iterations on recorded collectives of "
                     f"{'role' if len(roles) == 1 else 'roles'} {', '.join(_role(r) for r in roles)}, losses "
                     f"{'equal' if shadow['loss_equal'] else 'DIFFERENT'}"
                     + ("" if shadow.get("sends_equal") is None else
                        f", sends {'equal' if shadow['sends_equal'] else 'DIFFERENT'}"))
        elif shadow.get("replay"):
            warm += f", shadow iterations answered locally ({shadow['replay']})"
        _say(f"  standby {s['node']:<7} {s['state']:<9} {warm}")
    for rec in (status.get("recordings") or {}).values():
        _say(f"  recording v{rec.get('version', 1)}: rank {rec['rank']}, {rec['iterations']} iterations, "
              f"{rec['bytes']} bytes, {rec['overhead_s']:.3f}s of extra step time")
    if not status["standbys"]:
        _say(f"  standby pool empty {('(' + status['standby_pool']['note'] + ')') if status['standby_pool']['note'] else ''}")
    if status.get("message"):
        _say(f"  ! {status['message']}")
    for m in status["migrations"]:
        dt = f"downtime {m['downtime_s']:.3f}s" if m["downtime_s"] is not None else "downtime -"
        _say(f"  migration {m['id']}: {m['leaver']} -> {m['joiner'] or '?'}  [{m['trigger']}] {m['state']}  {dt}"
              f"{'  ' + m['note'] if m['note'] else ''}")
        if m.get("state_source"):
            _say(f"    state from {_source(m['state_source'])}")
    if "outcome" in status:
        _say(f"  finished: {status['outcome']['message']}")
    return 0


def _capability_lines(caps: dict) -> list[str]:
    """Where the job's standbys come from and, when it cannot grow, why (status.json's
    capabilities: slurm/rights.py, slurm/pool_mode.py)."""
    out = []
    mode = caps.get("pool_mode") or {}
    if mode:
        out.append(f"  standby mode: {mode.get('mode')} ({mode.get('why')})")
    if caps.get("grow") is False:
        out.append(f"  grow: no ({(caps.get('why') or {}).get('grow', '')})")
    elif "unknown" in caps:
        out.append(f"  grow: not known ({caps['unknown']}); no job expansion is made")
    return out


def _in_job_line(pool: dict) -> str:
    """TM_INJOB_STANDBYS: the standbys the job brought, how many are left where none is taken
    from the reservation, and whether they are refilled ('' for a job that brought none)."""
    in_job = pool.get("in_job")
    if not in_job:
        return ""
    left = f"{in_job['left']} left of {in_job['brought']}" if "left" in in_job else f"{in_job['brought']} brought"
    return f"  in-job standbys: {left}, refill from the reservation: {in_job['refill']}"


def _source(src: dict) -> str:
    """A recovery's tier in words, e.g. 'snapshot of step 200 (rolled back 30 steps)'."""
    where = {"replica": f"replica (rank {src.get('rank')}) at step {src.get('step')}",
             "snapshot": f"snapshot of step {src.get('step')}", "checkpoint": f"checkpoint of step {src.get('step')}"}
    text = where.get(src.get("tier"), str(src))
    back = src.get("rolled_back_steps", 0)
    return text + (f" (rolled back {back} steps)" if back else "")


def _controller() -> int:
    """The batch script's process: the keeper on a keeper node, else the supervisor itself."""
    import os
    from trainmover.logs import setup_logging
    from trainmover.controller.succession import keeper, supervisor
    from trainmover.protocol import files
    files.private_umask()  # the job's files are its user's alone (docs/security.md)
    from trainmover.slurm.job_env import JobEnv
    from trainmover.slurm.model import KEEPER_FEATURE
    here = JobEnv.read()
    node, job = here.node, here.job_id
    if node and job is not None:
        from trainmover.config import Config
        from trainmover.slurm.client import CliSlurm
        cfg = Config.from_env()
        slurm = CliSlurm(node_query=cfg.node_query)  # tm_nodes: one RPC a node query, not two
        # one query (the allocation's nodes): is this a keeper node, and where can the controller go
        reading = keeper.start_reading(slurm, job, node, os.environ, os.getcwd())
        info = reading[1].get(node) if reading else None
        if (KEEPER_FEATURE in info.features) if info is not None else keeper.is_keeper(slurm, node):
            setup_logging()
            return keeper.main(cfg, slurm, job, node, reading)
    return supervisor.main([])


def _job_uid(job: str) -> int:
    """The job's user's uid, from Slurm: root's `migrate` takes the key of that user's run
    directory only (a directory of anyone else's, or a link to one, is refused)."""
    from trainmover.slurm.client import CliSlurm
    uid = CliSlurm(timeout=10).job(int(job)).user_id
    if uid < 0:
        raise TrainMoverError(f"job {job}: Slurm does not say whose job it is: not migrating it as root")
    return uid


def _migrate(args) -> int:
    from trainmover.protocol import channel
    from trainmover.protocol.messages import make
    path = _run_dir(args.job, args.run_dir)
    from trainmover.protocol import endpoint, files
    # held and checked on its descriptor: no link followed, and as root only the job's user's
    at = files.held_dir(path, owner=_job_uid(args.job) if os.geteuid() == 0 else None)
    key = channel.read_secret(str(at / "secret"))
    where = endpoint.read(at / endpoint.NAME, key)
    if where is None:
        print(f"trainmover: job {args.job}: no controller address sealed with the job's key in {path}", file=sys.stderr)
        return 2
    reply = channel.request(where.address, key, make("migrate", node=args.node), timeout=args.timeout)
    _say(reply["message"])
    return 0 if reply["ok"] else 2


def _drain(args) -> int:
    """`scontrol update State=DRAIN`, then the drain notice (root only: slurm/drain_notice.py)."""
    import os
    import time
    from trainmover.slurm import drain_notice
    from trainmover.slurm.client import CliSlurm
    CliSlurm(timeout=10).drain(args.node, args.reason)
    directory = (drain_notice.default_dir(os.environ.get("SLURM_CONF")) if args.notices == "auto"
                 else Path(args.notices))
    if directory is None:
        print(f"{args.node} drained; no drain-notice directory: its jobs see the drain at their next node poll")
        return 0
    try:
        drain_notice.publish(directory, args.node, args.reason, time.time())
    except (OSError, ValueError) as exc:
        print(f"{args.node} drained; drain notice not written ({exc}): its jobs see the drain at their next "
              "node poll", file=sys.stderr)
        return 0
    print(f"{args.node} drained; its jobs were told through {directory}")
    return 0


def _node_reader(args) -> int:
    """Runs until killed: slurm/node_states.py."""
    import os
    from trainmover.logs import setup_logging
    from trainmover.slurm import drain_notice, node_states
    from trainmover.slurm.client import CliSlurm
    setup_logging()
    directory = (drain_notice.default_dir(os.environ.get("SLURM_CONF")) if args.notices == "auto"
                 else Path(args.notices))
    if directory is None or args.interval <= 0:
        raise TrainMoverError("node-reader needs a drain-notice directory (--notices) and --interval > 0")
    node_states.serve(CliSlurm(timeout=max(5.0, args.interval), node_query="auto"), directory, args.interval)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover", description="Live migration of training ranks inside Slurm jobs")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cluster", help="the embedded local Slurm cluster")
    c.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("controller", help="run the job-step controller (inside a job)")
    r = sub.add_parser("run", help="inside a job: run your own torchrun script under TrainMover (script mode)")
    r.add_argument("rest", nargs=argparse.REMAINDER, help="the script and its arguments")
    s = sub.add_parser("status", help="a job's nodes, standbys and migrations")
    s.add_argument("--job", required=True)
    s.add_argument("--json", action="store_true")
    s.add_argument("--run-dir")
    m = sub.add_parser("migrate", help="move a node's ranks to a standby without draining it")
    m.add_argument("--job", required=True)
    m.add_argument("--node", required=True)
    m.add_argument("--run-dir")
    m.add_argument("--timeout", type=float, default=10.0)
    dr = sub.add_parser("drain", help="admin: drain a node and tell the TrainMover jobs there at once "
                        "(a drain notice; they migrate within a second instead of at their next poll)")
    dr.add_argument("node")
    dr.add_argument("--reason", required=True)
    dr.add_argument("--notices", metavar="DIR", default="auto",
                    help="the drain-notice directory (default: trainmover-drains beside slurm.conf; "
                         "docs/admin.md, \"Load on slurmctld\")")
    nr = sub.add_parser("node-reader", help="root service: read every node's state in one RPC every few seconds "
                        "for every job's controller (docs/admin.md, \"Load on slurmctld\")")
    nr.add_argument("--interval", type=float, default=2.0, help="seconds between reads (default 2)")
    nr.add_argument("--notices", metavar="DIR", default="auto", help="the drain-notice directory, where the "
                    "table is written (default: trainmover-drains beside slurm.conf)")
    sub.add_parser("config", help="list every TM_* variable")
    d = sub.add_parser("demo", help="start the local cluster, submit the demo, drain a node, show the migration")
    d.add_argument("--steps", type=int, default=1500)
    d.add_argument("--slurm", metavar="V", default=None,
                   help="Slurm release (22.05, 24.11, 25.11, 26.05): the host's when it has it, else from a Debian "
                        "root filesystem built once, 25.11 from source (default: the host's)")
    d.add_argument("--verify", action="store_true",
                   help="then let the job finish, run it again with no drain and compare every loss and the final "
                        "state digest (exit 1 unless bit-exact)")
    from trainmover.healthcheck.cli import add_arguments as healthcheck_arguments
    healthcheck_arguments(sub.add_parser("healthcheck", help="check this node (GPU, disk); drain it on a fault"))
    u = sub.add_parser("submit", help="sbatch, after asking Slurm (sbatch --test-only) whether the job could "
                       "ever start here; refused with the reason and what the cluster has")
    u.add_argument("rest", nargs=argparse.REMAINDER, help="sbatch's options, the script and its arguments")
    from trainmover.check.cli import add_arguments as check_arguments
    check_arguments(sub.add_parser("check-workload", help="would a migration of this workload be exact? "
                                   "(one machine, gloo; exit 0 only if so)"))
    from trainmover.simulate.cli import add_arguments as simulate_arguments
    simulate_arguments(sub.add_parser("simulate", help="Monte-Carlo ETTR of checkpoint-restart, elastic and TrainMover"))
    from trainmover.standbys.cli import add_arguments as plan_arguments
    plan_arguments(sub.add_parser("plan", help="how many standbys: ETTR and GPU-hours lost per pool size, the best "
                                  "size, the reservation for a set of jobs"))
    return p


def _submit(rest: list[str]) -> int:
    from trainmover.slurm.submit import submit
    if not rest or rest[0] in ("-h", "--help"):
        print("usage: trainmover submit [sbatch options] SCRIPT [ARGS]\n\nsbatch, after asking Slurm "
              "(sbatch --test-only) whether the job could ever start on this cluster: a job it could not place "
              "is refused at once with Slurm's reason and what the cluster has, instead of pending for ever. A "
              "submitted job's standby mode (reservation-grow, in-job with TM_INJOB_STANDBYS=N, or none, and "
              "why) follows on stderr.")
        return 0 if rest else 2
    from trainmover.config import Config
    try:  # the job inherits this environment: its reservation and declaration setting
        cfg = Config.from_env()
    except TrainMoverError:
        cfg = Config()  # the job will say what is wrong with its variables when it starts
    try:
        code, out, err = submit(rest, reservation=cfg.reservation, fix_setting=cfg.slurm_expansion_fix,
                                in_job=cfg.injob_standbys)
    except TrainMoverError as exc:
        print(f"trainmover submit: {exc}", file=sys.stderr)
        return 2
    print(out, end="")
    if err:
        print(err.rstrip("\n"), file=sys.stderr)
    return code


RUN_USAGE = """usage: trainmover run SCRIPT [ITS ARGUMENTS]

Inside a Slurm batch script (sbatch_templates/torch_script.sbatch): run your own torchrun training
script under TrainMover, one rank per GPU (or per CPU node), its arguments passed on unchanged.
The script calls trainmover.script's init/track/loop/step (docs/scripts.md). Outside a job run it
with torchrun as before; `trainmover check-workload SCRIPT ARGS` checks that a migration is exact."""


def _run(rest: list[str]) -> int:
    """`trainmover run script.py args...`: the job's controller with the script as its workload."""
    import json
    import os
    if not rest or rest[0] in ("-h", "--help"):
        print(RUN_USAGE)
        return 0 if rest else 2
    script = os.path.abspath(rest[0])
    if not script.endswith(".py") or not os.path.isfile(script):
        print(f"trainmover run: {rest[0]!r} is not a Python script (a .py file)\n\n{RUN_USAGE}", file=sys.stderr)
        return 2
    from trainmover.slurm.job_env import JobEnv
    if not JobEnv.read().in_job:
        print("trainmover run: not inside a Slurm job (no SLURM_JOB_ID): submit it with "
              "sbatch_templates/torch_script.sbatch, or run the script with torchrun as before", file=sys.stderr)
        return 2
    os.environ["TM_WORKLOAD"] = "script:" + script
    os.environ["TM_SCRIPT_ARGS"] = json.dumps(rest[1:])
    try:
        return _controller()
    except TrainMoverError as exc:
        print(f"trainmover run: {exc}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["submit"]:  # everything after it is sbatch's: argparse would take its options as ours
        return _submit(argv[1:])
    if argv[:1] == ["run"]:  # everything after the script is the script's
        return _run(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "cluster":
            from trainmover.cluster.__main__ import main as cluster_main
            return cluster_main(args.rest)
        if args.command == "controller":
            return _controller()
        if args.command == "status":
            return _status(args)
        if args.command == "migrate":
            if not args.job.isdigit():
                raise TrainMoverError(f"--job must be a Slurm job id, got {args.job!r}")
            return _migrate(args)
        if args.command == "drain":
            return _drain(args)
        if args.command == "node-reader":
            return _node_reader(args)
        if args.command == "demo":
            from trainmover.demo import main as demo_main
            return demo_main(steps=args.steps, slurm=args.slurm, check=args.verify)
        if args.command == "healthcheck":
            from trainmover.healthcheck.cli import main as healthcheck_main
            return healthcheck_main(args)
        if args.command == "check-workload":
            from trainmover.check.cli import main as check_main
            return check_main(args)
        if args.command == "simulate":
            from trainmover.simulate.cli import main as simulate_main
            return simulate_main(args)
        if args.command == "plan":
            from trainmover.standbys.cli import main as plan_main
            return plan_main(args)
        if args.command == "config":
            from trainmover.config import describe
            print(describe())
            return 0
    except TrainMoverError as exc:
        print(f"trainmover {args.command}: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
