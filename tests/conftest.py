"""One rule for every test session: the CPU tests never see a GPU; the GPU tests run apart.

Why: many tests fork (gloo groups on threads in a forked child, a job's ranks as forked
processes), and a forked child cannot use CUDA once its parent has initialised it ("Cannot
re-initialize CUDA in forked subprocess"). On a GPU machine one test that touched CUDA in the
pytest process (Megatron seeds the CUDA RNG whenever a GPU is visible; a CUDA capture test) broke
every forked test after it: 25 failures on an H100. So a session hides the GPUs before anything
can initialise CUDA, unless it is the GPU session (TM_TEST_GPU=1), which runs only the tests
marked `gpu`. `make test` runs the GPU session where the machine has a GPU.
"""
from __future__ import annotations

import glob
import os

import pytest

GPU_SESSION = os.environ.get("TM_TEST_GPU") == "1"
if not GPU_SESSION:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA initialises, which nothing has done yet

HAS_GPU = bool(glob.glob("/dev/nvidia[0-9]*"))  # the device files: CUDA itself is hidden here


def pytest_collection_modifyitems(config, items):
    for item in items:
        gpu = item.get_closest_marker("gpu") is not None
        if gpu and not GPU_SESSION and HAS_GPU:
            # ahead of the test's own skipif ("needs a GPU"), which would be wrong here
            item.add_marker(pytest.mark.skipif(True, reason="a GPU test: it runs in the GPU session "
                                               "(TM_TEST_GPU=1 pytest tests/unit -m gpu; `make test` runs it)"),
                            append=False)
        elif not gpu and GPU_SESSION:
            item.add_marker(pytest.mark.skipif(True, reason="a CPU test: it runs in a session without "
                                               "TM_TEST_GPU=1, which hides the GPUs"), append=False)
