"""The health check proven on a GPU machine (issue 19): no false drain on healthy GPUs, every
injected fault kind caught. One call does it all and writes one JSON file:

    TM_COMMIT=<sha> python bench/gpu_healthcheck.py --machine nvidia-h200-x2 \\
        --out bench/results/gpu-healthcheck-h200x2.json
    python bench/gpu_healthcheck.py --dry-run --out /tmp/gpu-healthcheck-dryrun.json   # CPU only

How, as an admin installs it and as slurmd runs it: `slurm_plugin/healthcheck.sh` is copied
into a scratch folder with a `healthcheck.env` beside it; the interpreter is a scratch venv of
this Python whose .pth makes trainmover (this checkout) and this Python's packages (pynvml)
importable, since the script runs Python isolated (-I); every run is
`env -i SLURMD_NODENAME=<host> healthcheck.sh --no-drain --json` (no Slurm here: report only;
the verdict's reason is what a drain would carry).

  1. `--healthy-runs` (default 24) consecutive runs on the healthy GPUs, from an empty state
     directory (the first is a node's first run). With 2+ GPUs, a worker copies a buffer back
     and forth between GPUs 0 and 1 over NVLink during the middle third of the runs (and
     between them), so the link counters move as they did in the false drain.
  2. Every fault kind injected once through the hook (inject-fault-<node>, JSON form): an
     NVLink counter jump, a PCIe counter jump, an uncorrectable ECC error, a failed row remap,
     a pending retirement, a GPU fallen off the bus, a critical XID. Two controls must pass:
     a counter reset (driver reload) and a non-critical XID. Then one more healthy run.

Metrics: healthy_runs_passed_ratio, injected_faults_caught_ratio, controls_passed_ratio,
the largest counter rates seen on healthy runs per counter kind (against their thresholds),
wall time per run (the script's bound is 10 s), NVLink traffic moved. `recorded_readings`
holds the counters of each healthy run (tests/unit/test_healthcheck_rates.py replays them).

`--dry-run`: no GPU; a recorded reading (file:) stands in for NVML, its counters starting at the
values of the false drain (196 and 104) and creeping up between runs; labelled as a dry run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from trainmover.healthcheck.rates import DEFAULT_THRESHOLDS_PER_S, DEFAULT_WINDOW_S  # noqa: E402
from trainmover.healthcheck.state import root_trusted  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RUN_TIMEOUT_S = 30       # a run is bounded at 10 s by the script itself
TRAFFIC_READY_S = 180    # torch import, CUDA contexts, allocation
TRAFFIC_STOP_S = 60


# ---- installing the check as an admin would ------------------------------------------------

def make_python(scratch: Path) -> Path:
    """A venv of this Python that sees trainmover (this checkout) and this Python's packages
    through a .pth file: the isolated (-I) interpreter healthcheck.sh runs."""
    site_dirs = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    for copies in (False, True):
        venv = scratch / ("venv-copies" if copies else "venv")
        cmd = [sys.executable, "-m", "venv", "--without-pip", *(["--copies"] if copies else []), str(venv)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        py = venv / "bin" / "python"
        purelib = subprocess.run([str(py), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        Path(purelib, "trainmover-bench.pth").write_text("\n".join([str(ROOT), *site_dirs]) + "\n")
        if root_trusted(py) and root_trusted(Path(os.path.realpath(py))):
            return py
    raise RuntimeError(f"no interpreter healthcheck.sh would trust: {py} -> {os.path.realpath(py)} "
                       "is not root's or is writable by group or others")


def install(scratch: Path, python: Path, state: Path, extra: list[str]) -> Path:
    bindir = scratch / "slurm_plugin"
    bindir.mkdir(mode=0o755)
    script = bindir / "healthcheck.sh"
    shutil.copyfile(ROOT / "slurm_plugin" / "healthcheck.sh", script)
    script.chmod(0o755)
    env = bindir / "healthcheck.env"
    env.write_text(f"TRAINMOVER_PYTHON={python}\n"
                   f"TRAINMOVER_HEALTHCHECK_ARGS='--state-dir {state} --no-straggler {' '.join(extra)}'\n")
    env.chmod(0o644)
    return script


def run_check(script: Path, node: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/env", "-i", f"SLURMD_NODENAME={node}", str(script), "--no-drain", "--json"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd="/")
    wall = time.perf_counter() - t0
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = {"unparsed_stdout": proc.stdout[-2000:]}
    return {"rc": proc.returncode, "wall_s": round(wall, 3), "report": report, "stderr": proc.stderr[-1500:]}


def gpu_findings(report: dict) -> list[dict]:
    return [f for f in report.get("findings", []) if f.get("check") == "gpu"]


# ---- NVLink traffic (a worker process, so the check runs beside it as beside a job) -----------

def traffic_worker(seconds: float, gb: float, stop: Path) -> int:
    import torch
    assert torch.cuda.device_count() >= 2, "the traffic worker needs 2 GPUs"
    n = int(gb * 1e9) // 4
    a = torch.ones(n, dtype=torch.float32, device="cuda:0")
    b = torch.empty(n, dtype=torch.float32, device="cuda:1")
    b.copy_(a)
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    print("ready", flush=True)
    moved, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and not stop.exists():
        for _ in range(4):
            b.copy_(a, non_blocking=True)
            a.copy_(b, non_blocking=True)
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        moved += 8 * n * 4
    took = time.perf_counter() - t0
    print(json.dumps({"moved_bytes": moved, "seconds": round(took, 3), "GBps": round(moved / took / 1e9, 1)}), flush=True)
    return 0


class Traffic:
    """Start, wait until copying, stop: every wait has a deadline."""

    def __init__(self, scratch: Path, gb: float, max_s: float) -> None:
        self.stop_file = scratch / "stop-traffic"
        env = {**os.environ, **MULTICAST_OFF, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--traffic-worker", "--traffic-gb", str(gb),
                                      "--traffic-max-s", str(max_s), "--stop-file", str(self.stop_file)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = _readline(self.proc, TRAFFIC_READY_S)
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"traffic worker not ready within {TRAFFIC_READY_S}s: {line!r} {self.proc.stderr.read()[-1500:]}")

    def stop(self) -> dict:
        self.stop_file.touch()
        try:
            out, err = self.proc.communicate(timeout=TRAFFIC_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError(f"traffic worker did not stop within {TRAFFIC_STOP_S}s") from None
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise RuntimeError(f"traffic worker exited {self.proc.returncode}: {err[-1500:]}") from None


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        return f"(nothing within {timeout}s)"
    return proc.stdout.readline()


# ---- the dry run's stand-in for the GPUs ------------------------------------------------------

class DryGpus:
    """Two recorded GPUs with 18 NVLinks each, counters at the false drain's values (196 on GPU 0
    link 1, 104 on link 10); `traffic()` makes them creep as healthy links do."""

    def __init__(self, path: Path) -> None:
        self.path, self.step = path, 0
        self.counters = [{f"nvlink{i}": {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0} for i in range(18)}
                         for _ in range(2)]
        for g in self.counters:
            g["pcie"] = {"pcie_replay": 0}
        self.counters[0]["nvlink1"]["replay"], self.counters[0]["nvlink10"]["replay"] = 196, 104
        self.write()

    def traffic(self) -> None:
        self.step += 1
        for gi, g in enumerate(self.counters):
            g[f"nvlink{(self.step * 7 + gi) % 18}"]["replay"] += 3
            g[f"nvlink{(self.step * 5 + gi) % 18}"]["crc_flit"] += 1
        self.write()

    def write(self) -> None:
        gpus = [{"index": i, "uuid": f"GPU-dryrun-{i}", "pci": f"0000:{0x18 + 0x12 * i:02x}:00.0", "counters": c}
                for i, c in enumerate(self.counters)]
        self.path.write_text(json.dumps({"boot_id": "dry-run", "gpus": gpus}))


# ---- faults ---------------------------------------------------------------------------------

def fault_plan(n_gpus: int, first_nvlink: str) -> list[tuple[str, dict, str]]:
    """(name, hook fault, text the failing finding must hold). GPUs alternate where there are 2."""
    last = n_gpus - 1
    label = f"NVLink {first_nvlink[len('nvlink'):]}"
    return [
        ("nvlink_counter_jump", {"kind": "counter_jump", "gpu": 0, "link": first_nvlink, "counter": "replay"},
         f"{label} replay: +1000000"),
        ("pcie_counter_jump", {"kind": "counter_jump", "gpu": last, "link": "pcie", "counter": "pcie_replay", "add": 100},
         "PCIe pcie_replay: +100"),
        ("ecc_uncorrectable", {"kind": "ecc_uncorrectable", "gpu": 0, "count": 2}, "uncorrectable ECC errors: 2"),
        ("row_remap_failure", {"kind": "row_remap_failure", "gpu": last}, "row remapping failed"),
        ("retirement_pending", {"kind": "retirement_pending", "gpu": 0}, "page retirement or row remap pending"),
        ("fallen_off_bus", {"kind": "fallen_off_bus", "gpu": last}, "fallen off the bus"),
        ("critical_xid", {"kind": "xid", "gpu": 0, "xid": 79}, "XID 79 on GPU 0"),
    ]


CONTROLS = [("counter_reset", {"kind": "counter_reset", "gpu": 0}), ("non_critical_xid", {"kind": "xid", "gpu": 0, "xid": 13})]


def caught(run: dict, fragment: str) -> bool:
    action = run["report"].get("action") or ""
    failing = [f["detail"] for f in gpu_findings(run["report"]) if not f["ok"] and not f.get("skipped")]
    return (run["rc"] == 1 and action.startswith("not draining (--no-drain): trainmover: healthcheck gpu:")
            and any(fragment in d for d in failing))


def healthy_pass(run: dict, n_gpus: int) -> bool:
    read = [f for f in gpu_findings(run["report"]) if f["detail"].startswith("GPU ") and not f.get("skipped")]
    return run["rc"] == 0 and run["report"].get("healthy") is True and len(read) >= n_gpus


def recorded(state_file: Path) -> dict:
    """The counters a healthy run read, from the state it kept (bases' `last`)."""
    st = json.loads(state_file.read_text())
    gpus = [{"index": g["index"], "uuid": uuid, "pci": g.get("pci", ""),
             "counters": {link: {kind: v[2] for kind, v in kinds.items()} for link, kinds in g["bases"].items()}}
            for uuid, g in st["gpus"].items()]
    return {"time": st["time"], "reading": {"boot_id": st["boot_id"], "gpus": gpus}}


def prune_zero_links(readings: list[dict]) -> list[dict]:
    """Drop the links whose counters read 0 in every run: replaying them judges nothing."""
    moving = {(g["uuid"], link) for r in readings for g in r["reading"]["gpus"]
              for link, kinds in g["counters"].items() if any(kinds.values())}
    return [{**r, "reading": {**r["reading"], "gpus": [
        {**g, "counters": {k: v for k, v in g["counters"].items() if (g["uuid"], k) in moving}}
        for g in r["reading"]["gpus"]]}} for r in readings]


def compact(run: dict) -> dict:
    r = run["report"]
    return {"rc": run["rc"], "wall_s": run["wall_s"], "action": r.get("action"), "gpu_source": r.get("gpu_source"),
            "gpu": [f["detail"] for f in gpu_findings(r) if not f.get("warning")],
            "warnings": [f["detail"] for f in r.get("findings", []) if f.get("warning")][:12],
            "notes": r.get("notes", [])[:6], "stderr": run["stderr"][-400:] if run["rc"] not in (0, 1) else ""}


def max_rates(runs: list[dict]) -> dict:
    out: dict[str, float] = {}
    for run in runs:
        for f in gpu_findings(run["report"]):
            for e in f.get("evidence", []):
                out[e["counter"]] = max(out.get(e["counter"], 0.0), float(e["per_s"]))
    return {k: round(v, 4) for k, v in sorted(out.items())}


def gpus_label(dry: bool) -> tuple[int, str]:
    if dry:
        return 2, "none (dry run: a recorded reading of 2 GPUs)"
    import torch
    n = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    return n, f"{n}x {', '.join(names)}" if n else "0"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"),
                    help="the JSON file to write (a folder: <folder>/gpu-healthcheck.json)")
    ap.add_argument("--machine", default=results_io.machine())
    ap.add_argument("--healthy-runs", type=int, default=24)
    ap.add_argument("--gap-s", type=float, default=None, help="pause between healthy runs (default 2.5, dry run 0)")
    ap.add_argument("--traffic-gb", type=float, default=4.0, help="buffer copied back and forth between GPUs 0 and 1")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: a recorded reading stands in for NVML")
    ap.add_argument("--traffic-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--traffic-max-s", type=float, default=300.0, help=argparse.SUPPRESS)
    ap.add_argument("--stop-file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.traffic_worker:
        return traffic_worker(args.traffic_max_s, args.traffic_gb, args.stop_file)
    out = Path(args.out)
    out = out if out.suffix == ".json" else out / "gpu-healthcheck.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    gap = args.gap_s if args.gap_s is not None else (0.0 if args.dry_run else 2.5)
    node = socket.gethostname().split(".")[0]
    scratch = Path(tempfile.mkdtemp(prefix="tm-hc-"))
    state = scratch / "state"
    state.mkdir(mode=0o700)
    n_gpus, gpus = gpus_label(args.dry_run)
    dry = DryGpus(scratch / "reading.json") if args.dry_run else None
    extra = [f"--gpu-source file:{dry.path}"] if dry else []
    result = {"scenario": "gpu-healthcheck-dryrun" if dry else "gpu-healthcheck",
              "machine": "cpu-dry-run" if dry else args.machine, "gpus": gpus, **results_io.provenance(__file__),
              "settings": {"dry_run": bool(dry), "node": node, "healthy_runs": args.healthy_runs, "gap_s": gap,
                           "how": "slurm_plugin/healthcheck.sh under env -i SLURMD_NODENAME=<node>, "
                                  "--no-drain --no-straggler --json, python -I from a scratch venv",
                           "thresholds_per_s": dict(DEFAULT_THRESHOLDS_PER_S), "rate_window_s": DEFAULT_WINDOW_S},
              "errors": []}
    python = make_python(scratch)
    script = install(scratch, python, state, extra)
    traffic_runs = range(args.healthy_runs // 3, 2 * args.healthy_runs // 3) if (n_gpus >= 2 or dry) else range(0)
    what = ("simulated: recorded counters raised before each" if dry else
            f"a {args.traffic_gb:g} GB buffer copied back and forth between GPUs 0 and 1 during")
    result["settings"]["traffic"] = (f"{what} of runs {traffic_runs.start + 1}-{traffic_runs.stop}" if len(traffic_runs)
                                     else "none (one GPU: no NVLink peer)")
    healthy, readings, traffic, moved = [], [], None, None
    try:
        for i in range(args.healthy_runs):
            if i == traffic_runs.start and len(traffic_runs) and not dry:
                traffic = Traffic(scratch, args.traffic_gb, max_s=600)
            if i in traffic_runs and dry:
                dry.traffic()
            run = run_check(script, node)
            healthy.append(run)
            if (state / f"gpu-state-{node}.json").exists():
                readings.append(recorded(state / f"gpu-state-{node}.json"))
            if traffic is not None and i == traffic_runs.stop - 1:
                moved, traffic = traffic.stop(), None
            time.sleep(gap)
    finally:
        if traffic is not None:
            traffic.stop_file.touch()
            traffic.proc.kill()
    first_nvlink = "nvlink0"
    if readings:
        links = sorted((k for k in readings[-1]["reading"]["gpus"][0]["counters"] if k.startswith("nvlink")),
                       key=lambda k: int(k[len("nvlink"):]))
        first_nvlink = links[0] if links else "nvlink0"
    faults, controls = {}, {}
    hook = state / f"inject-fault-{node}"
    for name, spec, fragment in fault_plan(n_gpus, first_nvlink):
        hook.write_text(json.dumps(spec))
        run = run_check(script, node)
        faults[name] = {"spec": spec, "expect": fragment, "caught": caught(run, fragment), **compact(run)}
    for name, spec in CONTROLS:
        hook.write_text(json.dumps(spec))
        run = run_check(script, node)
        controls[name] = {"spec": spec, "passed": healthy_pass(run, n_gpus), **compact(run)}
    hook.unlink()
    again = run_check(script, node)

    passed = [healthy_pass(r, n_gpus) for r in healthy]
    sources = sorted({r["report"].get("gpu_source") or "" for r in healthy})
    if not all(passed):
        result["errors"].append(f"healthy runs failed: {[i + 1 for i, ok in enumerate(passed) if not ok]}")
    if sources != ["nvml"] and sources != ["dcgm+nvml"] and not dry:
        result["errors"].append(f"GPU sources seen: {sources}: the GPUs were not read on every run")
    missed = [n for n, f in faults.items() if not f["caught"]]
    if missed:
        result["errors"].append(f"injected faults not caught: {missed}")
    if not all(c["passed"] for c in controls.values()):
        result["errors"].append(f"controls failed: {[n for n, c in controls.items() if not c['passed']]}")
    if not healthy_pass(again, n_gpus):
        result["errors"].append(f"healthy again after the faults: rc {again['rc']}")
    walls = [r["wall_s"] for r in healthy] + [f["wall_s"] for f in faults.values()] + [again["wall_s"]]
    result["metrics"] = {
        "healthy_runs": len(healthy), "healthy_runs_passed": sum(passed),
        "healthy_runs_passed_ratio": round(sum(passed) / len(healthy), 4) if healthy else 0.0,
        "injected_faults": len(faults), "injected_faults_caught": sum(f["caught"] for f in faults.values()),
        "injected_faults_caught_ratio": round(sum(f["caught"] for f in faults.values()) / len(faults), 4),
        "controls_passed_ratio": round(sum(c["passed"] for c in controls.values()) / len(controls), 4),
        "healthy_again_passed": healthy_pass(again, n_gpus), "gpu_source": ", ".join(sources),
        "gpus_read": n_gpus, "nvlinks_read_gpu0": len([k for k in (readings[-1]["reading"]["gpus"][0]["counters"]
                                                                    if readings else {}) if k.startswith("nvlink")]),
        "max_healthy_rate_per_s": max_rates(healthy), "run_wall_s_max": max(walls),
        "run_wall_s_median": sorted(walls)[len(walls) // 2], "within_10_s": max(walls) < 10.0,
        "traffic": moved or ("simulated counter creep" if dry else None),
    }
    result["runs"] = {"healthy": [compact(r) for r in healthy], "faults": faults, "controls": controls,
                      "healthy_again": compact(again)}
    result["recorded_readings"] = prune_zero_links(readings) if not dry else "not kept in a dry run"
    result["complete"] = not result["errors"]
    results_io.write(out, result)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
