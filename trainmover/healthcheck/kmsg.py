"""XIDs from the kernel log: the driver writes `NVRM: Xid (PCI:<addr>): <n>, ...` records to
/dev/kmsg, each with a sequence number that restarts with every boot (verdict.py keeps the
last one seen, with the boot id, so that each XID is judged once)."""
from __future__ import annotations

import os
import re

from trainmover.healthcheck.readings import XidEvent

XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def parse_xids(records: list[str]) -> list[XidEvent]:
    """The XIDs of /dev/kmsg records (records look like 'PRIO,SEQ,USEC,FLAGS;message')."""
    out = []
    for rec in records:
        head, _, msg = rec.partition(";")
        m = XID_RE.search(msg)
        fields = head.split(",")
        if m and len(fields) >= 2 and fields[1].isdigit():
            out.append(XidEvent(int(m.group(2)), m.group(1), int(fields[1]), "kernel log"))
    return out


def read_kmsg(path: str = "/dev/kmsg", limit: int = 100000) -> list[str]:
    """Every record in the kernel ring buffer, without blocking ([] where it cannot be read)."""
    records: list[str] = []
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


def boot_id(path: str = BOOT_ID_PATH) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
