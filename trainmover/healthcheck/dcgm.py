"""DCGM health watches through `dcgmi` (where DCGM's nv-hostengine runs): the incidents of
`dcgmi health -g 0 -c -j`, per GPU, become `Incident`s of the NVML reading of the same GPU
(DCGM's GPU ids are NVML's indices). NVML still reads the link counters, which rates.py
judges: DCGM fails a link on any replay or recovery in its window, which is the false drain
this check avoids, so verdict.py keeps DCGM's NVLink incidents as warnings.

When no watch is set on the group, this sets all of them (`dcgmi health -g 0 -s a`): DCGM
then reports from the next run on. Every `dcgmi` call goes through `run_dcgmi` (no shell,
a timeout). The JSON layout parsed here is dcgmi's own (DcgmiOutputJson: body -> "GPU" ->
<id> -> "Errors" -> <system> with value and overflow lines); tests hold a recorded sample.
"""
from __future__ import annotations

import json
import subprocess
from typing import Callable, Optional, Sequence

from trainmover.healthcheck.readings import Incident

DCGMI_TIMEOUT_S = 2.0  # two calls at most: within the checks' 6 s with NVML's reading
GROUP = "0"  # dcgmi's group of all GPUs

RunDcgmi = Callable[[Sequence[str], float], tuple[int, str]]


class DcgmError(Exception):
    pass


def run_dcgmi(args: Sequence[str], timeout: float = DCGMI_TIMEOUT_S, exe: str = "dcgmi") -> tuple[int, str]:
    """(exit status, stdout+stderr) of `dcgmi args`; DcgmError when it cannot run or times out."""
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DcgmError(f"dcgmi {' '.join(args)} did not answer within {timeout:g}s") from None
    except OSError as exc:
        raise DcgmError(f"dcgmi {' '.join(args)}: {exc.strerror or exc}") from None
    return p.returncode, p.stdout + p.stderr


def parse_health(text: str) -> tuple[str, dict[int, list[Incident]]]:
    """(overall health, incidents by GPU id) of `dcgmi health -c -j` output."""
    start = text.find("{")
    if start < 0:
        raise DcgmError(f"dcgmi health printed no JSON: {text.strip()[:200]!r}")
    try:
        doc = json.loads(text[start:])
        body = doc["body"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DcgmError(f"dcgmi health JSON not understood ({type(exc).__name__}: {exc})") from None
    overall = str((body.get("Overall Health") or {}).get("value", "")).strip()
    out: dict[int, list[Incident]] = {}
    for gpu_id, entity in ((body.get("GPU") or {}).get("children") or {}).items():
        errors = ((entity.get("children") or {}).get("Errors") or {}).get("children") or {}
        for system, node in errors.items():
            lines = [str(x.get("value", x)) if isinstance(x, dict) else str(x) for x in node.get("overflow", [])]
            message = " ".join(" ".join(lines).split()) or "(no message)"
            try:
                out.setdefault(int(gpu_id), []).append(Incident(system, str(node.get("value", "")).strip(), message))
            except ValueError:
                continue  # not a GPU id
    return overall, out


def read_incidents(run: RunDcgmi = run_dcgmi) -> tuple[dict[int, list[Incident]], list[str]]:
    """DCGM's health incidents by GPU id, and notes."""
    rc, out = run(["health", "-g", GROUP, "-c", "-j"], DCGMI_TIMEOUT_S)
    if "watches not enabled" in out.lower():
        rc2, out2 = run(["health", "-g", GROUP, "-s", "a"], DCGMI_TIMEOUT_S)
        if rc2 != 0:
            raise DcgmError(f"no DCGM health watch set, and setting them failed: {out2.strip()[:200]}")
        return {}, ["DCGM health watches were not set: set them all (dcgmi health -g 0 -s a); "
                    "DCGM reports from the next run"]
    if rc != 0:
        raise DcgmError(f"dcgmi health -c exited {rc}: {out.strip()[:200]}")
    overall, incidents = parse_health(out)
    return incidents, [] if incidents or overall in ("", "Healthy") else [f"DCGM overall health: {overall}"]


def merge(incidents: dict[int, list[Incident]], gpu_ids: Sequence[int]) -> tuple[dict[int, tuple[Incident, ...]], Optional[str]]:
    """Incidents by NVML index, and a note for DCGM GPU ids NVML does not list."""
    by_index = {i: tuple(incidents.get(i, ())) for i in gpu_ids}
    stray = sorted(set(incidents) - set(gpu_ids))
    note = f"DCGM reports GPU id(s) {stray} that NVML does not list" if stray else None
    return by_index, note
