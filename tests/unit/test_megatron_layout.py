"""The Megatron layout, its groups and its configuration: pure logic, no processes."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from trainmover.config import Config
from trainmover.errors import ConfigError
from trainmover.groups.specs import delta
from trainmover.megatron.layout import Layout, group_specs
from trainmover.workloads import registry

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parents[2]


def test_tp2_pp2_dp2_groups_are_megatrons_rank_sets():
    specs = {g.name: g.ranks for g in group_specs(Layout(2, 2, 2))}
    assert specs["world"] == tuple(range(8))
    tp = sorted(r for n, r in specs.items() if n.startswith("tp.") and len(r) == 2 and r[1] - r[0] == 1)
    assert tp == [(0, 1), (2, 3), (4, 5), (6, 7)]  # tp varies fastest
    assert sorted(r for n, r in specs.items() if n.startswith("pp.")) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert sorted(r for n, r in specs.items() if n.startswith("dp.")) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert sorted(r for n, r in specs.items() if n.startswith("tp-dp.")) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # Embedding groups (first + last stage) equal the pp groups here, so they share them;
    # position-embedding groups hold the first stage alone (as do cp/ep: single ranks).
    assert not any(n.startswith("embd.") for n in specs)
    assert all(len(set(r)) == len(r) for r in specs.values())
    assert len(set(specs.values())) == len(specs), "one group per rank set"


def test_pipeline_of_three_has_its_own_embedding_groups():
    specs = {g.name: g.ranks for g in group_specs(Layout(1, 3, 2))}
    assert specs["pp.0"] == (0, 2, 4) and specs["embd.0"] == (0, 4) and specs["embd.1"] == (1, 5)


def test_pipeline_groups_and_only_those_are_marked_p2p():
    """A pipeline group pre-connects its neighbours (NcclBackend.preconnect): marked p2p
    whatever its name; a group of one stage (PP=1) or of another kind is not."""
    pp3 = {g.name: g for g in group_specs(Layout(1, 3, 1))}
    assert pp3["world"].p2p and pp3["world"].ranks == (0, 1, 2)  # PP-only: the pipeline is the world group
    assert [n for n, g in pp3.items() if g.p2p] == ["world"]
    assert not pp3["embd.0"].p2p  # first + last stage: an all-reduce, no sends
    dp3 = group_specs(Layout(1, 1, 3))
    assert dp3 and not any(g.p2p for g in dp3)  # control: no pipeline, nothing marked
    mixed = {g.name: g for g in group_specs(Layout(2, 2, 2))}
    assert sorted(g.ranks for g in mixed.values() if g.p2p) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert not mixed["world"].p2p


def test_coords_follow_megatrons_order():
    layout = Layout(2, 2, 2)
    assert layout.coords(0) == {"tp": 0, "dp": 0, "pp": 0}
    assert layout.coords(2) == {"tp": 0, "dp": 1, "pp": 0}
    assert layout.coords(7) == {"tp": 1, "dp": 1, "pp": 1}


def test_a_tp_peer_leaving_changes_only_its_groups():
    specs = group_specs(Layout(2, 2, 2))
    d = delta(specs, {1}, epoch=1)
    assert all(1 in g.ranks for g in d.changed)
    assert d.untouched and all(1 not in g.ranks for g in d.untouched)


def test_whole_node_of_tp2_leaving_changes_groups_of_its_two_ranks():
    """TP2 inside a node (ranks 2, 3 on one node of TP2 x PP2): both leave at once; their TP
    group is replaced whole, and every changed group holds one of them."""
    specs = group_specs(Layout(2, 2, 1))
    tp = next(g for g in specs if g.name.startswith("tp."))
    assert tp.ranks == (0, 1)  # tp varies fastest: a node's ranks form a TP group
    d = delta(specs, (2, 3), epoch=1)
    assert d.leavers == (2, 3)
    assert all({2, 3} & set(g.ranks) for g in d.changed)
    assert {g.ranks for g in d.changed} >= {(2, 3), (0, 2), (1, 3), (0, 1, 2, 3)}
    assert all(not {2, 3} & set(g.ranks) for g in d.untouched)


def test_collective_layout_is_the_runtime_hook_not_the_parallel_grid():
    """`Workload.collective_layout()` is what a leaver publishes for its joiner to compare; an
    attribute of the workload must not shadow it (one did: every Megatron leaver failed in Phase 1)."""
    wl = registry.load("megatron_gpt", {"tp": 2, "pp": 2, "dp": 1})
    assert isinstance(wl.collective_layout(), str)
    assert wl.grid == Layout(2, 2, 1)


def test_layout_that_does_not_fit_the_job_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"TP=2 x PP=2 x DP=1 = 4 ranks, but the job has 8"):
        Layout(2, 2, 1).check(8)
    with pytest.raises(ConfigError, match="must be >= 1"):
        Layout(0, 2, 2)
    wl = registry.load("megatron_gpt", {"tp": 2, "pp": 2, "dp": 1})
    with pytest.raises(ConfigError, match="but the job has 8"):
        wl.group_specs(8)


@pytest.mark.parametrize("options, message", [
    ({"tp": 3, "pp": 1, "dp": 1}, "does not split over TP=3"),
    ({"tp": 1, "pp": 4, "dp": 1}, "does not split over TP=1, PP=4"),
    ({"preset": "huge"}, "unknown preset"),
    ({"distributed_optimizer": "maybe"}, "expected 0/1"),
    ({"dtype": "fp16"}, "dtype='fp16'"),
    ({"preset": "tiny", "tp": 1, "pp": 3, "dp": 1}, "does not split over TP=1, PP=3"),
])
def test_bad_workload_options(options, message):
    with pytest.raises(ConfigError, match=message):
        registry.load("megatron_gpt", options)


def test_config_layout_variables():
    cfg = Config.from_env({"TM_TP": "2", "TM_PP": "2", "TM_DP": "2", "TM_DISTRIBUTED_OPTIMIZER": "1",
                           "TM_WORKLOAD": "megatron_gpt"})
    assert cfg.workload_kwargs() == {"tp": 2, "pp": 2, "dp": 2, "distributed_optimizer": True}
    # only what the user set: no layout for gpt_demo, no preset unless TM_MODEL is set
    assert Config.from_env({}).workload_kwargs() == {}
    assert Config.from_env({"TM_MODEL": "small"}).workload_kwargs() == {"preset": "small"}
    assert Config.from_env({"TM_TP": "1", "TM_PP": "1", "TM_DP": "1", "TM_WORKLOAD_OPTIONS": "lr=0.01"}).workload_kwargs() == {
        "tp": 1, "pp": 1, "dp": 1, "distributed_optimizer": False, "lr": 0.01}
    with pytest.raises(ConfigError, match="set all three"):
        Config.from_env({"TM_TP": "2"})
    with pytest.raises(ConfigError, match="needs a Megatron layout"):
        Config.from_env({"TM_DISTRIBUTED_OPTIMIZER": "1"})
    with pytest.raises(ConfigError, match="does not accept options"):
        registry.load("gpt_demo", {"preset": "tiny", "tp": 2})


def test_template_refuses_a_layout_that_does_not_fit_the_allocation(tmp_path):
    stub = tmp_path / "python"
    stub.write_text("#!/bin/sh\necho started\n")
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(tmp_path), "TM_PYTHON": str(stub),
           "SLURM_JOB_NUM_NODES": "9", "TM_DP": "1"}  # 8 training nodes + the keeper
    bad = subprocess.run(["bash", str(ROOT / "sbatch_templates" / "megatron_gpt.sbatch")], env=env,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "but the job has 8 ranks" in bad.stderr and "started" not in bad.stdout
    ok = subprocess.run(["bash", str(ROOT / "sbatch_templates" / "megatron_gpt.sbatch")],
                        env={**env, "TM_DP": "2"}, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "started" in ok.stdout


def test_template_data_parallel_default_takes_what_the_job_holds(tmp_path):
    """The default fits the local cluster (4 training nodes and the keeper: TP2 x PP2 x DP1; with
    2 ranks a node DP2); a layout that cannot fit says what to change."""
    stub = tmp_path / "python"
    stub.write_text("#!/bin/sh\necho TM_DP=$TM_DP\n")
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(tmp_path), "TM_PYTHON": str(stub)}
    template = str(ROOT / "sbatch_templates" / "megatron_gpt.sbatch")

    def render(**extra):
        return subprocess.run(["bash", template], env={**env, **extra}, capture_output=True, text=True, timeout=30)
    assert render(SLURM_JOB_NUM_NODES="5").stdout == "TM_DP=1\n"
    assert render(SLURM_JOB_NUM_NODES="5", TM_RANKS_PER_NODE="2").stdout == "TM_DP=2\n"
    bad = render(SLURM_JOB_NUM_NODES="4")
    assert bad.returncode == 2 and "2 x 2 x 1 = 4, but the job has 3 ranks" in bad.stderr
    assert "submit with --nodes=5 (the keeper node included)" in bad.stderr and "leave TM_DP unset" in bad.stderr
