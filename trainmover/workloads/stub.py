"""The stub workload of the control-plane scale harness (issue 38): no model, no torch.

A job with TM_WORKLOAD=stub runs `runtime/stub_node.py` on each node instead of the rank
processes (controller/executor.py): one process per node that plays the node's ranks, each with
a control connection of its own, and whose step is a sleep of `step_s`. This class is what the
controller loads to learn the workload's groups and its replica group (every rank is a data
parallel replica, as in gpt_demo, so a vanished rank is recovered from a replica); the node
process reads `step_s` from the spec's workload options. Its methods are never called on a
rank: nothing here trains.
"""
from __future__ import annotations

from typing import Any

from trainmover.errors import ConfigError
from trainmover.workloads.base import BuildContext, Workload

STEP_S = 1.0  # a step of a large training job takes seconds; 1 s keeps 1,024 ranks' reports at 1,024 a second


class Stub(Workload):
    def __init__(self, step_s: float = STEP_S):
        step_s = float(step_s)
        if not 0.0 < step_s <= 60.0:
            raise ConfigError(f"stub workload: step_s must be in (0, 60], got {step_s}")
        self.step_s = step_s

    def replica_group(self) -> str | None:
        return "world"

    def build(self, ctx: BuildContext) -> None:
        raise NotImplementedError("the stub workload runs in runtime/stub_node.py, never in a rank process")

    def train_step(self, step: int) -> float:
        raise NotImplementedError("the stub workload runs in runtime/stub_node.py, never in a rank process")

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("the stub workload runs in runtime/stub_node.py, never in a rank process")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("the stub workload runs in runtime/stub_node.py, never in a rank process")
