"""The group layer, at the bottom of everything that runs on a rank.

* `swappable`: `SwappableGroup`, a real `torch.distributed.ProcessGroup` whose inner backend
  (gloo, the sandbox's recorded collectives, NCCL) is swapped under the model's feet, so DDP,
  Megatron and a user's own code keep the group objects they were given; completed-work
  tracking and revoke.
* `specs`: the groups a job has (`GroupSpec`) and the delta a migration builds (only the
  groups that contain a leaver).
* `tensors`: walking a state's tensors, and their digests.
* `rng`: RNG states (Python, NumPy, torch, CUDA) captured and restored.
* `nccl`: NCCL as an inner backend (`cuda/libtmdelta.so` through ctypes).

Everything above imports these downward; nothing here imports the rank's roles, the
controller or a workload.
"""
