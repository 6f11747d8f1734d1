"""Which failed handshakes (a first frame whose MAC does not match the job's key) get a log line.

A peer without the key can fail the handshake as fast as it can connect: one WARNING each gave
8,681 lines (1.3 MB) in 5 s from one process (issue 37). So: the first failure from each
address is logged (an operator sees who tried), the rest are counted, and a summary is due at
most once per `summary_every_s`. Pure: the caller passes the time and logs what it is given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SUMMARY_EVERY_S = 60.0
MAX_ADDRESSES = 1024  # addresses remembered for their first line; beyond, failures are only counted


@dataclass
class HandshakeFailures:
    summary_every_s: float = SUMMARY_EVERY_S
    max_addresses: int = MAX_ADDRESSES
    total: int = 0
    _seen: set[str] = field(default_factory=set)
    _unreported: int = 0                       # failures since the last line that counted them
    _unreported_addresses: set[str] = field(default_factory=set)
    _last_summary_at: Optional[float] = None

    def failed(self, peer: str, detail: str, now: float) -> Optional[str]:
        """The line to log for a failed handshake from `peer` ('host:port') at `now`, or None."""
        self.total += 1
        host = peer.rsplit(":", 1)[0]
        if host not in self._seen and len(self._seen) < self.max_addresses:
            self._seen.add(host)
            if self._last_summary_at is None:
                self._last_summary_at = now  # the first summary comes one period after the first line
            return (f"control: failed handshake from {peer}: {detail} (further failures from {host} are counted, "
                    f"summed up at most every {self.summary_every_s:g}s)")
        self._unreported += 1
        self._unreported_addresses.add(host)
        return self.summary(now)

    def summary(self, now: float, *, force: bool = False) -> Optional[str]:
        """The summary of the failures not yet counted in a line, when one is due (or `force`:
        the server closes), else None."""
        if not self._unreported:
            return None
        if not force and self._last_summary_at is not None and now - self._last_summary_at < self.summary_every_s:
            return None
        since = f" in the last {now - self._last_summary_at:.0f}s" if self._last_summary_at is not None else ""
        line = (f"control: {self._unreported} more failed handshakes{since} from {len(self._unreported_addresses)} "
                f"address(es); {self.total} in all")
        self._unreported, self._unreported_addresses, self._last_summary_at = 0, set(), now
        return line
