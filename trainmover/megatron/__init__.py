"""Megatron-core integration: layout -> groups (`layout`), groups -> torch.distributed and
Megatron's `parallel_state` (`c10d`, `parallel`), CPU support (`compat`).
The workload itself is `trainmover.workloads.megatron_gpt`."""
