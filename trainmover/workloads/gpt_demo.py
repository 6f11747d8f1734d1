"""A small GPT trained with plain PyTorch DDP: the demo and CI workload.

Deterministic by construction: fixed seeds, a synthetic corpus generated from the seed, one
data cursor per rank (part of the migrated state), dropout on so that RNG state matters.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

from trainmover.errors import ConfigError
from trainmover.workloads.base import BuildContext, Workload, load_optimizer_in_place

PRESETS = {
    # name: (layers, d_model, heads, seq_len, batch, vocab)
    "tiny": (2, 64, 4, 32, 8, 256),
    "small": (4, 128, 4, 64, 8, 256),
    "125m": (12, 768, 12, 1024, 8, 50304),    # GPU benchmarks: ~0.16B parameters (untied head)
    "1b": (20, 2048, 16, 1024, 4, 50304),     # GPU benchmarks: ~1.2B parameters
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        with sdpa_kernel(SDPBackend.MATH):  # the fused kernels' backward is not bit-reproducible on GPUs
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, seq: int, vocab: int, dropout: float = 0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class TokenStream:
    """A synthetic corpus (a noisy repeating grammar, so the loss falls) and a cursor."""

    def __init__(self, seed: int, rank: int, vocab: int, length: int = 1 << 16):
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        base = torch.randint(0, vocab, (97,), generator=g)
        noise = torch.randint(0, vocab, (length,), generator=g)
        keep = torch.rand(length, generator=g) < 0.8
        self.data = torch.where(keep, base[torch.arange(length) % 97], noise)
        self.cursor = 0

    def seek(self, step: int, batch: int, seq: int) -> None:
        """Position of `step`'s batch: a function of the step alone, so a redone or
        rebuilt step reads exactly the data it read (or would have read) the first time."""
        n = batch * (seq + 1)
        self.cursor = (step % (len(self.data) // n)) * n

    def batch(self, batch: int, seq: int):
        n = batch * (seq + 1)
        if self.cursor + n > len(self.data):
            self.cursor = 0
        chunk = self.data[self.cursor:self.cursor + n].view(batch, seq + 1)
        self.cursor += n
        return chunk[:, :-1], chunk[:, 1:]


def _ddp(model: nn.Module, group) -> DDP:
    with warnings.catch_warnings():  # torch 2.13 deprecates broadcast_buffers; 2.11 lacks the new name
        warnings.simplefilter("ignore", FutureWarning)
        return DDP(model, process_group=group, broadcast_buffers=False)


def _flag(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "false", "0"):
        return str(value).lower() in ("true", "1")
    raise ConfigError(f"gpt_demo: option {name}={value!r}: expected true or false")


class GPTDemo(Workload):
    def __init__(self, preset: str = "tiny", lr: float = 3e-3, compile: bool = False):
        if preset not in PRESETS:
            raise ConfigError(f"gpt_demo: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        self.preset, self.lr = preset, float(lr)
        # torch.compile of the DDP wrapper (TM_WORKLOAD_OPTIONS=compile=true): dynamo splits the
        # graph at DDP's bucket boundaries, so gradient all-reduces still overlap the backward.
        # A standby compiles in its shadow iterations; its first real step then finds the code warm.
        self.compile = _flag("compile", compile)

    def _wrap(self, group) -> None:
        self.ddp = _ddp(self.model, group)
        self.forward = torch.compile(self.ddp) if self.compile else self.ddp

    def build(self, ctx: BuildContext) -> None:
        layers, d, heads, self.seq, self.batch, vocab = PRESETS[self.preset]
        self.device = torch.device(ctx.options.get("device", "cpu"))
        if self.device.type == "cuda":
            torch.use_deterministic_algorithms(True, warn_only=True)  # needs CUBLAS_WORKSPACE_CONFIG
        torch.manual_seed(ctx.seed)  # identical initial weights on every rank
        with self.device:  # built where it runs: a 1B model initialised on the CPU takes seconds
            self.model = GPT(layers, d, heads, self.seq, vocab)
        self._wrap(ctx.groups["world"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.01,
                                     **({"foreach": True} if self.device.type == "cuda" else {}))
        self.data = TokenStream(ctx.seed, ctx.rank, vocab)
        self.seed, self.rank, self.before_update = ctx.seed, ctx.rank, ctx.before_update

    def rebind(self, ctx: BuildContext) -> None:
        # Keep model and optimizer (warm); new DDP wrapper on the new groups, new data stream.
        # With compile=true the new wrapper is compiled again (dynamo guards on the wrapper):
        # the runtime's shadow steps after a rebind happen in the sandbox, off the critical path.
        self._wrap(ctx.groups["world"])
        self.data = TokenStream(ctx.seed, ctx.rank, self.model.tok.num_embeddings)
        self.seed, self.rank, self.before_update = ctx.seed, ctx.rank, ctx.before_update

    def replica_group(self) -> str:
        return "world"  # plain DDP: every rank holds the whole model and optimizer

    def collective_layout(self) -> str:
        info = self.ddp._get_ddp_logging_data()
        if not info.get("has_rebuilt_buckets"):
            return f"buckets {info.get('bucket_sizes')}"
        return f"buckets {info.get('rebuilt_bucket_sizes')} params {info.get('rebuilt_per_bucket_param_indices')}"

    trace = None  # set by the runtime to time the sections of chosen steps

    def _mark(self, what: str) -> None:
        if self.trace:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.trace(what)

    def train_step(self, step: int) -> float:
        # Data and dropout of a step depend on (seed, rank, step) only: the state a replica
        # holds plus the step number is all a rebuilt rank needs (see replica_group).
        self.data.seek(step, self.batch, self.seq)
        torch.manual_seed(self.seed + 7919 * (self.rank + 1) + 104729 * step)  # seeds CUDA generators too
        x, y = (t.to(self.device, non_blocking=True) for t in self.data.batch(self.batch, self.seq))
        self._mark("data")
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.forward(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), y.reshape(-1))
        self._mark("forward")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self._mark("backward (DDP all-reduce)")
        if self.before_update:
            self.before_update()
        self.opt.step()
        self._mark("optimizer")
        out = loss.item()
        if not math.isfinite(out):
            raise FloatingPointError(f"loss is {out} at step {step}")
        return out

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "data": {"cursor": self.data.cursor}}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():  # in place: DDP's reducer holds these very tensors
            for name, t in self.model.state_dict().items():
                src = state["model"][name]
                if src is not t:
                    t.copy_(src)
        if "optimizer" in state:
            load_optimizer_in_place(self.opt, state["optimizer"])
        self.data.cursor = int(state["data"]["cursor"])
