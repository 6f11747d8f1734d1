"""What a GPU source read on this node: plain values, no judgement.

The NVML and DCGM readers (nvml.py, dcgm.py) and the dry run's recorded file (source.py)
all produce a `NodeReading`; the fault-injection hook (inject.py) rewrites one; verdict.py
judges one against the state kept from the previous run. Keeping the reading a plain value
is what lets an injected fault flow through the same decision code as a real one, and lets
tests replay recorded counter sequences.

Counters are cumulative (since the driver loaded), keyed by link then by counter kind:
links are "nvlink0".."nvlink17" and "pcie"; kinds are COUNTER_KINDS.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

# NVLink data-link-layer counters (NVML_NVLINK_ERROR_DL_*) and the PCIe replay counter.
COUNTER_KINDS = ("crc_flit", "crc_data", "replay", "recovery", "pcie_replay")

Counters = Mapping[str, Mapping[str, int]]  # link -> kind -> cumulative count


def link_label(link: str) -> str:
    """"nvlink3" -> "NVLink 3", "pcie" -> "PCIe" (for reports)."""
    if link.startswith("nvlink"):
        return f"NVLink {link[len('nvlink'):]}"
    return "PCIe" if link == "pcie" else link


@dataclass(frozen=True)
class Incident:
    """A DCGM health-watch incident: the system DCGM names ("Memory system", "NVLINK
    system", ...), its health ("Warning" or "Failure") and DCGM's message."""
    system: str
    health: str
    message: str


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    pci: str = ""
    lost: bool = False              # fallen off the bus (NVML_ERROR_GPU_IS_LOST)
    ecc_uncorrected: int = 0        # volatile uncorrected ECC errors (since the driver loaded)
    remap_failed: bool = False      # row remapping failed (no spare row left)
    retire_pending: bool = False    # a page retirement or row remap waits for a GPU reset
    recovery_action: int = 0        # NVML's GPU recovery action: 0 none, 1 reset, 2 reboot, 3 drain P2P, 4 drain+reset
    throttle: tuple[str, ...] = ()  # hardware slowdowns active right now
    counters: Counters = field(default_factory=dict)
    incidents: tuple[Incident, ...] = ()

    @property
    def name(self) -> str:
        return f"GPU {self.index}"


@dataclass(frozen=True)
class XidEvent:
    xid: int
    where: str                  # PCI address, or "GPU <index>"
    seq: Optional[int] = None   # kernel log sequence number; None: seen live (NVML) or injected
    source: str = "kernel log"  # "kernel log" | "NVML" | "injected"

    def line(self) -> str:
        where = f"PCI {self.where}" if ":" in self.where else self.where
        return f"XID {self.xid} on {where} ({self.source})"


@dataclass(frozen=True)
class NodeReading:
    source: str                          # "nvml", "dcgm+nvml", "fake:<file> (dry run)"
    gpus: tuple[GpuReading, ...] = ()
    xids: tuple[XidEvent, ...] = ()
    boot_id: str = ""                    # /proc/sys/kernel/random/boot_id: counters restart with a boot
    notes: tuple[str, ...] = ()          # what could not be read, and why
    error: str = ""                      # the source could not read the GPUs at all (driver gone?)

    def gpu(self, index: int) -> Optional[GpuReading]:
        return next((g for g in self.gpus if g.index == index), None)

    def with_gpu(self, gpu: GpuReading) -> "NodeReading":
        gpus = tuple(gpu if g.index == gpu.index else g for g in self.gpus)
        if gpu.index not in {g.index for g in self.gpus}:
            gpus += (gpu,)
        return replace(self, gpus=gpus)


# ---- JSON form: the dry run's fake source and recorded counter sequences in tests ----------

def reading_to_dict(r: NodeReading) -> dict:
    return {"source": r.source, "boot_id": r.boot_id, "notes": list(r.notes), "error": r.error,
            "xids": [{"xid": x.xid, "where": x.where, "seq": x.seq, "source": x.source} for x in r.xids],
            "gpus": [{"index": g.index, "uuid": g.uuid, "pci": g.pci, "lost": g.lost,
                      "ecc_uncorrected": g.ecc_uncorrected, "remap_failed": g.remap_failed,
                      "retire_pending": g.retire_pending, "recovery_action": g.recovery_action,
                      "throttle": list(g.throttle),
                      "counters": {link: dict(kinds) for link, kinds in g.counters.items()},
                      "incidents": [vars(i) for i in g.incidents]} for g in r.gpus]}


def reading_from_dict(d: Mapping[str, Any], source: Optional[str] = None) -> NodeReading:
    """The inverse of reading_to_dict; raises ValueError on a malformed document."""
    try:
        gpus = tuple(GpuReading(
            index=int(g["index"]), uuid=str(g.get("uuid") or f"GPU-{g['index']}"), pci=str(g.get("pci", "")),
            lost=bool(g.get("lost", False)), ecc_uncorrected=int(g.get("ecc_uncorrected", 0)),
            remap_failed=bool(g.get("remap_failed", False)), retire_pending=bool(g.get("retire_pending", False)),
            recovery_action=int(g.get("recovery_action", 0)),
            throttle=tuple(g.get("throttle", ())),
            counters={str(link): {str(k): int(v) for k, v in kinds.items()}
                      for link, kinds in (g.get("counters") or {}).items()},
            incidents=tuple(Incident(**i) for i in g.get("incidents", ())))
            for g in d.get("gpus", ()))
        xids = tuple(XidEvent(int(x["xid"]), str(x.get("where", "")), x.get("seq"), str(x.get("source", "kernel log")))
                     for x in d.get("xids", ()))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a GPU reading: {type(exc).__name__}: {exc}") from None
    return NodeReading(source=source or str(d.get("source", "recorded")), gpus=gpus, xids=xids,
                       boot_id=str(d.get("boot_id", "")), notes=tuple(d.get("notes", ())),
                       error=str(d.get("error", "")))
