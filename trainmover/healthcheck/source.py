"""Where the GPU reading comes from, behind one narrow interface: `source.read()` returns a
NodeReading (readings.py) or raises Unavailable (then the GPU checks are skipped with a note).

  nvml       NVML through pynvml, plus XIDs from the kernel log
  dcgm       DCGM health watches (dcgmi) on top of the NVML reading: the report's source says
             "dcgm+nvml"; where dcgmi answers with an error, NVML alone, with a note
  auto       dcgm where `dcgmi` is on the PATH, nvml otherwise (the default)
  file:PATH  a recorded reading (JSON, readings.reading_to_dict): the dry run's stand-in for
             the GPUs, labelled "(dry run)" in the report; XIDs come from the file only
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Protocol

from trainmover.healthcheck import dcgm, kmsg, nvml
from trainmover.healthcheck.readings import GpuReading, NodeReading, reading_from_dict

SPECS = ("auto", "nvml", "dcgm", "file:PATH")


class Unavailable(Exception):
    """No GPU reading can be had here (no pynvml, no dcgmi): GPU checks are skipped."""


class Source(Protocol):
    def read(self) -> NodeReading: ...


class NvmlSource:
    def __init__(self, xid_window_ms: int = 200, kmsg_path: str = "/dev/kmsg",
                 boot_id_path: str = kmsg.BOOT_ID_PATH) -> None:
        self.xid_window_ms, self.kmsg_path, self.boot_id_path = xid_window_ms, kmsg_path, boot_id_path

    def read(self) -> NodeReading:
        lib, why = nvml.load()
        if lib is None:
            raise Unavailable(why)
        boot = kmsg.boot_id(self.boot_id_path)
        xids = tuple(kmsg.parse_xids(kmsg.read_kmsg(self.kmsg_path)))
        if why:  # pynvml is there but the driver does not answer
            return NodeReading(source="nvml", xids=xids, boot_id=boot, error=why)
        try:
            r = nvml.read(lib, xid_window_ms=self.xid_window_ms, boot_id=boot)
        finally:
            nvml.shutdown(lib)
        return replace(r, xids=xids + r.xids)


class DcgmSource:
    def __init__(self, base: Source, run: dcgm.RunDcgmi = dcgm.run_dcgmi) -> None:
        self.base, self.run = base, run

    def read(self) -> NodeReading:
        base_note = ""
        try:
            reading: Optional[NodeReading] = self.base.read()
        except Unavailable as exc:
            reading, base_note = None, str(exc)
        try:
            incidents, notes = dcgm.read_incidents(self.run)
        except dcgm.DcgmError as exc:
            if reading is None:
                raise Unavailable(f"{base_note}; DCGM: {exc}") from None
            return replace(reading, notes=reading.notes + (f"DCGM not used ({exc}): NVML only",))
        if reading is None:  # DCGM alone: GPUs as DCGM names them, no link counters
            gpus = tuple(GpuReading(index=i, uuid=f"dcgm-gpu-{i}", incidents=tuple(inc))
                         for i, inc in sorted(incidents.items()))
            return NodeReading(source="dcgm", gpus=gpus, boot_id=kmsg.boot_id(),
                               notes=(base_note + ": link counters not read", *notes))
        by_index, stray = dcgm.merge(incidents, [g.index for g in reading.gpus])
        gpus = tuple(replace(g, incidents=g.incidents + by_index.get(g.index, ())) for g in reading.gpus)
        return replace(reading, source="dcgm+nvml", gpus=gpus,
                       notes=reading.notes + tuple(notes) + ((stray,) if stray else ()))


class FileSource:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def read(self) -> NodeReading:
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise Unavailable(f"recorded reading {self.path}: {exc}") from None
        try:
            return reading_from_dict(doc, source=f"file:{self.path} (dry run)")
        except ValueError as exc:
            raise Unavailable(f"recorded reading {self.path}: {exc}") from None


def choose(spec: str = "auto", which: Callable[[str], Optional[str]] = shutil.which) -> Source:
    """The source named by `spec` (one of SPECS); ValueError for an unknown one."""
    if spec.startswith("file:") and len(spec) > len("file:"):
        return FileSource(Path(spec[len("file:"):]))
    if spec == "nvml":
        return NvmlSource()
    if spec == "dcgm" or (spec == "auto" and which("dcgmi")):
        return DcgmSource(NvmlSource())
    if spec == "auto":
        return NvmlSource()
    raise ValueError(f"unknown GPU source {spec!r}: one of {', '.join(SPECS)}")
