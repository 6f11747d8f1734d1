"""A node's GPU reading against the state of the last run -> findings and the state to keep.
Pure: the clock is an argument and nothing is read or written here.

Two kinds of evidence, kept apart as DCGM's health watches keep them:
  * fatal signs fail at once: uncorrectable ECC errors, failed row remapping, a pending page
    retirement or row remap (reset needed), a recovery action the driver asks for (reset,
    reboot), a GPU fallen off the bus (NVML says it is lost,
    or fewer GPUs answer than at the last run), a DCGM health-watch failure outside NVLink,
    and critical XIDs logged since the last run;
  * link error counters are judged by rate (rates.py): above the threshold of their kind
    they fail, below it a rise is a warning.
Warnings (HW throttling, a rise under threshold, a link gone inactive, a non-critical XID,
DCGM warnings and NVLink incidents) are reported and never drain.

The first run on a node (no state, or a state set aside) takes a baseline: counters are not
judged, and XIDs already in the kernel log are noted, not failed, since they may predate a
repair. Fatal signs still fail on a first run: they describe the GPU now, not its history.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trainmover.healthcheck.checks import Finding
from trainmover.healthcheck.rates import RatePolicy, judge_counters
from trainmover.healthcheck.readings import GpuReading, NodeReading, XidEvent, link_label
from trainmover.healthcheck.state import GpuState, NodeState

# XIDs that mean the GPU or its memory needs attention (NVIDIA's XID catalogue):
# 48 DBE ECC, 63/64 row remapping pending/failed, 74 NVLink, 79 fallen off the bus,
# 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values that need the GPU out of service (3, "drain
# peer-to-peer traffic then ask again", is transient: a warning).
RECOVERY_ACTIONS_FATAL = {1: "GPU reset", 2: "node reboot", 4: "drain and GPU reset"}
# DCGM fails a link on any replay or recovery in its window (the false drain this check
# exists to avoid): its NVLink incidents are warnings here, our rate logic judges the links.
DCGM_SYSTEMS_AS_WARNINGS = ("NVLINK",)


@dataclass(frozen=True)
class Policy:
    rates: RatePolicy = field(default_factory=RatePolicy)
    critical_xids: frozenset[int] = CRITICAL_XIDS


@dataclass(frozen=True)
class Verdict:
    findings: tuple[Finding, ...]
    state: NodeState
    notes: tuple[str, ...]


def judge(prev: Optional[NodeState], reading: NodeReading, now: float, policy: Policy = Policy()) -> Verdict:
    notes = list(reading.notes)
    rebooted = bool(prev and prev.boot_id and reading.boot_id and prev.boot_id != reading.boot_id)
    if rebooted:
        notes.append("the node rebooted since the last run: new counter baseline")
    findings: list[Finding] = []
    gpus: dict[str, GpuState] = {}
    for g in reading.gpus:
        kept = None if prev is None or rebooted else prev.gpus.get(g.uuid)
        if prev is not None and not rebooted and kept is None:
            notes.append(f"{g.name} ({g.uuid}) is new since the last run: baseline taken")
        finding, warnings, state, gpu_notes = _judge_gpu(g, kept, now, policy)
        findings.append(finding)
        findings += warnings
        notes += gpu_notes
        gpus[g.uuid] = state
    missing = _missing_gpus(prev, reading, gpus)
    findings += missing
    if reading.error and not missing:
        findings.append(Finding("gpu", True, reading.error, skipped=True))
    xid_findings, kmsg_seq, xid_notes = _judge_xids(prev, reading.xids, rebooted, policy)
    findings += xid_findings
    notes += xid_notes
    return Verdict(tuple(findings), NodeState(reading.boot_id, now, gpus, kmsg_seq), tuple(notes))


def _judge_gpu(g: GpuReading, kept: Optional[GpuState], now: float, policy: Policy):
    faults: list[str] = []
    warnings: list[str] = []
    evidence: list[dict] = []
    if g.lost:
        faults.append("fallen off the bus (NVML: GPU is lost)")
    if g.ecc_uncorrected > 0:
        faults.append(f"uncorrectable ECC errors: {g.ecc_uncorrected}")
    if g.remap_failed:
        faults.append("row remapping failed")
    if g.retire_pending:
        faults.append("page retirement or row remap pending (GPU reset needed)")
    if g.recovery_action in RECOVERY_ACTIONS_FATAL:
        faults.append(f"driver asks for a recovery action: {RECOVERY_ACTIONS_FATAL[g.recovery_action]}")
    elif g.recovery_action:
        warnings.append(f"driver recovery action {g.recovery_action} (drain peer-to-peer traffic)")
    for inc in g.incidents:
        text = f"DCGM {inc.system}: {inc.health}: {inc.message}"
        fatal = inc.health.lower().startswith("fail") and not inc.system.upper().startswith(DCGM_SYSTEMS_AS_WARNINGS)
        (faults if fatal else warnings).append(text)
    if g.throttle:
        warnings.append("throttled: " + ", ".join(g.throttle))
    notes: list[str] = []
    if g.lost:  # its counters cannot be read: keep the bases it had
        state = GpuState(g.index, g.pci, kept.bases if kept else {})
    else:
        cv = judge_counters(kept.bases if kept else None, g.counters, now, policy.rates, who=g.name)
        notes += cv.notes
        for r in cv.rates:
            (faults if r.exceeded else warnings).append(r.text())
            evidence.append({"gpu": g.index, "uuid": g.uuid, **r.evidence(), "fault": r.exceeded})
        warnings += [f"{link_label(link)} is not active now (it was at an earlier run)"
                     for link in cv.gone if link.startswith("nvlink")]
        state = GpuState(g.index, g.pci, cv.bases)
    if faults:
        finding = Finding("gpu", False, f"{g.name}: " + "; ".join(faults), evidence=tuple(evidence))
    else:
        links = sum(1 for link in g.counters if link.startswith("nvlink"))
        how = "baseline taken" if kept is None else "rates judged"
        finding = Finding("gpu", True, f"{g.name}: healthy ({links} NVLinks, {how})", evidence=tuple(evidence))
    warning_findings = [Finding("gpu", True, f"{g.name}: warning: {w}", warning=True) for w in warnings]
    return finding, warning_findings, state, notes


def _missing_gpus(prev: Optional[NodeState], reading: NodeReading, gpus: dict[str, GpuState]) -> list[Finding]:
    """A GPU that fell off the bus often vanishes from the driver's list (after a reload or a
    reboot it is not enumerated). Fewer GPUs than at the last run is a fault, kept in the state
    so that it stays one until an admin removes the state file; the same count with other UUIDs
    (a GPU swapped in maintenance) is a new baseline."""
    if prev is None:
        return []
    missing = {u: g for u, g in prev.gpus.items() if u not in gpus}
    if not missing:
        return []
    if len(gpus) >= len(prev.gpus) and not reading.error:
        return []
    out = []
    for uuid, g in sorted(missing.items(), key=lambda kv: kv[1].index):
        gpus[uuid] = g
        why = f" ({reading.error})" if reading.error else ""
        out.append(Finding("gpu", False, f"GPU {g.index} ({uuid}, PCI {g.pci or '?'}) answered at the last run "
                           f"and is missing now{why}: fallen off the bus?"))
    return out


def _judge_xids(prev: Optional[NodeState], xids: tuple[XidEvent, ...], rebooted: bool, policy: Policy):
    """Critical XIDs since the last run fail; the kernel log cursor moves past what was seen."""
    logged = [x for x in xids if x.seq is not None]
    cursor = -1 if prev is None or rebooted else prev.kmsg_seq
    new_cursor = max([cursor, *(x.seq for x in logged)])
    notes: list[str] = []
    if prev is None:  # first run: what the log holds may predate a repair
        old = [x for x in logged if x.xid in policy.critical_xids]
        if old:
            notes.append("first run: critical XIDs already in the kernel log, not judged: "
                         + ", ".join(x.line() for x in old[:5]))
        fresh = [x for x in xids if x.seq is None]
    else:
        fresh = [x for x in xids if x.seq is None or x.seq > cursor]
    findings = [Finding("gpu", False, x.line()) if x.xid in policy.critical_xids
                else Finding("gpu", True, f"warning: {x.line()} (not a critical XID)", warning=True) for x in fresh]
    return findings, new_cursor, notes
