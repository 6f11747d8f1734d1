"""Megatron-core's training stack for one rank: GPTModel, DDP, optimizer, pipeline schedule.

Only Megatron's public API is used (the same calls as its own training examples); the
groups underneath are the runtime's SwappableGroups (`parallel.initialize`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from trainmover.megatron import compat, parallel
from trainmover.megatron.layout import Layout

# Imported above, so every Megatron module that the training step reaches is loaded before
# the CPU redirections are installed (a no-op where CUDA exists).
compat.activate()


def _loss(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    # clone: the schedule divides the returned loss by the micro-batch count in place
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, _loss


@dataclass
class Stack:
    model: GPTModel                       # this rank's chunk, unwrapped
    ddp: DistributedDataParallel
    optimizer: object                     # Megatron optimizer (maybe chained)
    config: TransformerConfig
    before_update: Callable[[], None] | None = None  # the runtime's gate (BuildContext.before_update)

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def step(self, batches, micro_batches: int, seq: int, micro_batch: int) -> float:
        """One iteration: forward/backward of every micro-batch through the pipeline, grad
        reduction, optimizer step. Returns the iteration's loss, on every rank (the last
        stage computes it and broadcasts it over its pipeline group)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=batches, model=[self.ddp],
            num_microbatches=micro_batches, seq_length=seq, micro_batch_size=micro_batch, forward_only=False)
        if self.before_update is not None:  # refuses gradients of a step whose collectives failed
            self.before_update()
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("Megatron optimizer skipped the step (overflow)")
        value = torch.zeros(1, dtype=torch.float64)
        if parallel_state.is_pipeline_last_stage():
            value[0] = sum(float(x["lm loss"]) for x in losses) / len(losses)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            group = parallel_state.get_pipeline_model_parallel_group()
            dist.broadcast(value, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
        return float(value[0])

    # --- state: tensors, in place where the runtime received them in place ------------------
    def model_state(self) -> dict:
        return {k: v for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}

    def load_model_state(self, state: dict) -> None:
        own = self.model_state()
        if own.keys() != state.keys():
            raise KeyError(f"model state keys differ: missing {sorted(own.keys() - state.keys())}, "
                           f"unexpected {sorted(state.keys() - own.keys())}")
        with torch.no_grad():  # in place: DDP's param buffer and the optimizer's views hold these
            for name, t in own.items():
                _copy_unless_same(t, state[name])

    def _main_params(self) -> list[list[torch.Tensor]]:
        """Per inner optimizer, the fp32 main params it updates, where they are state of their
        own: with bf16, Megatron's mixed-precision optimizers keep fp32 copies of the bf16
        model params and round them into the model after each step. Rebuilt from the bf16
        params on a joiner they would lose their low bits, and the run would drift from the
        uninterrupted one. In fp32 they are the model params (or views of them): nothing to add."""
        if not self.config.bf16:
            return [[] for _ in self._inner()]
        return [[p.detach() for g in o.param_groups for p in g["params"]] for o in self._inner()]

    def optimizer_state(self) -> dict:
        return {"inner": [o.state_dict() for o in self._inner()], "main_params": self._main_params()}

    def load_optimizer_state(self, state: dict, load_in_place) -> None:
        inner, main = self._inner(), self._main_params()
        if len(state["inner"]) != len(inner) or [len(m) for m in state["main_params"]] != [len(m) for m in main]:
            raise KeyError(f"optimizer state has {len(state['inner'])} parts with "
                           f"{[len(m) for m in state['main_params']]} main params, this rank has {len(inner)} "
                           f"with {[len(m) for m in main]}")
        for opt, part in zip(inner, state["inner"]):
            load_in_place(opt, part)
        with torch.no_grad():
            for own, got in zip(main, state["main_params"]):
                for t, g in zip(own, got):
                    _copy_unless_same(t, g)

    def rng_tracker_state(self) -> dict:
        return get_cuda_rng_tracker().get_states()

    def load_rng_tracker_state(self, state: dict) -> None:
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state.items()})


def _copy_unless_same(own: torch.Tensor, got: torch.Tensor) -> None:
    """Copy `got` into `own` unless the transfer already received it there (same memory)."""
    if got.data_ptr() != own.data_ptr() or got.device != own.device:
        own.copy_(got)


def build(layout: Layout, ctx, device: torch.device, *, layers: int, hidden: int, heads: int, seq: int,
          vocab: int, lr: float, dropout: float, distributed_optimizer: bool,
          dtype: torch.dtype = torch.float32) -> Stack:
    parallel.initialize(layout, ctx.rank, ctx.groups, backend="nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(ctx.seed)
    model_parallel_cuda_manual_seed(ctx.seed, force_reset_rng=True)
    bf16 = dtype == torch.bfloat16
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=bf16,
        # On a GPU, weights are initialised there (from Megatron's CUDA RNG tracker): a 1B model
        # initialised on one CPU thread takes tens of seconds, on every worker and standby.
        use_cpu_initialization=device.type != "cuda",
        hidden_dropout=dropout, attention_dropout=dropout,
        # Bit-reproducible kernels that need neither apex nor TransformerEngine (absent on the
        # GPU machines too) nor a CUDA extension: no fused paths. On CUDA each of these would
        # either import apex/TE or build a kernel with torch.compile (jit_fuser).
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        batch_p2p_comm=False,  # point-to-point ops one by one: gloo has no coalesced p2p
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    # The dtype too: Megatron creates the learned position embedding as a plain fp32
    # nn.Embedding; Megatron-LM casts the whole model to bf16 (Float16Module), as done here.
    model.to(device=device, dtype=dtype)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               overlap_grad_reduce=False,
                                               # bf16: gradients accumulate and reduce in fp32 (Megatron-LM's
                                               # --accumulate-allreduce-grads-in-fp32, recommended with bf16)
                                               grad_reduce_in_fp32=bf16)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()  # DP replicas start equal (they already are: same seed per TP/PP slot)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=1.0, bf16=bf16, fp16=False,
                        params_dtype=dtype, use_distributed_optimizer=distributed_optimizer),
        [ddp], use_gloo_process_groups=False)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return Stack(model, ddp, optimizer, config, getattr(ctx, "before_update", None))
