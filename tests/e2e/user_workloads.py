"""A user's workload with a bug of its own, for tests/e2e/test_user_errors.py (no fault
injection: the user's code raises by itself)."""
from trainmover.workloads.gpt_demo import GPTDemo


class BrokenConfig(GPTDemo):
    """Its constructor reads a key its config does not have: it fails wherever it is built,
    first in the batch step (the controller builds the workload to learn its groups)."""

    def __init__(self, preset: str = "tiny", lr: float = 3e-3, compile: bool = False):
        config = {"preset": preset, "lr": lr}
        super().__init__(preset, lr, compile)
        self.vocab = config["vocab_size"]
