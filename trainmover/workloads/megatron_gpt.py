"""A Megatron-core GPT (TP x PP x DP, optional distributed optimizer) under TrainMover.

Megatron's own GPTModel, DistributedDataParallel, optimizer and pipeline schedule; every
process group is a runtime SwappableGroup (see trainmover.megatron.parallel), so a switch
needs no re-pointing. What a rank's future steps depend on, and therefore its state:
  * model: this rank's shard (its TP slice of its PP stage's layers);
  * optimizer: the inner torch optimizer's state, i.e. this rank's own shard with the
    distributed optimizer, and with bf16 the fp32 main params it updates (in fp32 they are
    views of the model params);
  * rng_tracker: Megatron's model-parallel RNG states (dropout inside TP regions); the
    default generators are captured by the runtime;
  * data: the position in this DP rank's sample stream;
  * role: the rank's (tp, pp, dp) coordinates, checked on load: a state never lands on a
    rank of another stage or shard.
Deterministic: weights from the seed, samples from (seed, dp rank, position).
Options: `dtype` fp32 (default; CPU nodes) or bf16 (Megatron's mixed precision: bf16 model,
fp32 main params and gradient reduction), `device` from the runtime (cpu or cuda).
"""
from __future__ import annotations

import math

import torch

from trainmover.errors import ConfigError, MigrationError
from trainmover.megatron.layout import Layout, group_specs
from trainmover.groups.specs import GroupSpec
from trainmover.workloads.base import BuildContext, Workload, load_optimizer_in_place

PRESETS = {
    # name: (layers, hidden, heads, seq_len, micro_batch, micro_batches, vocab)
    "tiny": (2, 32, 4, 16, 2, 4, 128),
    "tiny3": (3, 32, 4, 16, 2, 4, 128),  # splits over 3 pipeline stages (CPU dry run of the GPU bench's PP3)
    "small": (4, 128, 4, 64, 4, 4, 1024),
    # GPUs: 1.28e9 parameters; bf16 + distributed optimizer over DP3 needs ~25 GB a GPU
    # (params 2 B, fp32 grads 4 B, a third of fp32 main params + Adam 12 B, per parameter).
    "1b": (24, 2048, 16, 1024, 2, 4, 32768),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def param_count(preset: str) -> int:
    """Parameters of a preset's whole model (all ranks together; embeddings tied): per layer
    QKV, projection, two MLP matrices with biases and two layer norms; word and position
    embeddings; the final layer norm."""
    layers, h, _, seq, _, _, vocab = PRESETS[preset]
    return layers * (12 * h * h + 13 * h) + vocab * h + seq * h + 2 * h


def _flag(value) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("0", "1", "true", "false", "on", "off"):
            raise ConfigError(f"megatron_gpt: distributed_optimizer={value!r}: expected 0/1")
        return value.lower() in ("1", "true", "on")
    return bool(value)


class MegatronGPT(Workload):
    def __init__(self, preset: str = "tiny", tp: int = 1, pp: int = 1, dp: int = 1,
                 distributed_optimizer=False, lr: float = 1e-3, dropout: float = 0.1, dtype: str = "fp32"):
        if preset not in PRESETS:
            raise ConfigError(f"megatron_gpt: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        if dtype not in DTYPES:
            raise ConfigError(f"megatron_gpt: dtype={dtype!r}: expected one of {sorted(DTYPES)}")
        self.preset, self.lr, self.dropout, self.dtype = preset, float(lr), float(dropout), dtype
        self.grid = Layout(int(tp), int(pp), int(dp))
        self.distributed_optimizer = _flag(distributed_optimizer)
        layers, _, heads, _, _, micro_batches, vocab = PRESETS[preset]
        if layers % self.grid.pp or heads % self.grid.tp or vocab % self.grid.tp:
            raise ConfigError(f"megatron_gpt: preset {preset!r} ({layers} layers, {heads} heads, vocab {vocab}) "
                              f"does not split over TP={self.grid.tp}, PP={self.grid.pp}")
        if self.grid.pp > 1 and micro_batches < self.grid.pp:
            raise ConfigError(f"megatron_gpt: {micro_batches} micro-batches cannot fill {self.grid.pp} stages")

    def group_specs(self, world_size: int) -> list[GroupSpec]:
        self.grid.check(world_size)
        return group_specs(self.grid)

    # --- building -------------------------------------------------------------------------
    def build(self, ctx: BuildContext) -> None:
        from trainmover.megatron import stack  # imports Megatron (seconds): only where a model is built
        self.grid.check(ctx.world_size)
        self.device = torch.device(ctx.options.get("device", "cpu"))
        self.coords = self.grid.coords(ctx.rank)
        layers, hidden, heads, self.seq, self.micro_batch, self.micro_batches, self.vocab = PRESETS[self.preset]
        self.stack = stack.build(self.grid, ctx, self.device, layers=layers, hidden=hidden, heads=heads,
                                 seq=self.seq, vocab=self.vocab, lr=self.lr, dropout=self.dropout,
                                 distributed_optimizer=self.distributed_optimizer, dtype=DTYPES[self.dtype])
        self.seed, self.position = ctx.seed, 0

    def standby_roles(self, world_size: int) -> dict[str, int]:
        """With pipeline parallelism the stages differ (embedding on the first, loss head on
        the last, p2p on both sides in the middle): first, one middle and the last stage,
        each by its (tp 0, dp 0) rank. TP and DP peers of a stage have the same shapes."""
        self.grid.check(world_size)
        per_stage = self.grid.tp * self.grid.dp
        if self.grid.pp == 1:
            return {"any": 0}
        roles = {"first": 0, "last": (self.grid.pp - 1) * per_stage}
        if self.grid.pp > 2:
            roles["middle"] = (self.grid.pp // 2) * per_stage
        return dict(sorted(roles.items(), key=lambda kv: kv[1]))

    def release(self) -> None:
        # Megatron's DDP holds the grad buffers, the optimizer its main params: all go with the stack.
        self.stack = None

    # --- data -------------------------------------------------------------------------------
    def _sample(self, position: int) -> dict:
        """Micro-batch number `position` of this DP rank: a noisy repeating grammar, so the
        loss falls. TP peers and all stages of a pipeline see the same samples."""
        base = torch.randint(0, self.vocab, (31,), generator=torch.Generator().manual_seed(self.seed))
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.coords["dp"]) * 1_000_033 + position)
        n = self.micro_batch * (self.seq + 1)
        start = int(torch.randint(0, 31, (1,), generator=g))
        clean = base[(torch.arange(n) + start) % 31]
        tokens = torch.where(torch.rand(n, generator=g) < 0.8, clean, torch.randint(0, self.vocab, (n,), generator=g))
        chunk = tokens.view(self.micro_batch, self.seq + 1).to(self.device)
        pos = torch.arange(self.seq, device=self.device).expand(self.micro_batch, -1)
        return {"tokens": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous(), "position_ids": pos}

    def _batches(self):
        while True:
            batch = self._sample(self.position)
            self.position += 1
            yield batch

    # --- training ---------------------------------------------------------------------------
    def train_step(self, step: int) -> float:
        loss = self.stack.step(self._batches(), self.micro_batches, self.seq, self.micro_batch)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step} (rank coords {self.coords})")
        return loss

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"model": self.stack.model_state(), "optimizer": self.stack.optimizer_state(),
                "rng_tracker": self.stack.rng_tracker_state(), "data": {"position": self.position},
                "role": dict(self.coords)}

    def load_state_dict(self, state: dict) -> None:
        if state["role"] != self.coords:
            raise MigrationError(f"state of rank coords {state['role']} offered to a rank at {self.coords}",
                                 phase="switch")
        self.stack.load_model_state(state["model"])
        if "optimizer" in state:
            self.stack.load_optimizer_state(state["optimizer"], load_optimizer_in_place)
        self.stack.load_rng_tracker_state(state["rng_tracker"])
        self.position = int(state["data"]["position"])
