"""Megatron-core 0.16.1 on machines without CUDA (CI: CPU nodes, gloo).

Megatron-core assumes CUDA in a handful of call sites that a CPU run reaches: tensors
allocated with `device="cuda"` or `torch.cuda.current_device()` (DDP buffers, optimizer
scalars, grad-norm reductions, pipeline shape exchange, the global memory buffer), the
model-parallel RNG tracker (CUDA generator states), `.type() == 'torch.cuda.FloatTensor'`
checks (distributed optimizer, grad clipping) and `weight.data.cuda()` (tied embeddings
across pipeline stages). `activate()` redirects exactly these to the
CPU, and only when CUDA is absent: on GPU machines it does nothing and Megatron runs as
shipped. Every redirection is listed in this module and nowhere else.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import types

import torch

_ACTIVE = False
_CPU = torch.device("cpu")


def _cpu_device(device):
    """'cuda', 'cuda:0', torch.device('cuda') or a CUDA index -> the CPU; anything else as is."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return _CPU
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)
    return make


class _CudaOnCpu(types.SimpleNamespace):
    """`torch.cuda` as Megatron's modules see it here: the current device is the CPU, the
    'CUDA' generator is the CPU generator, synchronisation and streams are no-ops (CPU ops
    complete in program order)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _cuda_namespace() -> _CudaOnCpu:
    return _CudaOnCpu(
        current_device=lambda: _CPU,
        is_available=lambda: False,
        get_rng_state=lambda device="cuda": torch.get_rng_state(),
        set_rng_state=lambda state, device="cuda": torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        current_stream=lambda device=None: None,
        default_stream=lambda device=None: None,
        stream=lambda s=None: contextlib.nullcontext(),
    )


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "empty_like",
              "zeros_like", "ones_like")


class _TorchOnCpu(types.ModuleType):
    """The `torch` name inside Megatron's modules: torch itself, except `torch.cuda` and the
    tensor factories, which put CUDA-placed tensors on the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _cuda_namespace()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _cpu_tensors_as_cuda():
    """CPU tensors answer `.type()` with their CUDA name (Megatron's dtype checks compare with
    'torch.cuda.FloatTensor' or 'torch.cuda.BFloat16Tensor') and `.cuda()` leaves them where they are. Scoped to the
    wrapped Megatron calls only, never global."""
    original, original_cuda = torch.Tensor.type, torch.Tensor.cuda

    def cuda_named(self, dtype=None, non_blocking=False, **kwargs):
        out = original(self, dtype, non_blocking, **kwargs)
        if dtype is None and self.device.type == "cpu" and out.startswith("torch."):
            return "torch.cuda." + out.removeprefix("torch.")
        return out

    torch.Tensor.type = cuda_named
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = original, original_cuda


def _with_cpu_tensors_as_cuda(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _cpu_tensors_as_cuda():
            return fn(*args, **kwargs)
    return call


def active() -> bool:
    return _ACTIVE


def activate() -> bool:
    """Install the redirections if CUDA is absent (idempotent). Returns whether they are on.
    Must run after Megatron's modules are imported: modules imported later are not covered
    (`trainmover.megatron` imports all that it uses before calling this)."""
    global _ACTIVE
    if _ACTIVE or torch.cuda.is_available():
        return _ACTIVE
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import random as megatron_random

    proxy = _TorchOnCpu()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = proxy
    # The tracker reads and writes generator states through these two helpers, which call
    # torch.cuda (lazily: on a CPU build a CUDA state write would be queued and never run).
    megatron_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state())
    megatron_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state))
    cls = distrib_optimizer.DistributedOptimizer
    cls._build_model_and_main_param_groups = classmethod(
        _with_cpu_tensors_as_cuda(cls._build_model_and_main_param_groups.__func__))
    # bf16 without the distributed optimizer: the same dtype check when it makes fp32 main params
    float16 = megatron_optimizer.Float16OptimizerWithFloat16Params
    float16.__init__ = _with_cpu_tensors_as_cuda(float16.__init__)
    LanguageModule.setup_embeddings_and_output_layer = _with_cpu_tensors_as_cuda(  # weight.data.cuda()
        LanguageModule.setup_embeddings_and_output_layer)
    clip = _with_cpu_tensors_as_cuda(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip
    # The tracker warns when the CPU generator moves inside a fork; here the tracked
    # "CUDA" states are CPU generator states, so it always does, by design.
    logging.getLogger(megatron_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())
    _ACTIVE = True
    return True
