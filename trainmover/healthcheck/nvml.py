"""The NVML reader: one NodeReading from the `pynvml` module (nvidia-ml-py), or from any
object with the same functions (tests pass a fake).

Per GPU: UUID and PCI address; volatile uncorrected ECC errors; pending page retirement;
row remapping pending/failed; the driver's recovery action (reset/reboot needed, where the
driver reports one); hardware slowdowns active now; per active NVLink the
data-link-layer counters (replay, recovery, CRC flit, CRC data) and the PCIe replay counter.
A query that raises NVML_ERROR_GPU_IS_LOST marks the GPU lost (fallen off the bus); one the
GPU does not support is left out. Critical XIDs that NVML reports while it listens (a short
window) are added as live events. Nothing is judged here (verdict.py does).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from trainmover.healthcheck.readings import GpuReading, NodeReading, XidEvent

NVML_ERROR_GPU_IS_LOST = 15
NVLINK_COUNTERS = (("replay", "NVML_NVLINK_ERROR_DL_REPLAY"), ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"),
                   ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"), ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA"))
HW_SLOWDOWNS = (("HW slowdown", "nvmlClocksThrottleReasonHwSlowdown", 0x8),
                ("HW thermal", "nvmlClocksThrottleReasonHwThermalSlowdown", 0x40),
                ("HW power brake", "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", 0x80))


class GpuLost(Exception):
    pass


def load() -> tuple[Optional[Any], str]:
    """(pynvml initialised, "") ; (pynvml, why) when NVML is there but does not initialise
    (driver gone: a fault if GPUs were seen before); (None, why) when pynvml is not there."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "NVML not available (pynvml/nvidia-ml-py not importable): no GPU checks"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return pynvml, f"NVML did not initialise ({exc})"
    return pynvml, ""


def shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass


def _lost_code(nvml: Any) -> int:
    return getattr(nvml, "NVML_ERROR_GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST)


def _query(nvml: Any, fn: Callable[[], Any]) -> Any:
    """An NVML query; None where the GPU does not support it; GpuLost where the GPU is gone."""
    try:
        return fn()
    except Exception as exc:
        if getattr(exc, "value", None) == _lost_code(nvml) or "GpuIsLost" in type(exc).__name__:
            raise GpuLost() from exc
        return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v or "")


def read(nvml: Any, *, xid_window_ms: int = 200, boot_id: str = "") -> NodeReading:
    """Read every GPU NVML lists (nvmlInit already done)."""
    n = nvml.nvmlDeviceGetCount()
    gpus, handles = [], []
    for i in range(n):
        g, h = read_gpu(nvml, i)
        gpus.append(g)
        if h is not None:
            handles.append((i, h))
    xids, notes = _xid_events(nvml, handles, xid_window_ms)
    return NodeReading(source="nvml", gpus=tuple(gpus), xids=tuple(xids), boot_id=boot_id, notes=tuple(notes))


def read_gpu(nvml: Any, i: int) -> tuple[GpuReading, Any]:
    uuid, pci, h = f"GPU-index-{i}", "", None
    try:
        h = _query(nvml, lambda: nvml.nvmlDeviceGetHandleByIndex(i))
        if h is None:
            raise GpuLost()  # listed but no handle: the driver cannot reach it
        uuid = _text(_query(nvml, lambda: nvml.nvmlDeviceGetUUID(h))) or uuid
        info = _query(nvml, lambda: nvml.nvmlDeviceGetPciInfo(h))
        pci = _text(getattr(info, "busId", "")) if info is not None else ""
        ecc = _query(nvml, lambda: nvml.nvmlDeviceGetTotalEccErrors(
            h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)) or 0
        retire = bool(_query(nvml, lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)))
        remap = _query(nvml, lambda: nvml.nvmlDeviceGetRemappedRows(h))  # (corr, unc, pending, failed)
        remap_pending = bool(remap and len(remap) >= 3 and remap[2])
        remap_failed = bool(remap and len(remap) >= 4 and remap[3])
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        reasons = (_query(nvml, lambda: reasons_fn(h)) if reasons_fn else 0) or 0
        throttle = tuple(name for name, attr, bit in HW_SLOWDOWNS if reasons & getattr(nvml, attr, bit))
        action = _recovery_action(nvml, h)
        counters = _link_counters(nvml, h)
    except GpuLost:
        return GpuReading(index=i, uuid=uuid, pci=pci, lost=True), None
    return GpuReading(index=i, uuid=uuid, pci=pci, ecc_uncorrected=int(ecc), remap_failed=remap_failed,
                      retire_pending=retire or remap_pending, recovery_action=action, throttle=throttle,
                      counters=counters), h


def _recovery_action(nvml: Any, h: Any) -> int:
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION where the driver has it (0 elsewhere)."""
    fid = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if fid is None or not hasattr(nvml, "nvmlDeviceGetFieldValues"):
        return 0
    values = _query(nvml, lambda: nvml.nvmlDeviceGetFieldValues(h, [fid]))
    try:
        v = values[0]
        return int(v.value.uiVal) if getattr(v, "nvmlReturn", 1) == 0 else 0
    except (TypeError, IndexError, AttributeError, ValueError):
        return 0


def _link_counters(nvml: Any, h: Any) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _query(nvml, lambda: nvml.nvmlDeviceGetNvLinkState(h, link))
        if state is None and link == 0:
            break  # no NVLink on this GPU
        if not state:  # 0: inactive (1 active; 2, where drivers report it, asleep: counters still count)
            continue
        kinds = {}
        for kind, const in NVLINK_COUNTERS:
            if hasattr(nvml, const):
                v = _query(nvml, lambda: nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, getattr(nvml, const)))
                if v is not None:
                    kinds[kind] = int(v)
        out[f"nvlink{link}"] = kinds
    if hasattr(nvml, "nvmlDeviceGetPcieReplayCounter"):
        v = _query(nvml, lambda: nvml.nvmlDeviceGetPcieReplayCounter(h))
        if v is not None:
            out["pcie"] = {"pcie_replay": int(v)}
    return out


def _xid_events(nvml: Any, handles: list, window_ms: int) -> tuple[list[XidEvent], list[str]]:
    """XIDs NVML reports during `window_ms` (it only reports those that happen while it listens)."""
    if not handles or not hasattr(nvml, "nvmlEventSetCreate"):
        return [], []
    try:
        es = nvml.nvmlEventSetCreate()
    except Exception as exc:
        return [], [f"NVML events not available ({exc}): XIDs from the kernel log only"]
    out: list[XidEvent] = []
    try:
        for _, h in handles:
            try:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, es)
            except Exception:
                pass
        deadline = time.monotonic() + window_ms / 1000
        while (left := deadline - time.monotonic()) > 0:
            try:
                data = nvml.nvmlEventSetWait(es, max(1, int(left * 1000)))
            except Exception:  # NVML_ERROR_TIMEOUT: nothing happened
                break
            info = None
            try:
                info = nvml.nvmlDeviceGetPciInfo(data.device)
            except Exception:
                pass
            where = _text(getattr(info, "busId", "")) or "a GPU"
            out.append(XidEvent(int(data.eventData), where, None, "NVML"))
    finally:
        try:
            nvml.nvmlEventSetFree(es)
        except Exception:
            pass
    return out, []
