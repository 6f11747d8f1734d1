"""The health check's state directory (state.py), its fault-injection hook (inject.py) and its
GPU sources (source.py, dcgm.py), through `run` with a recorded reading and a fake Slurm:
a corrupt or foreign state is a first run (never a crash, never a drain), every injected
fault kind fails through the same verdict as a real reading, DCGM incidents are read from
dcgmi's JSON."""
from __future__ import annotations

import json
import os
import stat

import pytest

from trainmover.healthcheck import Options, dcgm, inject, run, state
from trainmover.healthcheck import source as sources
from trainmover.healthcheck.rates import Base
from trainmover.healthcheck.readings import GpuReading, NodeReading, reading_from_dict, reading_to_dict

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")

TWO_GPUS = NodeReading("recorded", (
    GpuReading(0, "GPU-aaaa", "0000:18:00.0", counters={"nvlink1": {"replay": 196, "crc_flit": 0},
                                                        "pcie": {"pcie_replay": 0}}),
    GpuReading(1, "GPU-bbbb", "0000:2a:00.0", counters={"pcie": {"pcie_replay": 0}})), boot_id="boot-1")


class StaticSource:
    def __init__(self, reading):
        self.reading = reading

    def read(self):
        return self.reading


class NoSlurm:
    def __getattr__(self, name):
        raise AssertionError(f"Slurm called: {name}")


class FakeSlurm:
    def __init__(self):
        self.drained = []

    def nodes(self, names):
        from trainmover.slurm.model import NodeInfo
        return {n: NodeInfo(name=n, addr="a", state="IDLE", reason="") for n in names}

    def drain(self, node, reason):
        self.drained.append((node, reason))


def check(state_dir, reading=TWO_GPUS, client=None, drain=False):
    opts = Options(node="n1", state_dir=state_dir, disk_paths=("/",), min_free_gb=0, drain=drain)
    return run(opts, client or NoSlurm(), gpu_source=StaticSource(reading))


@pytest.fixture
def sdir(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


# ---- state.py ---------------------------------------------------------------------------------

def test_state_round_trip_is_atomic_and_private(sdir):
    s = state.NodeState("boot-1", 123.5, {"GPU-aaaa": state.GpuState(0, "0000:18:00.0",
                                                                      {"nvlink1": {"replay": Base(1, 2.0, 3)}})}, 77)
    assert state.save(sdir, "n1", s) == []
    path = state.state_path(sdir, "n1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and sorted(p.name for p in sdir.iterdir()) == [path.name]
    assert state.load(sdir, "n1") == (s, [])


def test_missing_state_dir_is_created_private(tmp_path):
    d = tmp_path / "var" / "lib" / "hc"
    report = check(d)
    assert report.healthy and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert state.state_path(d, "n1").exists()


@pytest.mark.parametrize("garbage", ["{not json", '{"version": 99}', '{"version": 1, "gpus": 5}', "[]"])
def test_corrupt_state_is_a_first_run_never_a_crash_nor_a_drain(sdir, garbage):
    state.state_path(sdir, "n1").write_text(garbage)
    state.state_path(sdir, "n1").chmod(0o600)
    huge = NodeReading("recorded", (GpuReading(0, "GPU-aaaa", counters={"nvlink1": {"crc_flit": 10**12}}),))
    report = check(sdir, huge, client=FakeSlurm(), drain=True)
    assert report.healthy and not report.drained
    assert any("unreadable" in n and "new baseline" in n for n in report.notes), report.notes
    assert state.load(sdir, "n1")[0] is not None, "the run wrote a good state over the corrupt one"


@needs_root
def test_foreign_owned_or_group_writable_state_is_set_aside(sdir):
    check(sdir)
    path = state.state_path(sdir, "n1")
    os.chown(path, 1000, 1000)
    prev, notes = state.load(sdir, "n1")
    assert prev is None and "owned by uid 1000" in notes[0] and "new baseline" in notes[0]
    os.chown(path, 0, 0)
    path.chmod(0o620)
    assert state.load(sdir, "n1")[0] is None
    path.chmod(0o600)
    assert state.load(sdir, "n1")[0] is not None


def test_symlinked_state_file_is_not_followed(sdir, tmp_path):
    real = tmp_path / "elsewhere.json"
    real.write_text("{}")
    state.state_path(sdir, "n1").symlink_to(real)
    prev, notes = state.load(sdir, "n1")
    assert prev is None and "not opened" in notes[0]


def test_a_state_dir_others_can_write_is_not_used(sdir):
    sdir.chmod(0o777)
    report = check(sdir)
    assert report.healthy
    assert any("writable by group or others" in n and "state not kept" in n for n in report.notes)
    assert not state.state_path(sdir, "n1").exists()


# ---- inject.py: every fault kind through the same verdict ------------------------------------

FAULT_KINDS = [
    ({"kind": "counter_jump", "gpu": 0}, "GPU 0: NVLink 1 crc_flit: +1000000 in 60s = 1.67e+04/s (threshold 100/s)"),
    ({"kind": "counter_jump", "gpu": 0, "link": "nvlink1", "counter": "replay", "add": 7000},
     "GPU 0: NVLink 1 replay: +7000 in 60s = 117/s (threshold 100/s)"),
    ({"kind": "counter_jump", "gpu": 1}, "GPU 1: PCIe pcie_replay: +1000000 in 60s = 1.67e+04/s (threshold 0.133/s)"),
    ({"kind": "counter_jump", "gpu": 1, "link": "nvlink4", "counter": "recovery", "add": 2},
     "GPU 1: NVLink 4 recovery: +2 in 60s = 0.0333/s (threshold 0.0167/s)"),
    ({"kind": "ecc_uncorrectable", "gpu": 1, "count": 2}, "GPU 1: uncorrectable ECC errors: 2"),
    ({"kind": "row_remap_failure"}, "GPU 0: row remapping failed"),
    ({"kind": "retirement_pending", "gpu": 1}, "GPU 1: page retirement or row remap pending (GPU reset needed)"),
    ({"kind": "fallen_off_bus", "gpu": 1}, "GPU 1: fallen off the bus (NVML: GPU is lost)"),
    ({"kind": "xid", "gpu": 0, "xid": 79}, "XID 79 on GPU 0 (injected)"),
]


@pytest.mark.parametrize("fault,detail", FAULT_KINDS, ids=[f"{f['kind']}-{i}" for i, (f, _) in enumerate(FAULT_KINDS)])
def test_each_injected_fault_kind_fails_and_drains_with_its_evidence(sdir, fault, detail):
    assert check(sdir).healthy  # the baseline
    saved = state.state_path(sdir, "n1").read_bytes()
    inject.hook_path(sdir, "n1").write_text(json.dumps(fault))
    client = FakeSlurm()
    report = check(sdir, client=client, drain=True)
    assert [f.detail for f in report.findings if not f.ok] == [detail]
    assert client.drained == [("n1", f"trainmover: healthcheck gpu: {detail}")]
    assert state.state_path(sdir, "n1").read_bytes() == saved, "injected values never become a baseline"
    inject.hook_path(sdir, "n1").unlink()
    assert check(sdir).healthy, "with the hook gone the node reads healthy again"


def test_injected_counter_jump_on_a_first_run_is_judged_too(sdir):
    inject.hook_path(sdir, "n1").write_text('{"kind": "counter_jump", "gpu": 0, "link": "nvlink1"}')
    report = check(sdir)
    assert [f.detail for f in report.findings if not f.ok] == [
        "GPU 0: NVLink 1 crc_flit: +1000000 in 60s = 1.67e+04/s (threshold 100/s)"]


@pytest.mark.parametrize("control", [{"kind": "counter_reset", "gpu": 0}, {"kind": "xid", "xid": 13}])
def test_controls_pass(sdir, control):
    check(sdir)
    inject.hook_path(sdir, "n1").write_text(json.dumps([control]))
    report = check(sdir)
    assert report.healthy, [f.line() for f in report.findings]


@pytest.mark.parametrize("bad,why", [("[{\"kind\": \"melt\"}]", "kind among"), ("{\"kind\": \"xid\", \"xid\": -1}", "non-negative"),
                                     ("{broken", "not a valid fault list")])
def test_a_malformed_hook_fails_the_check(sdir, bad, why):
    inject.hook_path(sdir, "n1").write_text(bad)
    report = check(sdir)
    assert not report.healthy and why in " ".join(f.detail for f in report.findings if not f.ok)


def test_a_fault_for_a_gpu_the_node_lacks_fails_naming_it(sdir):
    inject.hook_path(sdir, "n1").write_text('{"kind": "fallen_off_bus", "gpu": 5}')
    (f,) = [f for f in check(sdir).findings if not f.ok]
    assert "the reading has no GPU 5 (GPUs: [0, 1])" in f.detail


@needs_root
def test_a_hook_a_user_could_write_is_ignored(sdir):
    hook = inject.hook_path(sdir, "n1")
    hook.write_text("XID 79\n")
    os.chown(hook, 1000, 1000)
    report = check(sdir)
    assert report.healthy and any(f.warning and "ignored" in f.detail for f in report.findings)


def test_the_text_hook_still_fails_as_before(sdir):
    inject.hook_path(sdir, "n1").write_text("XID 48 (injected)\n")
    client = FakeSlurm()
    check(sdir, client=client, drain=True)
    assert client.drained == [("n1", f"trainmover: healthcheck inject: XID 48 (injected) (fault injected by "
                                     f"{sdir}/inject-fault-n1)")]


# ---- sources -----------------------------------------------------------------------------------

DCGM_HEALTH_JSON = {  # dcgmi health -g 0 -c -j (DcgmiOutputJson: body -> GPU -> id -> Errors -> system)
    "header": ["Health Monitor Report"],
    "body": {"Overall Health": {"value": "Failure"},
             "GPU": {"children": {
                 "0": {"value": "Failure", "children": {"Errors": {"children": {
                     "Memory system": {"value": "Failure",
                                       "overflow": ["A volatile double-bit ECC error has occurred on", "GPU 0."]},
                     "NVLINK system": {"value": "Failure", "overflow": ["Detected 4 nvlink replay errors on GPU 0's link 1"]}}}}},
                 "1": {"value": "Warning", "children": {"Errors": {"children": {
                     "PCIe system": {"value": "Warning", "overflow": ["PCIe replay rate exceeded"]}}}}}}}}}


def fake_dcgmi(answers):
    calls = []

    def run_dcgmi(args, timeout):
        calls.append(list(args))
        return answers.pop(0)
    run_dcgmi.calls = calls
    return run_dcgmi


def test_dcgm_health_json_is_parsed_per_gpu():
    overall, incidents = dcgm.parse_health("Health monitor report\n" + json.dumps(DCGM_HEALTH_JSON))
    assert overall == "Failure" and sorted(incidents) == [0, 1]
    mem = incidents[0][0]
    assert (mem.system, mem.health, mem.message) == ("Memory system", "Failure",
                                                     "A volatile double-bit ECC error has occurred on GPU 0.")


def test_dcgm_source_adds_incidents_to_the_nvml_reading_and_names_itself(sdir):
    src = sources.DcgmSource(StaticSource(TWO_GPUS), run=fake_dcgmi([(0, json.dumps(DCGM_HEALTH_JSON))]))
    report = run(Options(node="n1", state_dir=sdir, disk_paths=(str(sdir),), min_free_gb=0, drain=False),
                 NoSlurm(), gpu_source=src)
    assert report.gpu_source == "dcgm+nvml"
    assert [f.detail for f in report.findings if not f.ok] == [
        "GPU 0: DCGM Memory system: Failure: A volatile double-bit ECC error has occurred on GPU 0."]
    warnings = [f.detail for f in report.findings if f.warning]
    assert any("NVLINK system" in w for w in warnings) and any("PCIe system" in w for w in warnings)


def test_dcgm_without_watches_sets_them_and_reports_from_the_next_run():
    fake = fake_dcgmi([(255, "Error: Health watches not enabled. Please enable watches. \n"),
                       (0, "Health monitor systems set successfully.\n")])
    incidents, notes = dcgm.read_incidents(fake)
    assert incidents == {} and fake.calls[1] == ["health", "-g", "0", "-s", "a"] and "from the next run" in notes[0]


def test_a_dcgm_that_does_not_answer_falls_back_to_nvml():
    def hung(args, timeout):
        raise dcgm.DcgmError("dcgmi health -g 0 -c -j did not answer within 2s")
    r = sources.DcgmSource(StaticSource(TWO_GPUS), run=hung).read()
    assert r.source == "recorded" and "DCGM not used (dcgmi health -g 0 -c -j did not answer within 2s)" in r.notes[-1]


def test_source_choice():
    assert isinstance(sources.choose("auto", which=lambda name: "/usr/bin/dcgmi"), sources.DcgmSource)
    assert isinstance(sources.choose("auto", which=lambda name: None), sources.NvmlSource)
    assert isinstance(sources.choose("file:/x.json"), sources.FileSource)
    with pytest.raises(ValueError, match="unknown GPU source"):
        sources.choose("smi")


def test_file_source_round_trip_and_dry_run_label(tmp_path):
    path = tmp_path / "reading.json"
    path.write_text(json.dumps(reading_to_dict(TWO_GPUS)))
    r = sources.FileSource(path).read()
    assert r.source == f"file:{path} (dry run)" and r.gpus == TWO_GPUS.gpus
    path.write_text('{"gpus": [{"uuid": 3}]}')
    with pytest.raises(sources.Unavailable, match="not a GPU reading"):
        sources.FileSource(path).read()
    assert reading_from_dict(reading_to_dict(TWO_GPUS)) == TWO_GPUS
