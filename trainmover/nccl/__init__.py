"""NCCL for TrainMover: the communicator-delta library in `cuda/` (libtmdelta) and its binding.

* `lib`: ctypes binding: delta plan, non-blocking communicators with deadlines, collectives,
  and `Slot` (two-phase replacement of a group's communicator). `lib.available()` says
  whether the native library loads here, without raising.
* `backend`: NCCL as an inner backend of `trainmover.runtime.groups.SwappableGroup`.

Importing this package loads nothing native; the library is loaded on first use.
"""
