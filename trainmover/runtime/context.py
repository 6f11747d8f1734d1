"""What a rank process's roles are given: the process's own parts, typed.

The process (`worker.Agent`) owns its state machine, its control channel, its rendezvous store,
its groups and its workload; each role (standby.py, training.py, switch.py, protection.py,
recovery.py) is an object handed this context and the other roles it calls, and keeps its own
state to itself. `RankContext` is everything a role may use of the process: nothing else. The
process's moving parts are read-only to a role: it changes them by handing the process a change
(runtime/changes.py).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainmover.faults import Injector
    from trainmover.protocol.messages import Message
    from trainmover.protocol.worker_spec import WorkerSpec
    from trainmover.protocol.store import AuthStore
    from trainmover.runtime import phase1
    from trainmover.runtime.changes import Change
    from trainmover.groups.swappable import SwappableGroup
    from trainmover.groups.specs import GroupSpec
    from trainmover.runtime.dispatch import Dispatcher
    from trainmover.runtime.rankstate import RankState, RankStateMachine
    from trainmover.runtime.usercode import UserWorkload
    from trainmover.workloads.base import BuildContext


class RankContext(Protocol):
    # what the process is, fixed at launch
    spec: WorkerSpec
    local: int                        # SLURM_LOCALID: this process's index on its node
    key: bytes                        # the job's secret
    device: str                       # cpu or cuda
    faults: Injector                  # the one fault-injection hook (trainmover/faults.py)
    inbox: Dispatcher                 # the controller's messages, routed by state (dispatch.py)
    workload: UserWorkload
    specs: list[GroupSpec]            # every group of the job, the control and snapshot groups included
    @property
    def role(self) -> str: ...       # "worker" or "standby": derived from `state` (rankstate.role_of)
    state: RankStateMachine            # changed through its own transitions (rankstate.py)
    store: AuthStore                  # the job's rendezvous store (moves with the controller)
    store_addr: tuple[str, int]

    # What changes as it moves through its roles: read-only here; a role hands the process a
    # change (`apply`, runtime/changes.py) and the process writes these fields, nobody else.
    @property
    def rank(self) -> int | None: ...              # None: a standby that has not taken a rank
    @property
    def groups(self) -> dict[str, SwappableGroup]: ...
    @property
    def completed(self) -> int: ...                # steps whose updates this rank's state holds
    @property
    def pending(self) -> phase1.Prepared | None: ...  # a planned migration's Phase 1, until it switches or is aborted
    @property
    def joining(self) -> int: ...                  # a standby: the epoch it is joining (0: none)
    @property
    def switched_epoch(self) -> int: ...           # the epoch of its last switch
    @property
    def step_reports(self) -> deque[Message]: ...  # step reports kept for a restarted controller
    @property
    def trace_steps(self) -> int: ...              # steps after a switch whose timings are still logged

    def apply(self, change: Change) -> None: ...

    def send(self, kind: str, *, enter: RankState | None = None, **fields: Any) -> None: ...
    def retire(self, old: object, step: int) -> None: ...
    def release_retired(self, step: int) -> None: ...
    def build_backend(self, name: str, prefix: str, grank: int, size: int,
                      store: AuthStore | None = None) -> object: ...
    def phase1_builder(self) -> phase1.Builder: ...
    def make_groups(self, rank: int, sandbox: bool) -> dict[str, SwappableGroup]: ...
    def build_context(self, rank: int) -> BuildContext: ...
    def full_state(self, step: int) -> dict[str, Any]: ...
    def replica_state(self, step: int) -> dict[str, Any]: ...
    def load_full(self, state: dict[str, Any]) -> None: ...
    def digest(self) -> str: ...
    def memory(self) -> dict[str, Any]: ...
    def comms_created(self) -> int: ...
    def trace_next_steps(self) -> None: ...
