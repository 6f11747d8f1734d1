"""GPU checks through NVML (the `pynvml` module of nvidia-ml-py), when it imports and
finds a driver; skipped with a note otherwise.

Per GPU: uncorrected volatile ECC errors, pending page retirement, failed row remapping,
hardware throttling (HW slowdown, thermal, power brake), NVLink CRC/replay/recovery error
counters above a threshold; and critical XID events, read from NVML's event set during a
short window (NVML only reports XIDs that happen while it listens) and from the kernel log
(`NVRM: Xid` lines in /dev/kmsg, from a cursor kept in the state directory).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Optional

from trainmover.healthcheck.checks import Finding

# XIDs that mean the GPU or its memory needs attention (NVIDIA's XID catalogue):
# 48 DBE ECC, 63/64 row remapping/page retirement, 74 NVLink, 79 fallen off the bus,
# 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")
NVLINK_ERROR_THRESHOLD = 100


def load_nvml() -> tuple[Optional[Any], str]:
    """(pynvml module initialised, "") or (None, why it is skipped)."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "NVML not available (pynvml/nvidia-ml-py not importable): no GPU checks"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML did not initialise ({exc}): no GPU on this node?"
    return pynvml, ""


def _try(fn: Callable[[], Any]) -> Any:
    """An NVML query, or None where the GPU does not support it."""
    try:
        return fn()
    except Exception:
        return None


def check_gpus(nvml: Any, *, xid_window_ms: int = 200) -> list[Finding]:
    n = nvml.nvmlDeviceGetCount()
    if n == 0:
        return [Finding("gpu", True, "NVML reports no GPU", skipped=True)]
    out: list[Finding] = []
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    for i, h in enumerate(handles):
        problems = []
        ecc = _try(lambda: nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                            nvml.NVML_VOLATILE_ECC))
        if ecc:
            problems.append(f"{ecc} uncorrected ECC errors")
        if _try(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)):
            problems.append("retired pages pending (reset needed)")
        remap = _try(lambda: nvml.nvmlDeviceGetRemappedRows(h))
        if remap and len(remap) >= 4 and remap[3]:
            problems.append("row remapping failed")
        reasons = _try(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)) or 0
        hw = {"HW slowdown": getattr(nvml, "nvmlClocksThrottleReasonHwSlowdown", 0x8),
              "HW thermal": getattr(nvml, "nvmlClocksThrottleReasonHwThermalSlowdown", 0x40),
              "HW power brake": getattr(nvml, "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", 0x80)}
        throttled = [name for name, bit in hw.items() if reasons & bit]
        if throttled:
            problems.append("throttled: " + ", ".join(throttled))
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            if _try(lambda: nvml.nvmlDeviceGetNvLinkState(h, link)) != 1:
                continue
            errors = 0
            for counter in ("NVML_NVLINK_ERROR_DL_REPLAY", "NVML_NVLINK_ERROR_DL_RECOVERY",
                            "NVML_NVLINK_ERROR_DL_CRC_FLIT", "NVML_NVLINK_ERROR_DL_CRC_DATA"):
                if hasattr(nvml, counter):
                    errors += _try(lambda: nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, getattr(nvml, counter))) or 0
            if errors > NVLINK_ERROR_THRESHOLD:
                problems.append(f"NVLink {link}: {errors} errors")
        out.append(Finding("gpu", not problems, f"GPU {i}: " + ("; ".join(problems) if problems else "healthy")))
    out += _xid_events(nvml, handles, xid_window_ms)
    return out


def _xid_events(nvml: Any, handles: list, window_ms: int) -> list[Finding]:
    if not hasattr(nvml, "nvmlEventSetCreate"):
        return []
    es = _try(nvml.nvmlEventSetCreate)
    if es is None:
        return []
    try:
        for h in handles:
            _try(lambda: nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, es))
        data = _try(lambda: nvml.nvmlEventSetWait(es, window_ms))
        if data is not None and int(data.eventData) in CRITICAL_XIDS:
            return [Finding("gpu", False, f"XID {int(data.eventData)} reported by NVML")]
        return []
    finally:
        _try(lambda: nvml.nvmlEventSetFree(es))


def parse_kmsg_xids(records: list[str]) -> list[tuple[int, str, int]]:
    """(sequence number, PCI address, xid) of each `NVRM: Xid` record of /dev/kmsg
    (records look like 'PRIO,SEQ,USEC,FLAGS;message')."""
    out = []
    for rec in records:
        head, _, msg = rec.partition(";")
        m = XID_RE.search(msg)
        fields = head.split(",")
        if m and len(fields) >= 2 and fields[1].isdigit():
            out.append((int(fields[1]), m.group(1), int(m.group(2))))
    return out


def read_kmsg(path: str = "/dev/kmsg", limit: int = 100000) -> list[str]:
    """Every record in the kernel ring buffer, without blocking."""
    records = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return records
    try:
        while len(records) < limit:
            try:
                records.append(os.read(fd, 8192).decode("utf-8", "replace"))
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
    finally:
        os.close(fd)
    return records


def check_kernel_xids(records: list[str], cursor_file: Optional[Path]) -> list[Finding]:
    """Critical XIDs logged by the driver since the last run (the cursor file holds the
    last sequence number seen; without one, every XID in the ring buffer counts)."""
    last = -1
    if cursor_file is not None:
        try:
            last = int(cursor_file.read_text().strip() or -1)
        except (FileNotFoundError, ValueError):
            last = -1
    xids = parse_kmsg_xids(records)
    new = [(seq, pci, xid) for seq, pci, xid in xids if seq > last and xid in CRITICAL_XIDS]
    if cursor_file is not None and xids:
        try:
            cursor_file.write_text(str(max(seq for seq, _, _ in xids)))
        except OSError:
            pass
    return [Finding("gpu", False, f"XID {xid} on PCI {pci} (kernel log)") for _, pci, xid in new]
