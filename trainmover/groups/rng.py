"""Every random-number state a training step may consume, captured and restored as tensors."""
from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "torch": torch.get_rng_state(),
        "python": [py[0], torch.tensor(py[1], dtype=torch.int64), -1 if py[2] is None else py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def restore(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), None if gauss == -1 else gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
