"""The health check on a real GPU host, run the way slurmd runs HealthCheckProgram (issue 5):

    python bench/gpu_healthcheck.py --out DIR       # on the GPU machine, nvidia-ml-py importable

`slurm_plugin/healthcheck.sh` is copied into a scratch folder with a `healthcheck.env` beside it
(the site file the script reads) and started under `env -i SLURMD_NODENAME=<host>`: no PATH, no
SLURM_CONF, as slurmd gives it. Report only (`--no-drain`: no Slurm on the GPU machines). Three
runs: healthy (every GPU's NVML checks must run and pass), the test hook's injected fault (exit
1 with a `trainmover:` reason), and healthy again with the hook removed. Wall time of each run
(the script's own limit is 10 s). Writes <out>/gpu-healthcheck.json (bench-results.md format).
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


def run_check(script: Path, node: str, state: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/env", "-i", f"SLURMD_NODENAME={node}", "/bin/sh", str(script),
                           "--no-drain", "--no-straggler", "--json", "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=30)
    wall = time.perf_counter() - t0
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = {"unparsed_stdout": proc.stdout[-2000:]}
    return {"rc": proc.returncode, "wall_s": round(wall, 3), "report": report, "stderr": proc.stderr[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--machine", default=os.environ.get("TM_BENCH_MACHINE", "unknown"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    node = socket.gethostname().split(".")[0]
    scratch = Path(tempfile.mkdtemp(prefix="tm-hc-"))
    script = scratch / "healthcheck.sh"
    shutil.copyfile(ROOT / "slurm_plugin" / "healthcheck.sh", script)
    # The site file the script sources: which Python, and where trainmover (and pynvml) live.
    (scratch / "healthcheck.env").write_text(
        f"TRAINMOVER_PYTHON={sys.executable}\n"
        f"PYTHONPATH={os.pathsep.join([str(ROOT), *filter(None, os.environ.get('PYTHONPATH', '').split(os.pathsep))])}\n"
        "export PYTHONPATH\n")
    state = scratch / "state"
    state.mkdir()
    result = {"scenario": "gpu-healthcheck", "machine": args.machine, "commit": results_io.commit(),
              "command": " ".join(["python", "bench/gpu_healthcheck.py", *sys.argv[1:]]), "when": results_io.now(),
              "settings": {"node": node, "how": "slurm_plugin/healthcheck.sh under env -i SLURMD_NODENAME=<node>, "
                                                "--no-drain --no-straggler"},
              "runs": {}, "errors": []}
    result["runs"]["healthy"] = healthy = run_check(script, node, state)
    (state / f"inject-fault-{node}").write_text("gpu: injected by bench/gpu_healthcheck.py\n")
    result["runs"]["injected"] = injected = run_check(script, node, state)
    (state / f"inject-fault-{node}").unlink()
    result["runs"]["healthy_again"] = again = run_check(script, node, state)

    gpus = [f for f in healthy["report"].get("findings", []) if f.get("check") == "gpu"]
    checked = [f for f in gpus if not f.get("skipped") and f["detail"].startswith("GPU ")]
    if healthy["rc"] != 0:
        result["errors"].append(f"healthy run exited {healthy['rc']}: {healthy['report']}")
    if not checked:
        result["errors"].append(f"no GPU was checked through NVML: {gpus}")
    reason = injected["report"].get("action") or ""
    if injected["rc"] != 1 or "trainmover: healthcheck" not in reason:
        result["errors"].append(f"injected fault: rc {injected['rc']}, action {reason!r}")
    if again["rc"] != 0:
        result["errors"].append(f"healthy again: rc {again['rc']}")
    result["metrics"] = {
        "gpus_checked": len(checked), "gpu_findings": [f["detail"] for f in gpus],
        "all_gpus_healthy": bool(checked) and all(f["ok"] for f in checked),
        "healthy_wall_s": healthy["wall_s"], "injected_wall_s": injected["wall_s"],
        "healthy_again_wall_s": again["wall_s"], "checks_s": healthy["report"].get("seconds"),
        "injected_rc": injected["rc"], "injected_action": reason,
        "within_10_s": max(healthy["wall_s"], injected["wall_s"], again["wall_s"]) < 10.0,
    }
    result["complete"] = not result["errors"]
    results_io.write(out / "gpu-healthcheck.json", result)
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
