"""What the one-GPU-host benchmarks share: a job (the real controller on `SingleHostAllocation`)
runs in a child process with a deadline, a trigger thread watches its run files, and what it
wrote is salvaged even when it had to be killed."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path


def read_json(path: Path) -> dict:
    """A JSON file, or {} while it does not exist or is being replaced."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_rows(path: Path) -> list[dict]:
    """JSON lines, skipping a line being appended right now."""
    rows = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def new_job(spec: dict, root: Path):
    """(controller, run dir, raw results) of one job: the real controller on
    `SingleHostAllocation`, one GPU a 'node', the last one the standby; `root` goes on
    PYTHONPATH so that the workers import this checkout."""
    from trainmover.config import Config
    from trainmover.controller.executor import Controller
    from trainmover.slurm.single_host import SingleHostAllocation
    workdir = Path(spec["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    run = workdir / "run"
    cfg = Config(run_dir=str(run), **spec["config"])
    # a reference job may run alone on one GPU beside another (train = gpus, no standby)
    alloc = SingleHostAllocation(gpus=spec["gpus"], train=spec.get("train", spec["gpus"] - 1), work_dir=str(workdir),
                                 first_gpu=spec.get("first_gpu", 0), host_gpus=spec.get("host_gpus"),
                                 share_gpu=spec.get("share_gpu", False), standby_gpu=spec.get("standby_gpu"))
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    raw = {"name": spec["name"], "t_start": time.time(), "trigger": {}, "error": None}
    return Controller(cfg, job_id=1, slurm=alloc, environ=env), run, raw


def watch_standby(t: dict, run: Path, status: dict, step: int) -> str | None:
    """Note in `t` when the standby is first seen and ready (ready_t, ready_step, standby);
    the reason if its agent exited before it was warm (said at once, not at the deadline)."""
    for s in status.get("standbys", []):
        t.setdefault("standby_seen", s["node"])
        if s["state"] == "ready" and "ready_t" not in t:
            t.update(ready_t=time.time(), ready_step=step, standby=s)
    if "standby_seen" in t and "ready_t" not in t and not status.get("standbys"):
        log = run / f"standby-{t['standby_seen']}.log"
        last = log.read_text().strip().splitlines()[-1:] if log.exists() else ["(no log)"]
        return f"standby on {t['standby_seen']} exited before it was ready: {last[0][-500:]}"
    return None


def watch_job(spec: dict, run: Path, t: dict, act, interval: float, give_up, on_lost=None) -> None:
    """A trigger thread's loop: every `interval` s until `spec["deadline_s"]`, read the job's rows
    and status, note the standby (`watch_standby`) and call `act(status, step)` until it returns
    True. What went wrong goes into `t["error"]`: the standby's exit (then `on_lost()`),
    `give_up()` at the deadline, or an exception of the loop's own."""
    deadline = time.monotonic() + spec["deadline_s"]
    try:
        while time.monotonic() < deadline:
            rows = read_rows(run / "metrics.jsonl")
            status = read_json(run / "status.json")
            step = rows[-1]["step"] if rows else 0
            lost = watch_standby(t, run, status, step)
            if lost:
                t["error"] = lost
                if on_lost:
                    on_lost()
                return
            if act(status, step):
                return
            time.sleep(interval)
        t["error"] = give_up()
    except Exception as exc:  # noqa: BLE001 - reported in the result
        t["error"] = f"trigger failed: {exc!r}"


def parse_args(ap, run_job):
    """`ap`'s arguments in the benchmark's own process; in a job's child process (`launch` runs
    `script --run-job SPEC`) it runs `run_job(SPEC)` and exits with its code."""
    ap.add_argument("--run-job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_job:
        sys.exit(run_job(json.loads(args.run_job)))
    return args


def too_late(t: dict, spec: dict, step: int, what: str) -> bool:
    """Whether `what` (the migration or the kill) at `step` would leave fewer than
    `min_steps_after` steps to compare with the reference; then `t["error"]` says so."""
    if step < spec["steps"] - spec["min_steps_after"]:
        return False
    t["error"] = (f"too late to {what} at step {step} (training ends at {spec['steps']}, "
                  f"standby ready at step {t['ready_step']}): use more --steps")
    return True


def request_migration(t: dict, run: Path, node: str, step: int) -> None:
    """`trainmover migrate <node>` through the job's authenticated control channel."""
    from trainmover.protocol import channel
    from trainmover.protocol.messages import make
    where = read_json(run / "controller.json")
    t["t"], t["step"] = time.time(), step
    reply = channel.request((where["host"], where["port"]), channel.read_secret(str(run / "secret")),
                            make("migrate", node=node))
    t["reply"] = reply["message"]


def run_controller(ctl, run: Path, raw: dict, out: Path) -> int:
    """Run the controller to its end and write what the job produced to `out` (raw.json)."""
    try:
        raw["rc"] = ctl.run()
    except Exception:  # noqa: BLE001 - reported in the result
        raw["error"] = traceback.format_exc()[-3000:]
    raw.update(t_end=time.time(), metrics=read_rows(run / "metrics.jsonl"),
               timeline=read_rows(run / "timeline.jsonl"), status=read_json(run / "status.json"),
               final=read_json(run / "final.json") or None)
    out.write_text(json.dumps(raw))
    return 0 if raw["error"] is None and raw.get("rc") == 0 else 1


def reused(work: Path, names) -> list[str]:
    """Why the jobs `names` cannot run under `work`: each job's directory must be new. A reused one
    holds an earlier run's raw.json and run files, which a job that fails at its start leaves in
    place and the benchmark would read as this run's (issue 36: a JSON said bit_exact with both
    jobs exited 1 at their start). Refused, not cleaned: they may be results someone wants."""
    return [f"{work / n} exists from an earlier run: give a new --work (or remove it)"
            for n in names if (work / n).exists() and any((work / n).iterdir())]


def cannot_fit(rows: list[dict], steps: int, started: float, timeout_s: float, min_gaps: int = 5,
               slack: float = 0.05) -> tuple[float, str] | None:
    """(seconds the job needs at least, why) once a job's own pace says its `steps` cannot end
    within `timeout_s` of `started` (wall clock), None while they still may (pure).

    The pace is the median of its last 20 one-step intervals, taken once `min_gaps` of them are
    there (the first steps compile and warm up); the projection is a lower bound (no time for the
    job's end), and it must exceed the deadline by `slack` of it."""
    recent = rows[-21:]
    gaps = [b["t"] - a["t"] for a, b in zip(recent, recent[1:]) if b.get("step") == a.get("step", -2) + 1]
    if len(gaps) < min_gaps:
        return None
    step_s = sorted(gaps)[len(gaps) // 2]
    last = rows[-1]
    need = last["t"] + max(0, steps - last["step"]) * step_s - started
    if need <= timeout_s * (1 + slack):
        return None
    return need, (f"at {step_s:.3f} s a step (step {last['step']} of {steps} after {last['t'] - started:.0f} s) "
                  f"its {steps} steps need at least {need:.0f} s, more than its {timeout_s:.0f} s")


def launch(script: str, spec: dict, timeout_s: float, poll_s: float = 1.0) -> tuple[dict, str | None]:
    """Run `script --run-job <spec>` in a child process in its own session (the controller and its
    workers are killed together: at the deadline, or as soon as the job's pace says its steps
    cannot end within it, `cannot_fit`). Returns (raw results, salvaged from the run files if it
    was killed before writing them; error). `raw["exit"]` says how the process ended, for
    exactness.judge. A job directory that exists already is refused (`reused`)."""
    workdir = Path(spec["workdir"])
    refused = reused(workdir.parent, [workdir.name])
    if refused:
        return {"name": spec["name"], "exit": {"refused": refused[0]}}, f"job {spec['name']}: {refused[0]}"
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "job.log"
    print(f"[{spec['name']}] deadline {timeout_s:.0f}s, log {log}", flush=True)
    launched = time.time()
    ex = {"launched_t": launched, "rc": None, "killed": None}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, script, "--run-job", json.dumps(spec)], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + max(1.0, timeout_s)
        while True:
            try:
                proc.wait(timeout=max(0.05, min(poll_s, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                pass
            fit = spec.get("steps") and cannot_fit(read_rows(workdir / "run" / "metrics.jsonl"), spec["steps"],
                                                   launched, timeout_s)
            if time.monotonic() >= deadline or fit:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                ex["killed"] = (f"its steps cannot end within its deadline: {fit[1]}" if fit else
                                f"did not finish within {timeout_s:.0f}s")
                if fit:
                    ex["needs_s"] = round(fit[0], 1)
                break
        ex["rc"] = proc.returncode
        error = (f"job {spec['name']}: {ex['killed']}: killed (see {log})" if ex["killed"] else
                 None if proc.returncode == 0 else f"job {spec['name']} exited with {proc.returncode} (see {log})")
    raw = read_json(workdir / "raw.json")
    if not raw:
        run = workdir / "run"
        raw = {"name": spec["name"], "metrics": read_rows(run / "metrics.jsonl"), "status": read_json(run / "status.json"),
               "timeline": read_rows(run / "timeline.jsonl"), "final": read_json(run / "final.json") or None,
               "t_start": None, "trigger": {}, "error": None}
    raw["exit"] = ex
    for extra in (raw.get("error"), raw.get("trigger", {}).get("error")):
        if extra:
            error = (error + "; " if error else "") + extra.strip().splitlines()[-1]
    return raw, error


def keep_logs(workdir: Path, dest: Path) -> None:
    """Copy a job's logs and run files (not its recordings or compile caches) next to the result."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in [workdir / "job.log", *sorted((workdir / "run").glob("*.log")), *sorted((workdir / "run").glob("*.json")),
              *sorted((workdir / "run").glob("*.jsonl"))]:
        if f.is_file() and f.stat().st_size <= 20 << 20:
            shutil.copyfile(f, dest / f.name)


def gpu_names() -> str:
    """'<n>x <name>' from nvidia-smi: a CUDA context in this process would hold memory on GPU 0
    for the whole run, next to a worker."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
        return f"{len(names)}x {names[0]}" if names else "unknown (nvidia-smi listed none)"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
