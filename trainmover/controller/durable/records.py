"""The files a job writes under `runs/<job id>/` on the shared job directory.

metrics.jsonl   one line per step: step, loss, per-rank losses, step time, node of each rank
timeline.jsonl  every migration event with its wall-clock time
status.json     the controller's view (what `trainmover status` prints), replaced atomically
final.json      step count and the digest of all parameters and optimizer state
controller.json where the controller listens (address from Slurm, port), sealed with the job's key
secret          the job's channel key

The directory is the job's user's alone (0700, refused if someone else made it first) and
every file in it 0600: protocol/files.py, docs/security.md.
"""
from __future__ import annotations

import json
from pathlib import Path

from trainmover.errors import ProtocolError
from trainmover.protocol import files


def write_json(path: Path, obj: dict) -> None:
    write_text(path, json.dumps(obj, indent=1, sort_keys=True))


def write_text(path: Path, text: str) -> None:
    files.write_atomic(path, text + "\n")  # readers never see a half-written file


class RunFiles:
    def __init__(self, root: Path):
        self.root = files.private_dir(Path(root))  # what other processes are told, and messages say
        self.at = files.held_dir(self.root)        # what this process reads and writes through
        self._streams = {name: files.open_append(self.at / f"{name}.jsonl", buffering=1)
                         for name in ("metrics", "timeline")}

    def append(self, stream: str, row: dict) -> None:
        self._streams[stream].write(json.dumps(row, sort_keys=True) + "\n")

    def rewind(self, stream: str, step: int) -> int:
        """Drop the rows of `stream` past `step` (a rollback redoes them): the file is rewritten
        (temp + rename) and appended to afterwards. Returns the rows dropped."""
        path = self.at / f"{stream}.jsonl"
        self._streams[stream].close()
        lines = files.read_limited(path, files.RUN_FILE_MAX).decode().splitlines(keepends=True)
        keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        if keep:
            write_text(path, "".join(keep).rstrip("\n"))
        else:
            files.write_atomic(path, b"")
        self._streams[stream] = files.open_append(path, buffering=1)
        return len(lines) - len(keep)

    def write(self, name: str, obj: dict) -> None:
        write_json(self.at / f"{name}.json", obj)

    def write_text(self, name: str, text: str) -> None:
        """<name>.json from JSON text already serialised."""
        write_text(self.at / f"{name}.json", text)

    @property
    def secret(self) -> Path:
        return self.root / "secret"

    def close(self) -> None:
        for f in self._streams.values():
            f.close()


def trim_torn(path: Path) -> int:
    """Cut a line the writer died inside of (no newline at the end). Returns the `step` of the
    last complete line (metrics.jsonl: the last step logged), 0 if none or no such field."""
    lines = files.trim_torn_tail(Path(path)).splitlines()  # never through a link (protocol/files.py)
    try:
        return int(json.loads(lines[-1]).get("step", 0)) if lines else 0
    except (ValueError, AttributeError):
        return 0


OUTCOME = "outcome"  # the seal's label of status.json's outcome (protocol/files.py)


def sealed_outcome(key: bytes, ok: bool, message: str) -> dict:
    """status.json's `outcome`, sealed with the job's key: the keeper ends the job on it."""
    return files.seal(key, OUTCOME, {"ok": bool(ok), "message": message})


def read_outcome(path: Path, key: bytes | None) -> dict | None:
    """{"ok", "message"} of the status.json at `path` if a controller of this job sealed it
    (`sealed_outcome`), else None: missing, not yet written, a link or a FIFO, or not sealed with
    `key` (written by someone else: never believed)."""
    if key is None:
        return None
    try:
        outcome = json.loads(files.read_limited(path, 16 << 20)).get("outcome")
        return files.unseal(key, OUTCOME, outcome) if outcome else None
    except (OSError, ValueError, AttributeError, ProtocolError):
        return None


def run_dir(work_dir: str, job_id: int | str) -> Path:
    return Path(work_dir) / "runs" / str(job_id)


def completed_before(root: Path, job_id: int, steps: int) -> str | None:
    """Why this job has nothing left to do, if an earlier run of the same job id (Slurm
    requeued it) already trained every step and ended well; None otherwise. Slurm 22.05 can
    requeue a job after its training ended ('Batch JobId missing from batch node'); its second
    run must then say so and end, not fail on the secret the first run left."""
    try:
        final = json.loads(files.read_limited(Path(root) / "final.json", 16 << 20))
        outcome = json.loads(files.read_limited(Path(root) / "status.json", 16 << 20)).get("outcome") or {}
    except (OSError, ValueError):
        return None
    if final.get("job_id") == job_id and final.get("steps") == steps and outcome.get("ok"):
        return (f"job {job_id} already trained all {steps} steps in an earlier run ({root}/final.json); "
                "Slurm requeued it afterwards: nothing left to do")
    return None


def final_line(root: Path, job_id: int, code: int, why: str = "", stopped: bool = False,
               shown: Path | None = None) -> str:
    """The batch script's last line in slurm-<job>.out, one for every way the job ends:
    `trainmover: job 12 FAILED: user code raised on rank 1 (train2) at step 300: RuntimeError: ...;
    traceback in <run dir>/status.json`. From the controller's outcome in status.json; `why`:
    the keeper's or supervisor's own reason where no controller wrote one. `shown`: the run
    directory's name to print where `root` is a held one (files.held_dir)."""
    try:
        status = json.loads(files.read_limited(Path(root) / "status.json", 16 << 20))
    except (OSError, ValueError):
        status = {}
    outcome = status.get("outcome") or {}
    word = "COMPLETED" if code == 0 else "CANCELLED" if stopped and not outcome else "FAILED"  # as Slurm says it
    message = outcome.get("message") or why or (
        "stopped by a signal (scancel)" if stopped else f"the controller ended with exit code {code}")
    message = " ".join(str(message).split())[:1500]  # one line
    failure = status.get("failure") or {}
    where = f"; traceback in {Path(shown or root) / 'status.json'}" if failure.get("traceback") else ""
    return f"trainmover: job {job_id} {word}: {message}{where}"
