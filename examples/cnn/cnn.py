"""A small CNN under TrainMover: the complete example of docs/workloads.md.

What a real training script has, and what each needs for an exact migration:
  * BatchNorm running statistics: buffers, part of `model.state_dict()`;
  * dropout: the global torch RNG, which the runtime captures and restores by itself;
  * SGD with momentum and weight decay: the momentum buffers are `optimizer.state_dict()`;
  * an LR schedule (StepLR, stepped every iteration): its `last_epoch` lives in the scheduler,
    not in the optimizer, so the scheduler's state_dict is part of the state;
  * gradient clipping: stateless, a function of the gradients;
  * a per-epoch reshuffle drawn from the workload's own `torch.Generator`: the generator's
    state, the epoch's order and the position in it are part of the state.
Leave any of these out of `state_dict` and `trainmover check-workload cnn:CNN` names the first
step where a migrated run would differ (tests/unit/test_check_workload.py shows it).

    PYTHONPATH=examples/cnn trainmover check-workload cnn:CNN
    sbatch --export=ALL,TM_WORKLOAD=cnn:CNN,PYTHONPATH=$PWD/examples/cnn sbatch_templates/torch_ddp.sbatch
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trainmover.workloads.base import BuildContext, Workload


def synthetic_images(seed: int, n: int, classes: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A data set a CNN can learn: each class is a fixed pattern, each sample that pattern
    shifted by a pixel or two, plus noise. Made from the seed, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 1, size, size, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    images = torch.stack([torch.roll(patterns[c], (int(dy), int(dx)), dims=(1, 2))
                          for c, (dy, dx) in zip(labels.tolist(), shifts)])
    return images + 0.5 * torch.randn(images.shape, generator=g), labels


class Net(nn.Module):
    def __init__(self, classes: int, width: int, dropout: float):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(self.drop(x.mean(dim=(2, 3))))


class CNN(Workload):
    """Options (TM_WORKLOAD_OPTIONS, e.g. lr=0.05,width=8): the constructor's arguments."""

    def __init__(self, lr: float = 0.05, width: int = 8, batch: int = 8, samples: int = 192,
                 step_size: int = 5, gamma: float = 0.8, clip: float = 1.0, dropout: float = 0.2):
        self.lr, self.width, self.batch, self.samples = float(lr), int(width), int(batch), int(samples)
        self.step_size, self.gamma, self.clip, self.dropout = int(step_size), float(gamma), float(clip), float(dropout)
        self.classes, self.size = 4, 12

    def build(self, ctx: BuildContext) -> None:
        torch.manual_seed(ctx.seed)  # identical initial weights on every rank
        self.model = Net(self.classes, self.width, self.dropout)
        with warnings.catch_warnings():  # torch 2.13 deprecates broadcast_buffers' name; we keep its default
            warnings.simplefilter("ignore", FutureWarning)
            self.ddp = DDP(self.model, process_group=ctx.groups["world"])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=self.step_size, gamma=self.gamma)
        self._data(ctx)
        torch.manual_seed(ctx.seed * 1000 + ctx.rank)  # dropout masks differ between ranks

    def _data(self, ctx: BuildContext) -> None:
        self.images, self.labels = synthetic_images(ctx.seed, self.samples, self.classes, self.size)
        self.rank, self.world = ctx.rank, ctx.world_size
        # The same order on every rank (each takes its own slice of it), reshuffled per epoch.
        self.gen = torch.Generator().manual_seed(ctx.seed + 17)
        self.epoch, self.pos = 0, 0
        self.order = torch.randperm(self.samples, generator=self.gen)

    def rebind(self, ctx: BuildContext) -> None:
        # A standby learned its rank: keep the warm model and optimizer, new DDP wrapper on the
        # new groups, and this rank's data. Its state arrives right after.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.ddp = DDP(self.model, process_group=ctx.groups["world"])
        self._data(ctx)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.samples // self.world
        if self.pos + self.batch > per_rank:  # epoch over: reshuffle with our own generator
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = torch.randperm(self.samples, generator=self.gen)
        mine = self.order[self.rank::self.world][self.pos:self.pos + self.batch]
        self.pos += self.batch
        return self.images[mine], self.labels[mine]

    def train_step(self, step: int) -> float:
        x, y = self._next_batch()
        loss = F.cross_entropy(self.ddp(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        out = loss.item()
        if not math.isfinite(out):
            raise FloatingPointError(f"loss is {out} at step {step}")
        return out

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "data": {"epoch": self.epoch, "pos": self.pos, "order": self.order, "generator": self.gen.get_state()}}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():  # in place: DDP holds these very tensors
            for name, t in self.model.state_dict().items():
                if state["model"][name] is not t:
                    t.copy_(state["model"][name])
        if "optimizer" in state:  # the runtime's negative control (TM_INJECT=skip-optimizer-state) leaves it out
            self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        data = state["data"]
        self.epoch, self.pos = int(data["epoch"]), int(data["pos"])
        self.order = data["order"].clone()
        self.gen.set_state(data["generator"])
