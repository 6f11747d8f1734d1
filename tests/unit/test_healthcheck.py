"""trainmover.healthcheck without Slurm or GPUs: a fake NVML, a fake Slurm client."""
from __future__ import annotations

import sys
import time
from collections import namedtuple
from dataclasses import replace
from types import SimpleNamespace

from trainmover.healthcheck import Finding, Options, decide, run
from trainmover.healthcheck import checks, inject, kmsg, nvml, verdict
from trainmover.healthcheck.readings import NodeReading
from trainmover.healthcheck.decide import MAX_REASON
from trainmover.slurm.model import NodeInfo

Usage = namedtuple("Usage", "total used free")


class FakeNvml:
    """The pynvml functions nvml.read uses; each GPU a dict of what it answers."""
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0
    NVML_NVLINK_MAX_LINKS = 2
    NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT, NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3
    NVML_ERROR_GPU_IS_LOST = 15
    nvmlClocksThrottleReasonHwSlowdown = 0x8

    class Lost(Exception):
        value = 15

    def __init__(self, gpus):
        self.gpus = gpus  # list of dicts

    def _h(self, h):
        if h.get("lost"):
            raise self.Lost()
        return h

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h):
        return h.get("uuid", f"GPU-{self.gpus.index(h)}")

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self._h(h).get("ecc", 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return h.get("pending", 0)

    def nvmlDeviceGetRemappedRows(self, h):
        if "remap" not in h:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return (0, 0, h.get("remap_pending", 0), h["remap"])

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return h.get("throttle", 0)

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1 if link < len(h.get("nvlink", [])) else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        return h["nvlink"][link] if counter == self.NVML_NVLINK_ERROR_DL_CRC_FLIT else 0

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return h.get("pcie", 0)


def _judge_one(reading, prev=None, now=1000.0):
    return verdict.judge(prev, reading, now)


def test_nvml_reading_of_healthy_gpus():
    r = nvml.read(FakeNvml([{"remap": 0, "nvlink": [0, 3]}, {}]), xid_window_ms=0)
    assert [g.uuid for g in r.gpus] == ["GPU-0", "GPU-1"] and r.source == "nvml"
    assert r.gpus[0].counters["nvlink1"] == {"replay": 0, "recovery": 0, "crc_flit": 3, "crc_data": 0}
    assert r.gpus[0].counters["pcie"] == {"pcie_replay": 0} and "nvlink0" in r.gpus[0].counters
    assert [f.ok for f in _judge_one(r).findings] == [True, True]


def test_each_fatal_gpu_sign_is_a_fault_and_throttling_only_a_warning():
    r = nvml.read(FakeNvml([{"ecc": 2}, {"pending": 1}, {"remap": 1}, {"throttle": 0x8}, {"lost": True},
                            {"remap": 0, "remap_pending": 1}]), xid_window_ms=0)
    found = _judge_one(r).findings
    faults = [f.detail for f in found if not f.ok]
    assert faults == ["GPU 0: uncorrectable ECC errors: 2",
                      "GPU 1: page retirement or row remap pending (GPU reset needed)",
                      "GPU 2: row remapping failed", "GPU 4: fallen off the bus (NVML: GPU is lost)",
                      "GPU 5: page retirement or row remap pending (GPU reset needed)"]
    (warn,) = [f for f in found if f.warning]
    assert warn.ok and warn.detail == "GPU 3: warning: throttled: HW slowdown"


def test_nvml_recovery_action_field():

    class WithField(FakeNvml):
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230

        def nvmlDeviceGetFieldValues(self, h, ids):
            assert ids == [230]
            return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=h.get("action", 0)))]
    r = nvml.read(WithField([{"action": 1}, {}]), xid_window_ms=0)
    assert [g.recovery_action for g in r.gpus] == [1, 0]
    assert [f.detail for f in _judge_one(r).findings if not f.ok] == ["GPU 0: driver asks for a recovery action: GPU reset"]


def test_no_nvml_is_a_skip_with_a_note(monkeypatch):
    """Whatever this machine has: pynvml made absent, then present but failing to initialise."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    lib, why = nvml.load()
    assert lib is None and "no GPU checks" in why

    def no_driver():
        raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")
    broken = SimpleNamespace(nvmlInit=no_driver)
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    lib, why = nvml.load()
    assert lib is broken and why == "NVML did not initialise (NVML_ERROR_DRIVER_NOT_LOADED)"


def test_kernel_xids_since_the_last_run_and_not_before_the_first():
    records = ["6,100,1,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
               "6,101,2,-;usb 1-1: new device",
               "6,102,3,-;NVRM: Xid (PCI:0000:5e:00): 13, Graphics Engine Exception",
               "6,103,4,-;NVRM: Xid (PCI:0000:5e:00): 48, DBE"]
    xids = tuple(kmsg.parse_xids(records))
    first = _judge_one(NodeReading("nvml", xids=xids, boot_id="b1"))
    assert not first.findings and first.state.kmsg_seq == 103
    assert any("first run: critical XIDs already in the kernel log" in n for n in first.notes)
    prev = replace(first.state, kmsg_seq=99)  # as if the last run had seen up to 99
    found = _judge_one(NodeReading("nvml", xids=xids, boot_id="b1"), prev).findings
    assert [f.detail for f in found if not f.ok] == ["XID 79 on PCI 0000:3b:00 (kernel log)",
                                                     "XID 48 on PCI 0000:5e:00 (kernel log)"]
    assert [f.detail for f in found if f.warning] == ["warning: XID 13 on PCI 0000:5e:00 (kernel log) (not a critical XID)"]
    again = _judge_one(NodeReading("nvml", xids=xids, boot_id="b1"), first.state)
    assert again.findings == (), "seen XIDs are not reported twice"
    rebooted = _judge_one(NodeReading("nvml", xids=xids[:1], boot_id="b2"), first.state)
    assert [f.detail for f in rebooted.findings] == ["XID 79 on PCI 0000:3b:00 (kernel log)"], \
        "after a reboot the sequence numbers restart: all of this boot's XIDs are new"


# What a user can get into the kernel log: a program named like the driver's line that crashes
# (the kernel prints its name and file name in its own segfault and trap lines), a program too
# long for a name (the kernel keeps 15 characters: `comm`), or a record written to /dev/kmsg.
FORGED = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."
FORGED_RECORDS = [
    f"6,200,1,-;x[4242]: segfault at 0 ip 00007f sp 00007ffd error 4 in {FORGED}[55d0+1000]",
    f"6,201,2,-;traps: {FORGED}[4243] general protection fault ip:7f sp:7ffd error:0 in libc.so.6",
    f"4,202,3,-;{FORGED[:15]}[4244]: segfault at 0 ip 00007f sp 00007ffd error 4 in x[55d0+1000]",
    f"12,203,4,-;{FORGED}",   # facility 1 (LOG_USER), level 4: written from user space
    f"14,204,5,-;{FORGED}",   # the same at level 6
]


def test_only_the_drivers_own_kernel_lines_are_xids():
    genuine = [f"4,300,9,-;{FORGED}", "6,301,10,-;NVRM: Xid (PCI:0000:5e:00): 48, pid=7, DBE\n SUBSYSTEM=pci"]
    assert kmsg.parse_xids(FORGED_RECORDS) == []
    assert [(x.xid, x.where, x.seq) for x in kmsg.parse_xids(FORGED_RECORDS + genuine)] == \
        [(79, "0000:3b:00", 300), (48, "0000:5e:00", 301)]
    # Negative control: the old reading (the pattern anywhere in the text, any facility) took
    # every forged record but the truncated name as a critical XID, and so drained the node.
    old = [r for r in FORGED_RECORDS if kmsg.XID_RE.search(r.partition(";")[2])]
    assert len(old) == len(FORGED_RECORDS) - 1


def test_a_full_tmp_is_reported_but_drains_only_where_the_admin_asks(tmp_path):
    """Every file system looks full here (a minimum of 10^9 GB). By default / and /tmp are
    reported as warnings and nothing is drained; a file system the admin names (--disk) drains.
    Negative control: the old default (/ and /tmp checked as faults) drains the node."""
    full = 1e9
    client = FakeSlurm()
    report = run(Options(node="n1", state_dir=tmp_path, gpu=False, min_free_gb=full), client)
    disks = [f for f in report.findings if f.check == "disk"]
    assert [f.detail.split(":")[0] for f in disks] == ["/", "/tmp"]
    assert all(f.ok and f.warning and "reported only" in f.detail for f in disks)
    assert report.healthy and not report.drained and client.drained == []
    named = run(Options(node="n1", state_dir=tmp_path, gpu=False, min_free_gb=full, disk_paths=("/tmp",)),
                client)
    assert named.drained and client.drained[0][1].startswith("trainmover: healthcheck disk: /tmp: ")
    old_default = run(Options(node="n1", state_dir=tmp_path, gpu=False, min_free_gb=full,
                              disk_paths=("/", "/tmp")), FakeSlurm())
    assert old_default.drained


def test_the_disk_check_drains_only_for_file_systems_named_on_the_command_line(monkeypatch):
    import argparse
    from trainmover.healthcheck import cli as hc_cli
    seen = []
    monkeypatch.setattr(hc_cli, "run", lambda opts, **_: seen.append(opts) or SimpleNamespace(
        healthy=True, findings=[], notes=[], gpu_source="", drained=False,
        action=SimpleNamespace(reason="healthy"), seconds=0.0))
    p = argparse.ArgumentParser()
    hc_cli.add_arguments(p)
    hc_cli.main(p.parse_args(["--node", "n1", "--no-gpu", "--min-free-gb", "5"]))
    hc_cli.main(p.parse_args(["--node", "n1", "--no-gpu", "--min-free-gb", "5", "--disk", "/", "--disk", "/tmp"]))
    assert [(o.disk_paths, o.min_free_gb) for o in seen] == [((), 5.0), (("/", "/tmp"), 5.0)]


def test_disk_and_injection(tmp_path):
    found = checks.check_disk(["/a", "/b"], 5, usage=lambda p: Usage(100e9, 0, 10e9 if p == "/a" else 1e9))
    assert [f.ok for f in found] == [True, False] and "1.0 GB free (minimum 5 GB)" in found[1].detail
    reported = checks.check_disk(["/a", "/b"], 5, usage=lambda p: Usage(100e9, 0, 10e9 if p == "/a" else 1e9),
                                 drains=False)
    assert [(f.ok, f.warning) for f in reported] == [(True, False), (True, True)]
    assert checks.check_injected(inject.read_hook(tmp_path, "n1"), True) == []
    (tmp_path / "inject-fault-n1").write_text("XID 79\n")
    (f,) = checks.check_injected(inject.read_hook(tmp_path, "n1"), True)
    assert not f.ok and f.detail.startswith("XID 79 (fault injected by")


def test_decide():
    bad = [Finding("gpu", False, "GPU 0: uncorrectable ECC errors: 2"), Finding("disk", False, "/: full")]
    ok = [Finding("disk", True, "fine"), Finding("gpu", True, "no NVML", skipped=True)]
    assert not decide(ok, drained=False).drain
    a = decide(bad, drained=False)
    assert a.drain and a.reason == "trainmover: healthcheck gpu: GPU 0: uncorrectable ECC errors: 2 (+1 more)"
    assert not decide(bad, drained=True, current_reason="trainmover: x").drain
    assert "someone else" in decide(bad, drained=True, current_reason="admin").reason
    report_only = decide(bad, drained=False, may_drain=False)  # NHC drains itself, with this text
    assert not report_only.drain and report_only.reason.endswith(a.reason)
    long = decide([Finding("gpu", False, "x" * 500)], drained=False).reason
    assert len(long) == MAX_REASON and long.startswith("trainmover:")


class FakeSlurm:
    def __init__(self, state="IDLE", reason=""):
        self.info = NodeInfo(name="n1", addr="a", state=state, reason=reason)
        self.drained: list[tuple[str, str]] = []

    def nodes(self, names):
        return {n: self.info for n in names}

    def drain(self, node, reason):
        self.drained.append((node, reason))


def test_run_drains_on_fault_once(tmp_path):
    (tmp_path / "inject-fault-n1").write_text("boom\n")
    opts = Options(node="n1", state_dir=tmp_path, disk_paths=(str(tmp_path),), gpu=False)
    client = FakeSlurm()
    report = run(opts, client)
    assert report.drained and client.drained == [("n1", f"trainmover: healthcheck inject: boom (fault injected by {tmp_path}/inject-fault-n1)")]
    again = run(opts, FakeSlurm(state="IDLE+DRAIN", reason=client.drained[0][1]))
    assert not again.drained and "already drained by TrainMover" in again.action.reason


def test_a_hung_check_is_a_fault_within_the_deadline(tmp_path):
    opts = Options(node="n1", state_dir=tmp_path, disk_paths=(str(tmp_path),), gpu=False, deadline_s=0.3)
    client = FakeSlurm()
    t0 = time.monotonic()
    report = run(opts, client, extra=[("gpu", lambda: time.sleep(3) or [])])
    assert time.monotonic() - t0 < 1.5
    assert report.drained and "gpu: check did not finish within 0.3s" in client.drained[0][1]


def test_healthy_run_touches_no_slurm(tmp_path):
    class NoSlurm:
        def __getattr__(self, name):
            raise AssertionError(f"Slurm called: {name}")
    report = run(Options(node="n1", state_dir=tmp_path, disk_paths=(str(tmp_path),), gpu=False,
                         min_free_gb=0), NoSlurm())
    assert report.healthy and not report.drained and report.action.reason == "healthy"


def test_a_controllers_straggler_report_about_this_node_is_a_fault(tmp_path):
    import json

    from trainmover.healthcheck.checks import read_statuses, straggler_findings
    run = tmp_path / "runs" / "41"
    run.mkdir(parents=True)
    verdict = "node train3 (ranks [2]) is 21.0% slower than the median of its peers over the last 3 windows"
    (run / "status.json").write_text(json.dumps({"job_id": 41, "straggler": {
        "mode": "report", "target": "train3", "verdict": verdict}}))
    statuses = read_statuses([(41, str(tmp_path)), (42, str(tmp_path / "not-trainmover"))])
    (finding,) = straggler_findings("train3", statuses)
    assert not finding.ok and finding.check == "straggler" and "21.0% slower" in finding.detail
    assert straggler_findings("train2", statuses) == []           # another node: nothing
    evicting = [{**statuses[0], "straggler": {**statuses[0]["straggler"], "mode": "evict"}}]
    assert straggler_findings("train3", evicting) == []           # the controller moves it itself
