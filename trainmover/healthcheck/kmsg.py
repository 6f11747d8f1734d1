"""XIDs from the kernel log: the driver writes `NVRM: Xid (PCI:<addr>): <n>, ...` records to
/dev/kmsg, each with a sequence number that restarts with every boot (verdict.py keeps the
last one seen, with the boot id, so that each XID is judged once).

Only lines the kernel's NVIDIA driver wrote are judged (root drains a node on them, and users
can put text into the kernel log; issue 37):
* the record's facility must be the kernel's (0): a record written to /dev/kmsg from user space
  never has it (the kernel gives such a record LOG_USER unless the writer names another
  non-zero facility);
* the pattern must stand at the start of the message text: the kernel prints user-chosen text
  inside its own lines (a segfaulting program's name and file name: `prog[12]: segfault at 0
  ... in NVRM: Xid (PCI:...)...`, `traps: NVRM: Xid ...`). Such a line starts with the
  kernel's words or with the program's name (`comm`, at most 15 characters), and the
  anchored pattern needs more than 15 of the driver's characters before its first group.
"""
from __future__ import annotations

import os
import re

from trainmover.healthcheck.readings import XidEvent

XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")  # matched at the start only
KERNEL_FACILITY = 0
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def kernel_line(record: str) -> tuple[int, str] | None:
    """(sequence number, first line of the text) of a /dev/kmsg record the kernel wrote
    ('PRIO,SEQ,USEC,FLAGS[,...];text' with PRIO = facility * 8 + level); None for a record
    from user space (another facility) or one that does not parse."""
    head, sep, text = record.partition(";")
    fields = head.split(",")
    if not sep or len(fields) < 2 or not fields[0].isdigit() or not fields[1].isdigit():
        return None
    if int(fields[0]) >> 3 != KERNEL_FACILITY:
        return None
    # continuation lines (' SUBSYSTEM=...', ' DEVICE=...') carry the record's dictionary
    return int(fields[1]), text.split("\n", 1)[0]


def parse_xids(records: list[str]) -> list[XidEvent]:
    """The XIDs of the kernel's own /dev/kmsg records (see the module's docstring)."""
    out = []
    for rec in records:
        line = kernel_line(rec)
        m = XID_RE.match(line[1]) if line else None
        if m:
            out.append(XidEvent(int(m.group(2)), m.group(1), line[0], "kernel log"))
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
