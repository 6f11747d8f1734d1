"""NCCL for TrainMover: the communicator library in `cuda/` (libtmdelta) and its binding.

* `lib`: ctypes binding: non-blocking communicators with deadlines, revoke/abort/destroy,
  collectives and grouped send/recv. `lib.available()` says whether the native library loads
  here, without raising.
* `backend`: NCCL as an inner backend of `trainmover.groups.swappable.SwappableGroup`.

Importing this package loads nothing native; the library is loaded on first use.
"""
