"""Workloads that `trainmover check-workload` must refuse, each the example CNN
(examples/cnn/cnn.py) with one mistake a new user makes. Imported by the check's processes as
`tests.unit.check_workloads:<Class>` (the repository root and examples/cnn on PYTHONPATH)."""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from cnn import CNN


class NoScheduler(CNN):
    """Leaves the LR scheduler out of its state: a joiner's StepLR counts from its own shadow
    steps, so its learning rate decays at other steps than the job's."""

    def state_dict(self) -> dict:
        sd = super().state_dict()
        del sd["scheduler"]
        return sd

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({**state, "scheduler": self.sched.state_dict()})


class NoGenerator(CNN):
    """Keeps the epoch's order and position but not the generator that draws the next order:
    the migrated run reads other samples from the next epoch on."""

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["data"] = {k: v for k, v in sd["data"].items() if k != "generator"}
        return sd

    def load_state_dict(self, state: dict) -> None:
        data = {**state["data"], "generator": self.gen.get_state()}
        super().load_state_dict({**state, "data": data})


class PerEpochSchedule(NoScheduler):
    """StepLR stepped once per epoch (epochs of 4 steps, every `step_size` epochs) and left out
    of the state (as NoScheduler): its effect repeats every 4 x step_size steps only, and which
    runs it tells apart depends on their epoch counts."""

    def __init__(self, step_size: int = 2, **kw):
        super().__init__(samples=64, step_size=step_size, **kw)

    def train_step(self, step: int) -> float:
        epoch = self.epoch
        x, y = self._next_batch()
        if self.epoch != epoch:
            self.sched.step()
        loss = F.cross_entropy(self.ddp(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.item()


class Unseeded(CNN):
    """Augments with its own `random.Random()`, seeded from the OS: not a function of
    (seed, rank, state), and invisible to the runtime's RNG capture."""

    def build(self, ctx) -> None:
        super().build(ctx)
        self.jitter = random.Random()

    def rebind(self, ctx) -> None:
        super().rebind(ctx)
        self.jitter = random.Random()

    def _next_batch(self):
        x, y = super()._next_batch()
        # A ramp across the image, large enough to move the loss: BatchNorm removes a constant
        # offset, and with one of 1e-3 the loss of a step run twice came out the same to the
        # last bit now and then (its state did not), which the checker rightly reports as state
        # moving on rather than as an unseeded generator (two draws within ~3e-5 still would: about
        # 1 in 10,000 runs).
        ramp = torch.linspace(-1.0, 1.0, x.shape[-1], dtype=x.dtype)
        return x + self.jitter.random() * 0.5 * ramp, y


class GeneratorObject(CNN):
    """Puts the torch.Generator object itself into the state: the transfer cannot carry it."""

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["data"]["generator"] = self.gen
        return sd


class LoadForgetsBatchNorm(CNN):
    """load_state_dict restores the parameters but not BatchNorm's running statistics."""

    def load_state_dict(self, state: dict) -> None:
        own = self.model.state_dict()
        model = {k: (own[k].clone() if "running" in k or "num_batches" in k else v) for k, v in state["model"].items()}
        super().load_state_dict({**state, "model": model})



class HangsOnRank1(CNN):
    """Rank 1 stops answering in its 6th step (a deadlock, a stuck data loader)."""

    def train_step(self, step: int) -> float:
        if self.rank == 1 and step == 5:
            import time
            time.sleep(3600)
        return super().train_step(step)


class LeavesAChild(CNN):
    """Exact, but it starts a process of its own and leaves it running (as a DataLoader worker
    left behind, seen once on a loaded machine). Each child's pid is written into
    $TM_TEST_CHILD_PIDS, for the test to see it ended with the check."""

    def build(self, ctx) -> None:
        super().build(ctx)
        import os
        import subprocess
        child = subprocess.Popen(["sleep", "600"])
        with open(os.path.join(os.environ["TM_TEST_CHILD_PIDS"], str(child.pid)), "w") as f:
            f.write(str(child.pid))
