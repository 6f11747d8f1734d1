"""A Megatron-core GPT trained from the user's own loop, under TrainMover (script mode).

What a Megatron-core user writes (as Megatron's own examples do): `initialize_model_parallel`,
a GPTModel, Megatron's DistributedDataParallel and (distributed) optimizer, and a loop calling
`get_forward_backward_func()`. The TrainMover lines are marked `# TM`. Megatron makes its groups
with torch.distributed.new_group, which under TrainMover are the runtime's swappable groups, so
any rank of a TP x PP x DP layout migrates.

    trainmover run examples/scripts/megatron_tm.py --tp 2 --pp 2 --steps 300      # 8 ranks, DP 2
    torchrun --nproc-per-node=4 examples/scripts/megatron_tm.py --tp 2 --pp 2     # no TrainMover

On CPU nodes `trainmover.megatron.compat` redirects Megatron's few hard-coded CUDA calls (a
no-op where CUDA exists); nothing else here is TrainMover's.
"""
import argparse
import os

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

import trainmover.script as tm  # TM
from trainmover.megatron import compat

compat.activate()  # CPU nodes only: Megatron's CUDA-only calls redirected


class MegatronState:
    """Megatron's optimizer and its model-parallel RNG tracker, as state_dict/load_state_dict:
    the inner torch optimizers (with the distributed optimizer: this rank's shard) and the
    tracker's named RNG states (dropout inside tensor-parallel regions)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]

    def state_dict(self):
        return {"inner": [o.state_dict() for o in self.inner], "rng": get_cuda_rng_tracker().get_states()}

    def load_state_dict(self, state):
        for opt, part in zip(self.inner, state["inner"]):
            opt.load_state_dict(part)
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["rng"].items()})


def batches(seed, dp_rank, first, count, micro_batch, seq, vocab):
    """Micro-batches number first..first+count of this data-parallel rank: a noisy repeating
    grammar (the loss falls), the same on TP peers and along the pipeline."""
    base = torch.randint(0, vocab, (31,), generator=torch.Generator().manual_seed(seed))
    for position in range(first, first + count):
        g = torch.Generator().manual_seed((seed * 1_000_003 + dp_rank) * 1_000_033 + position)
        n = micro_batch * (seq + 1)
        start = int(torch.randint(0, 31, (1,), generator=g))
        clean = base[(torch.arange(n) + start) % 31]
        tokens = torch.where(torch.rand(n, generator=g) < 0.8, clean, torch.randint(0, vocab, (n,), generator=g))
        chunk = tokens.view(micro_batch, seq + 1)
        yield {"tokens": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous(),
               "position_ids": torch.arange(seq).expand(micro_batch, -1)}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}
    return output, loss_func


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--distributed-optimizer", action="store_true")
    args = p.parse_args()
    layers, hidden, heads, seq, micro_batch, micro_batches, vocab = 2, 32, 4, 16, 2, 4, 128

    tm.init("gloo")  # TM (was: dist.init_process_group("gloo"))
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed, force_reset_rng=True)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, hidden_dropout=0.1, attention_dropout=0.1,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, cross_entropy_loss_fusion=False,
        batch_p2p_comm=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=args.distributed_optimizer, overlap_grad_reduce=False))
    ddp.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=args.distributed_optimizer), [ddp])
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    dp_rank = parallel_state.get_data_parallel_rank()

    tm.track(model=model, megatron=MegatronState(optimizer))  # TM
    for step in tm.loop(range(args.steps)):  # TM (was: range(args.steps))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, model=[ddp], num_microbatches=micro_batches, seq_length=seq,
            data_iterator=batches(args.seed, dp_rank, step * micro_batches, micro_batches, micro_batch, seq, vocab),
            micro_batch_size=micro_batch, forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok, "Megatron skipped the step (overflow)"
        loss = torch.zeros(1, dtype=torch.float64)
        if parallel_state.is_pipeline_last_stage():
            loss[0] = sum(float(x["lm loss"]) for x in losses) / len(losses)
        if args.pp > 1:  # every rank reports the step's loss: the last stage's, over the pipeline group
            dist.broadcast(loss, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        tm.step(loss)  # TM
        if dist.get_rank() == 0 and step % 50 == 0 and os.environ.get("VERBOSE"):
            print(f"step {step} loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
