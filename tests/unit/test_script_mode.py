"""Script mode (trainmover/script): the user's own script served to the runtime as a Workload.

In-process, on one-rank gloo groups: a run of a script is driven step by step; its state taken at
a boundary is loaded by a fresh run that re-enters the loop nest there (epochs, a shuffling
DataLoader with and without worker processes, random augmentation, dropout, the loop's own
counters) and every later loss equals the uninterrupted run's, with negative controls (the
positions or the counters not carried: they differ). The default group is torch's across a swap
of its backend. The example's port changes at most 10 lines and runs under plain torchrun with
the plain script's losses; the checker names each thing a script leaves out.
"""
from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.unit.gloo_world import gloo_groups, serve_store
from trainmover.errors import ConfigError
from trainmover.groups import rng
from trainmover.groups.swappable import SwappableGroup
from trainmover.runtime.transfer import state as transfer
from trainmover.script.workload import ScriptWorkload
from trainmover.workloads.base import BuildContext

# Each test in a pytest process of its own: these run gloo groups, script threads and DataLoader
# workers in the test process, and a later test that forks (gloo_threads) must not inherit them
# (a forked child hung in a gloo send once after these had run in its worker).
pytestmark = pytest.mark.own_process

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "scripts"
TIMEOUT = datetime.timedelta(seconds=30)

# A script with what makes re-entry hard: an outer epoch loop whose head draws from the global
# RNG, a shuffling DataLoader (RandomSampler: its seed is drawn when the iterator is made),
# augmentation drawn in __getitem__ (in the main process or in workers), dropout, an enumerate
# index, and a counter of its own that decides the learning rate.
SCRIPT = '''
import os, sys, torch, torch.distributed as dist
import trainmover.script as tm

class Noisy(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g)
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.rand(6), self.y[i]

def main():
    tm.init("gloo")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    workers = int(os.environ.get("TEST_WORKERS", "0"))
    loader = torch.utils.data.DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=workers)
    counter = 0
    tm.track(model=model, optimizer=opt)
    for epoch in tm.loop(range(100)):
        jitter = torch.rand(1).item()            # an epoch's head that draws
        for i, (x, y) in tm.enumerate(loader):
            counter += 1
            for g in opt.param_groups:
                g["lr"] = 0.01 * (1 + (counter % 5) / 10) * (1 + jitter)
            loss = torch.nn.functional.mse_loss(model(x), y)
            dist.all_reduce(loss.detach().clone())  # the default group, no group argument
            opt.zero_grad()
            loss.backward()
            opt.step()
            tm.step(loss, counter=counter)

main()
'''


@pytest.fixture(scope="module")
def store_port():
    master, port = serve_store(TIMEOUT)
    yield port
    del master


_groups = iter(range(10_000))


def one_rank_world(port: int) -> dict:
    (inner,) = gloo_groups(port, f"w{next(_groups)}/", 1, TIMEOUT)
    return {"world": SwappableGroup("world", 0, 1, [0], inner)}


def context(groups) -> BuildContext:
    return BuildContext(rank=0, world_size=1, groups=groups, seed=1, options={"device": "cpu"})


def script_at(tmp_path: Path, text: str = SCRIPT) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text))
    return path


def train(wl: ScriptWorkload, steps: int) -> list[float]:
    return [wl.train_step(s) for s in range(steps)]


def saved(wl: ScriptWorkload) -> dict:
    """What a snapshot keeps of the rank (host copies), as Agent.full_state takes it."""
    return transfer.host_copy({"workload": wl.state_dict(), "rng": rng.capture()})


def resumed(path: Path, port: int, state: dict, steps: int) -> list[float]:
    wl = ScriptWorkload(str(path))
    wl.build(context(one_rank_world(port)))
    wl.load_state_dict(transfer.host_copy(state)["workload"])
    rng.restore(state["rng"])
    try:
        return train(wl, steps)
    finally:
        wl.release()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("at", [7, 10, 23])  # inside an epoch, at an epoch's last batch, later
def test_a_fresh_run_reenters_the_loop_where_the_state_was_taken(tmp_path, store_port, monkeypatch, workers, at):
    monkeypatch.setenv("TEST_WORKERS", str(workers))
    path = script_at(tmp_path)
    ref = ScriptWorkload(str(path))
    ref.build(context(one_rank_world(store_port)))
    first = train(ref, at)
    state = saved(ref)
    assert state["workload"]["loop"]["counters"] == {"counter": at}
    rest = train(ref, 12)
    ref.release()
    assert resumed(path, store_port, state, 12) == rest  # bit for bit
    assert len(set(first + rest)) > 10


def test_negative_controls_positions_or_counters_not_carried_differ(tmp_path, store_port):
    path = script_at(tmp_path)
    ref = ScriptWorkload(str(path))
    ref.build(context(one_rank_world(store_port)))
    train(ref, 13)
    state = saved(ref)
    rest = train(ref, 8)
    ref.release()
    no_counter = transfer.host_copy(state)
    no_counter["workload"]["loop"]["counters"] = {}
    assert resumed(path, store_port, no_counter, 8) != rest
    inner_at_start = transfer.host_copy(state)
    inner_at_start["workload"]["loop"]["levels"][-1]["pos"] = 1
    assert resumed(path, store_port, inner_at_start, 8) != rest


def test_the_default_group_is_the_swappable_world_across_a_swap(tmp_path, store_port):
    path = script_at(tmp_path, '''
        import torch, torch.distributed as dist
        import trainmover.script as tm
        tm.init("gloo")
        seen = []
        tm.track(seen={"n": 0})
        for step in tm.loop(range(6)):
            t = torch.ones(2)
            dist.all_reduce(t)          # no group argument: the default group
            dist.barrier()
            seen.append((dist.get_rank(), dist.get_world_size(), dist.is_initialized(), t.tolist()))
            tm.step(float(step))
        import json, os
        open(os.environ["TEST_OUT"], "w").write(json.dumps(seen))
        ''')
    os.environ["TEST_OUT"] = str(tmp_path / "seen.json")
    groups = one_rank_world(store_port)
    wl = ScriptWorkload(str(path))
    wl.build(context(groups))
    assert dist.get_rank() == 0 and os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    assert train(wl, 3) == [0.0, 1.0, 2.0]
    gen = groups["world"].generation
    (new_inner,) = gloo_groups(store_port, f"w{next(_groups)}/", 1, TIMEOUT)
    groups["world"].swap(new_inner)  # a migration's swap, underneath the script
    assert groups["world"].generation == gen + 1
    assert train(wl, 3) == [3.0, 4.0, 5.0]
    from trainmover.script.run import ScriptEnded
    with pytest.raises(ScriptEnded):  # the loop is over: the code after it ran
        wl.train_step(6)
    import json
    assert json.loads((tmp_path / "seen.json").read_text()) == [[0, 1, True, [1.0, 1.0]]] * 6


def test_a_boundary_outside_tm_loop_is_refused_clearly(tmp_path, store_port):
    path = script_at(tmp_path, '''
        import trainmover.script as tm
        tm.init()
        tm.step(1.0)
        ''')
    wl = ScriptWorkload(str(path))
    with pytest.raises(ConfigError, match=r"tm.step\(\) was called outside tm.loop"):
        wl.build(context(one_rank_world(store_port)))


def test_the_calls_do_nothing_under_plain_python(tmp_path):
    """No TrainMover run: loop returns its argument, step and track do nothing, is_live is True."""
    import trainmover.script as tm
    data = [1, 2, 3]
    assert tm.loop(data) is data and list(tm.enumerate(data, 1)) == [(1, 1), (2, 2), (3, 3)]
    assert tm.step(1.0, counter=1) is None and tm.track(x={}) is None and tm.is_live()


def _code_lines(path: Path) -> list[str]:
    text = path.read_text()
    text = re.sub(r'\A"""(.|\n)*?"""\n', "", text)  # the module docstring says which file it is
    return text.splitlines()


def test_the_ported_example_changes_at_most_ten_lines():
    import difflib
    diff = [ln for ln in difflib.unified_diff(_code_lines(EXAMPLES / "train_plain.py"),
                                               _code_lines(EXAMPLES / "train_tm.py"), lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    removed, added = sum(ln.startswith("-") for ln in diff), sum(ln.startswith("+") for ln in diff)
    assert max(removed, added) <= 10 and added >= 5, diff
    assert "+    tm.init(\"gloo\")" in diff and any("tm.step(loss" in ln for ln in diff)


def _torchrun(script: Path, tmp_path: Path, name: str) -> tuple[list[str], dict]:
    out = tmp_path / f"{name}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), "--epochs", "2", "--out", str(out)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch")], torch.load(out)


def test_the_port_still_runs_under_plain_torchrun_with_the_same_losses(tmp_path):
    plain_log, plain_model = _torchrun(EXAMPLES / "train_plain.py", tmp_path, "plain")
    tm_log, tm_model = _torchrun(EXAMPLES / "train_tm.py", tmp_path, "tm")
    assert plain_log and tm_log == plain_log
    assert all(torch.equal(plain_model[k], tm_model[k]) for k in plain_model)


# The checker on scripts: the example is exact; a GradScaler left out (whose scale does not
# change within the compared steps: no compared run can show it) and a counter the loop's
# learning rate depends on left out are each named; with both carried the same script is exact.
SCALER = ("    tm.track(model=model, optimizer=opt, scheduler=sched)\n",
          "    scaler = torch.amp.GradScaler('cpu')\n    global_step = 0\n{track}")
STEP = ("            loss.backward()\n            opt.step()\n",
        "            scaler.scale(loss).backward()\n            global_step += 1\n"
        "            opt.param_groups[0]['lr'] *= 1.0 + 1e-3 * (global_step % 7)\n"
        "            scaler.step(opt)\n            scaler.update()\n")


def _variant(tmp_path: Path, name: str, track: str, boundary: str) -> Path:
    text = (EXAMPLES / "train_tm.py").read_text()
    text = text.replace(SCALER[0], SCALER[1].format(track=track)).replace(STEP[0], STEP[1])
    text = text.replace("            tm.step(loss)\n", boundary)
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def _check(script: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmover.cli", "check-workload", "--steps", "8", str(script),
                           "--epochs", "8"], capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_checker_names_an_untracked_scaler_and_a_counter_not_passed(tmp_path):
    bad = _variant(tmp_path, "bad", SCALER[0], "            tm.step(loss)\n")
    out = _check(bad)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "'scaler' is a GradScaler that tm.track() does not carry" in out.stdout, out.stdout
    assert "'global_step' changes at every step and is not passed to tm.step()" in out.stdout, out.stdout
    assert "migration    FAIL" in out.stdout  # the learning rate follows the counter: a compared run shows it


def test_the_checker_passes_the_same_script_with_both_carried(tmp_path):
    """The example with a GradScaler and a counter of its own, both carried: a superset of the
    example, so the example's own check is this one (a check costs ~30 s of 2 cores; the example
    itself moves for real in tests/e2e/test_script_mode.py)."""
    good = _variant(tmp_path, "good", SCALER[0].replace("scheduler=sched", "scheduler=sched, scaler=scaler"),
                    "            tm.step(loss, global_step=global_step)\n")
    out = _check(good)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "script       ok" in out.stdout and "a migration would be exact" in out.stdout, out.stdout


def test_the_scripts_own_error_comes_out_as_itself_with_its_traceback(tmp_path, store_port):
    """An error of the script is raised by train_step as the script's own (the runtime's guard
    then reports it as the user's: runtime/usercode.py), with the script's line in its
    traceback; never a lost peer, since no collective failed."""
    import traceback
    from trainmover.groups.swappable import first_failure
    path = script_at(tmp_path, '''
        import trainmover.script as tm
        tm.init()
        for step in tm.loop(range(10)):
            if step == 3:
                raise ValueError("the script's own bug at step 3")
            tm.step(float(step))
        ''')
    groups = one_rank_world(store_port)
    wl = ScriptWorkload(str(path))
    wl.build(context(groups))
    assert train(wl, 3) == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="own bug at step 3") as info:
        wl.train_step(3)
    assert any(frame.filename == str(path) for frame in traceback.extract_tb(info.value.__traceback__))
    assert first_failure(groups.values()) is None
