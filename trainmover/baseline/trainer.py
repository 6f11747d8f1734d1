"""One rank of the checkpoint-restart baseline.

    srun python -m trainmover.baseline.trainer --run-dir D [--steps N] [--ckpt-every K]

Trains the same workload as TrainMover's demo (`gpt_demo`, plain DDP) without TrainMover:
no standby, no runtime. At start it rendezvouses with its peers, builds the model, loads the
latest committed checkpoint of `--run-dir` if there is one, and trains. It saves a checkpoint
every `--ckpt-every` steps and, when any rank got SIGUSR1 (what a scheduler or an operator
sends before a planned stop), at the next step boundary, after which every rank exits.

Every milestone of a (re)start is appended, with wall-clock time, to
`<run dir>/events/r<rank>.jsonl`; rank 0 appends each step to `<run dir>/metrics.jsonl`.
`trainmover.baseline.phases` turns them into the phase breakdown. A start is one
*generation* (`--generation`, default `<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>`).
"""
from __future__ import annotations

import time

T_PROCESS = time.time()  # taken before torch is imported: a restarted process pays its imports

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainmover.baseline import checkpoint  # noqa: E402
from trainmover.errors import ConfigError, DeadlineExceeded  # noqa: E402
from trainmover.groups import rng  # noqa: E402
from trainmover.groups.tensors import digest_tensors, tensors_of  # noqa: E402
from trainmover.slurm.job_env import JobEnv  # noqa: E402
from trainmover.workloads import base as workloads  # noqa: E402
from trainmover.workloads import registry  # noqa: E402

T_IMPORTED = time.time()


@dataclass(frozen=True)
class TrainerConfig:
    """Read once, from the command line and the launcher's environment (Slurm or the GPU bench)."""
    run_dir: Path
    steps: int
    model: str
    seed: int
    device: str          # cpu or cuda
    ckpt_every: int      # periodic checkpoint interval in steps (0: only when asked)
    timeout_s: float     # deadline of the rendezvous and of every collective
    rank: int
    world: int
    generation: str
    addr: str            # this rank's address (the node's, from the hosts file Slurm's nodes share)
    local_device: int    # CUDA device index on this host

    @classmethod
    def parse(cls, argv=None, environ=os.environ) -> "TrainerConfig":
        ap = argparse.ArgumentParser(prog="python -m trainmover.baseline.trainer")
        ap.add_argument("--run-dir", required=True)
        ap.add_argument("--steps", type=int, default=1500)
        ap.add_argument("--model", default="tiny")
        ap.add_argument("--seed", type=int, default=1234)
        ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
        ap.add_argument("--ckpt-every", type=int, default=0)
        ap.add_argument("--timeout-s", type=float, default=120.0)
        ap.add_argument("--rank", type=int, help="default: $SLURM_PROCID")
        ap.add_argument("--world", type=int, help="default: $SLURM_NTASKS")
        ap.add_argument("--generation", help="default: $SLURM_JOB_ID.$SLURM_RESTART_COUNT")
        ap.add_argument("--addr", help="default: the address of $SLURMD_NODENAME (else of this host)")
        ap.add_argument("--local-device", type=int, default=0)
        a = ap.parse_args(argv)
        here = JobEnv.read(environ)
        rank = a.rank if a.rank is not None else here.proc_id
        world = a.world if a.world is not None else here.ntasks
        if rank is None or world is None:
            raise ConfigError("trainer: give --rank and --world, or run it under srun (SLURM_PROCID, "
                              "SLURM_NTASKS)")
        gen = a.generation or f"{here.job_id or 'local'}.{here.restart_count}"
        addr = a.addr or socket.gethostbyname(here.node or socket.gethostname())
        if a.steps <= 0 or a.ckpt_every < 0 or not 0 <= rank < world:
            raise ConfigError(f"trainer: need steps > 0, ckpt-every >= 0, 0 <= rank < world "
                              f"(got {a.steps}, {a.ckpt_every}, {rank}, {world})")
        return cls(Path(a.run_dir), a.steps, a.model, a.seed, a.device, a.ckpt_every, a.timeout_s,
                   rank, world, gen, addr, a.local_device)


class Events:
    """This rank's milestones, one JSON line each (per-rank files: no interleaved writes)."""

    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        d = cfg.run_dir / "events"
        d.mkdir(parents=True, exist_ok=True)
        self.f = open(d / f"r{cfg.rank}.jsonl", "a", buffering=1)

    def __call__(self, event: str, t: float | None = None, **fields) -> None:
        self.f.write(json.dumps({"gen": self.cfg.generation, "rank": self.cfg.rank, "event": event,
                                 "t": time.time() if t is None else t, **fields}) + "\n")


def rendezvous(cfg: TrainerConfig, device: torch.device):
    """The job's communicators, built from scratch as every restart must.

    Rank 0 serves a TCPStore on its own address and publishes it in the shared run directory
    under this generation's name (torchrun's file rendezvous works the same way): a new job
    does not know beforehand on which node its rank 0 lands."""
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    where = cfg.run_dir / "rdzv" / f"{cfg.generation}.json"
    if cfg.rank == 0:
        where.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.create_server((cfg.addr, 0), backlog=1024)
        port = sock.getsockname()[1]
        store = dist.TCPStore(cfg.addr, port, cfg.world, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=False)
        tmp = where.with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": cfg.addr, "port": port}))
        os.replace(tmp, where)
    else:
        deadline = time.monotonic() + cfg.timeout_s
        while not where.exists():
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"rank {cfg.rank}: rank 0 did not publish {where} within {cfg.timeout_s:g}s")
            time.sleep(0.02)
        info = json.loads(where.read_text())
        store = dist.TCPStore(info["host"], info["port"], cfg.world, is_master=False, timeout=timeout,
                              wait_for_workers=False)
    # The standard path (what a job without TrainMover does). gloo's device binds the address
    # the node's hostname resolves to (its own, on the local cluster) and an ephemeral port.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.PrefixStore("baseline/", store),
                            rank=cfg.rank, world_size=cfg.world, timeout=timeout,
                            **({"device_id": device} if device.type == "cuda" else {}))
    group = dist.group.WORLD
    # NCCL (>= 2.22) and gloo connect lazily: one collective now, or the connection cost would
    # be charged to the first training step instead of to the communicators.
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return store, group


class StopRequest:
    """SIGUSR1 asks for a checkpoint and a stop at the next step boundary."""

    def __init__(self):
        self.at: float | None = None
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum, frame):
        if self.at is None:
            self.at = time.time()


def run(cfg: TrainerConfig) -> int:
    ev = Events(cfg)
    ev("process_start", T_PROCESS, addr=cfg.addr, pid=os.getpid())
    ev("torch_imported", T_IMPORTED)
    stop = StopRequest()
    torch.set_num_threads(1)  # as TrainMover's workers: determinism and fair sharing of the cores
    if cfg.device == "cuda":
        torch.cuda.set_device(cfg.local_device)
        device = torch.device("cuda", cfg.local_device)
        torch.ones(1, device=device)  # CUDA context, timed on its own
        ev("cuda_context")
    else:
        device = torch.device("cpu")
    store, group = rendezvous(cfg, device)
    ev("communicators_ready", world=cfg.world)
    workload = registry.load("gpt_demo", {"preset": cfg.model})
    workload.build(workloads.BuildContext(rank=cfg.rank, world_size=cfg.world, groups={"world": group},
                                          seed=cfg.seed, options={"preset": cfg.model, "device": cfg.device}))
    ev("model_built")
    root = cfg.run_dir / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    step = 0
    ckpt = checkpoint.latest(root)
    if ckpt is not None:
        loaded = checkpoint.load(ckpt, cfg.rank, device)
        workload.load_state_dict({**loaded.shared, "data": loaded.own["data"]})
        rng.restore(loaded.own["rng"])
        step = int(loaded.own["step"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        ev("checkpoint_loaded", step=step, bytes=loaded.bytes, read_s=loaded.seconds, path=ckpt.name)
    else:
        ev("no_checkpoint")
    metrics = open(cfg.run_dir / "metrics.jsonl", "a", buffering=1) if cfg.rank == 0 else None
    flag = torch.zeros(1, device=device)
    first = True
    loss = 0.0
    while step < cfg.steps:
        t0 = time.perf_counter()
        loss = workload.train_step(step)
        step += 1
        now = time.time()
        if metrics:
            metrics.write(json.dumps({"gen": cfg.generation, "step": step, "loss": loss,
                                      "step_s": time.perf_counter() - t0, "t": now}) + "\n")
        if first:
            ev("first_step_done", now, step=step)
            first = False
        # Any rank may have been signalled: agree (MAX) so that all stop at the same step.
        flag.fill_(1.0 if stop.at is not None else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        stopping = flag.item() > 0
        if stopping or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
            if stopping:
                ev("stop_agreed", signal_t=stop.at, step=step)
            info = save(cfg, workload, group, root, step, device)
            ev("checkpoint_saved", step=step, reason="stop" if stopping else "periodic", **info)
            if stopping:
                ev("exit", code=0, stopped=True)  # a planned stop is a success for the job
                return 0
    if cfg.rank == 0:
        sd = workload.state_dict()
        digest = digest_tensors(tensors_of({"model": sd["model"], "optimizer": sd["optimizer"]}))
        (cfg.run_dir / "final.json").write_text(json.dumps({"steps": step, "digest": digest, "loss": loss}))
    ev("exit", code=0)
    return 0


def save(cfg: TrainerConfig, workload, group, root: Path, step: int, device: torch.device) -> dict:
    """Every rank writes its part, then rank 0 commits (see trainmover.baseline.checkpoint)."""
    t0 = time.perf_counter()
    if cfg.rank == 0:
        checkpoint.partial_dir(root, step).mkdir(parents=True, exist_ok=True)
    barrier = torch.zeros(1, device=device)
    dist.all_reduce(barrier, group=group)  # the directory exists before anyone writes into it
    sd = workload.state_dict()
    own = {"rng": rng.capture(), "data": sd["data"], "step": step}
    written = checkpoint.write_part(root, step, cfg.rank,
                                    {"model": sd["model"], "optimizer": sd["optimizer"]} if cfg.rank == 0 else None,
                                    own)
    dist.all_reduce(barrier, group=group)  # every part is on storage
    if cfg.rank == 0:
        checkpoint.commit(root, step)
    dist.all_reduce(barrier, group=group)  # committed: no rank exits before the pointer moved
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"bytes": written, "save_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    cfg = TrainerConfig.parse(argv)
    try:
        return run(cfg)
    except Exception as exc:  # noqa: BLE001 - one line naming rank, host and error, then exit
        print(f"baseline trainer rank {cfg.rank} on {cfg.addr} (generation {cfg.generation}) failed: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying gloo/NCCL contexts whose peers already left can hang.
    os._exit(code)
