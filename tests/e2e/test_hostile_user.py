"""Another user against a job on the same cluster (docs/security.md), for real: JOB_USER's demo
job on the embedded Slurm cluster, OTHER_USER (an ordinary user, no Slurm rights) attacking it
with what they can reach, root's health check run as slurmd would run it.

The attacks, each of which must fail while the job migrates off a drained node and completes
bit-exactly (equal to an uninterrupted run of the same template), nothing drained but the
test's own node and nothing lost:

* a `runs/<job>` planted before the job: in JOB_USER's submit directory OTHER_USER cannot make
  one; in a shared sticky directory they can, with a final.json saying "done", and that job
  refuses it (a clear error, exit 2) instead of ending "COMPLETED" untrained;
* a forged `status.json` of OTHER_USER's own job naming its node a straggler: root's health
  check stays healthy and drains nothing (the negative control: told to trust the jobs'
  verdicts, it would call it a fault);
* forged values on every rendezvous key a migration uses, planted again and again;
* 1,000 connections held open on the controller's port that never authenticate, during the
  drain migration (reopened when dropped; bounded in count and time);
* a spoofing job name (`x NodeList=evil[1-2] BatchHost=evil1 WorkDir=/tmp/a`), and a held
  job named like the attacked job's donor requests (trainmover-donor-<job>).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.e2e.conftest import (DRAIN_PREFIX, OTHER_USER, TEST_JOB_PREFIX, as_user, job_ended,
                                user_dir, wait_for)
from tests.e2e.test_migration import (  # noqa: F401 - demo, reference: the session's uninterrupted run
    STEPS, TEMPLATE, Run, assert_same_training, demo, leaver_of, reference, start_training)
from trainmover.cluster.users import host_account
from trainmover.slurm import commands
from trainmover.slurm import argv as build

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
DRAIN_REASON = f"{DRAIN_PREFIX} hostile"
SPOOF_NAME = "x NodeList=evil[1-2] BatchHost=evil1 WorkDir=/tmp/a"
CONNS = 1000


@pytest.fixture
def env(slurm_cluster, job_user):
    base = {**os.environ, "SLURM_CONF": str(slurm_cluster.slurm_conf), "TM_PYTHON": sys.executable,
            "PYTHONPATH": str(ROOT)}
    return {k: v for k, v in base.items() if not k.startswith("TM_") or k == "TM_PYTHON"}


def submit(env: dict, workdir: Path, name: str, *extra: str, user: str | None = None, **tm_env) -> Run:
    job_env = {**env, "TM_STEPS": str(STEPS), **{k: str(v) for k, v in tm_env.items()}}
    out = as_user(["sbatch", "--parsable", f"--job-name={TEST_JOB_PREFIX}{name}", f"--chdir={workdir}", *extra,
                   str(TEMPLATE)], job_env, **({"user": user} if user else {})).stdout
    return Run(int(out.strip().split(";")[0]), workdir, job_env)


def as_other(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", OTHER_USER, "--", *argv], capture_output=True, text=True, timeout=30, **kw)


def chown_other(*paths: Path) -> None:
    acct = host_account(OTHER_USER)
    for p in paths:
        os.chown(p, acct.uid, acct.gid, follow_symlinks=False)


def private_tree(root: Path) -> list[str]:
    """Paths under `root` that another user could read or write (dirs not 0700, files not 0600)."""
    bad = []
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        if p.is_dir() and mode != 0o700 or p.is_file() and mode != 0o600:
            bad.append(f"{p} {mode:o}")
    return bad


def test_another_user_can_neither_read_change_nor_steer_a_job(env, slurm_client, tmp_path, reference):
    ids: list[int] = []
    attacker = None
    leaver = None
    drained_before = {n: i.reason for n, i in slurm_client.nodes().items() if i.drained or i.draining}
    try:
        # --- a run directory planted before the job -----------------------------------------
        home = user_dir("hostile")  # JOB_USER's submit directory, 0700
        probe = as_other(["mkdir", "-p", str(home / "runs" / "1")])
        assert probe.returncode != 0 and "Permission denied" in probe.stderr, probe
        shared = user_dir("shared")  # a site's shared scratch: sticky and writable by all
        os.chown(shared, 0, 0)
        shared.chmod(0o1777)
        (shared / "runs").mkdir()
        (shared / "runs").chmod(0o1777)
        refused = submit(env, shared, "planted", "--hold", "--nodes=2", "--constraint=[tm_keeper*1&tm_train*1]")
        ids.append(refused.job_id)
        planted = shared / "runs" / str(refused.job_id)
        assert as_other(["mkdir", "-m", "0777", str(planted)]).returncode == 0
        forged_final = json.dumps({"job_id": refused.job_id, "steps": STEPS, "digest": "0" * 64})
        for name, text in (("final.json", forged_final), ("status.json", json.dumps({"outcome": {"ok": True}}))):
            assert as_other(["sh", "-c", f"cat > {planted / name}"], input=text).returncode == 0
        as_user(["scontrol", "release", str(refused.job_id)], env)
        # The uninterrupted run to compare with is the session's (`reference`: the same template,
        # steps, seed and user), not one of this test's own (about 15 s more of it).
        assert refused.wait_done(slurm_client, timeout=120) == "FAILED", refused.slurm_out()[-2000:]
        out = refused.slurm_out()
        assert f"belongs to uid {host_account(OTHER_USER).uid}" in out and "Refusing to use it" in out, out[-2000:]
        assert sorted(p.name for p in planted.iterdir()) == ["final.json", "status.json"]  # nothing of the job's
        assert (planted / "final.json").read_text() == forged_final

        # --- the attacked job ----------------------------------------------------------------
        # the drain below is a plain scontrol one, found by the node poll: 1 s here (default 10 s),
        # or on a loaded machine 500 steps ended 12 s after the standby was warm, unmoved; the
        # test acts as the other user in between: pace:0.05 (the same bits) keeps the 300 steps'
        # floor of ~15 s on a fast machine
        run = submit(env, home, "hostile", TM_POLL_S=1, TM_INJECT="pace:0.05")
        ids.append(run.job_id)
        start_training(run, slurm_client)  # also: JOB_USER's, no process of it root's
        assert private_tree(run.dir) == [], "the run directory is the job's user's alone"
        assert as_other(["cat", str(run.dir / "secret")]).returncode != 0

        # OTHER_USER's own job on the free training node: a spoofing name, a forged status.json
        theirs = user_dir("theirs", user=OTHER_USER)
        sleeper = as_user(["sbatch", "--parsable", f"--job-name={SPOOF_NAME}", "--nodes=1", "--constraint=tm_train",
                           f"--chdir={theirs}", "--wrap", "sleep 600"], env, user=OTHER_USER).stdout
        their_job = int(sleeper.strip().split(";")[0])
        donor_like = as_user(["sbatch", "--parsable", "--hold", f"--job-name={build.donor_name(run.job_id)}",
                              f"--chdir={theirs}", "--wrap", "sleep 1"], env, user=OTHER_USER).stdout
        donor_like_id = int(donor_like.strip().split(";")[0])
        ids += [their_job, donor_like_id]
        wait_for("the other user's job to run", lambda: slurm_client.job(their_job).state == "RUNNING", timeout=60)
        info = slurm_client.job(their_job)  # real scontrol output: the name spoofs no field
        their_node = info.batch_host
        assert info.nodes == (their_node,) and not their_node.startswith("evil"), info
        assert info.work_dir == str(theirs) and info.name == SPOOF_NAME
        forged = theirs / "runs" / str(their_job)
        forged.mkdir(parents=True)
        (forged / "status.json").write_text(json.dumps({"job_id": their_job, "straggler": {
            "mode": "report", "target": their_node, "verdict": "forged: 99% slower"}}))
        chown_other(forged.parent, forged, forged / "status.json")

        # root's health check as slurmd runs it (isolated Python, nothing but the node's name)
        def healthcheck(*args):
            return subprocess.run(["env", "-i", f"SLURM_CONF={env['SLURM_CONF']}", f"SLURMD_NODENAME={their_node}",
                                   "PATH=/usr/sbin:/usr/bin:/sbin:/bin", sys.executable, "-I", "-m", "trainmover.cli",
                                   "healthcheck", "--node", their_node, "--no-gpu", "--state-dir", str(tmp_path),
                                   *args], capture_output=True, text=True, timeout=30, cwd="/")
        check = healthcheck()
        assert check.returncode == 0 and "healthy" in check.stdout, check.stdout + check.stderr
        control = healthcheck("--straggler", "--no-drain")  # negative control: the forgery is there
        assert control.returncode == 1 and f"straggler: FAULT: job {their_job}: forged" in control.stdout, control.stdout
        assert not slurm_client.nodes([their_node])[their_node].drained

        # the flood and the forged rendezvous values, from the other user
        ep = json.loads((run.dir / "controller.json").read_text())  # what a port scan finds
        report, stop = theirs / "attack.json", theirs / "stop"
        attacker = subprocess.Popen(
            ["runuser", "-u", OTHER_USER, "--", "env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "tests.e2e.hostile",
             "--control", f"{ep['host']}:{ep['port']}", "--store", f"{ep['store_host']}:{ep['store_port']}",
             "--conns", str(CONNS), "--reopen", "5", "--ranks", "3", "--seconds", "240", "--stop", str(stop),
             "--out", str(report)],
            cwd=str(theirs), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for("the flood to be on", lambda: Path(f"{report}.started").exists() or attacker.poll() is not None,
                 timeout=60)
        assert attacker.poll() is None, attacker.communicate()[0][-2000:]
        assert json.loads(Path(f"{report}.started").read_text())["opened"] >= CONNS * 0.95

        # a drain migration under attack
        wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]),
                 timeout=120, explain=run.explain)
        leaver = leaver_of(run)
        commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={DRAIN_REASON}"],
                     timeout=10, env=run.env)
        wait_for("rank 1 to run on a standby", lambda: run.metrics()[-1]["nodes"][1] != leaver, timeout=60,
                 interval=0.2, explain=run.explain)
        assert run.wait_done(slurm_client, timeout=240) == "COMPLETED", run.slurm_out()[-3000:]
        stop.touch()
        attacker.wait(timeout=30)
        did = json.loads(report.read_text())
        assert did["opened"] >= CONNS and did["dropped_by_server"] >= CONNS * 0.9, did
        assert did["drops_within_s"][-1] < 15, "no unauthenticated connection outlives the handshake deadline"
        assert did["store_claims"] > 0, did

        (m,) = run.status()["migrations"]
        assert (m["leaver"], m["trigger"], m["state"]) == (leaver, "drain", "done"), m
        assert slurm_client.job(run.job_id).restart_count == 0
        assert_same_training(run, reference)  # every step once, losses and final digest equal
        logs = "".join(p.read_text(errors="replace") for p in run.dir.glob("*.log"))
        assert "holds a value not written by this job" in logs, "the forged rendezvous values reached the job"
        assert private_tree(run.dir) == []
        drained = {n: i.reason for n, i in slurm_client.nodes().items() if i.drained or i.draining}
        assert drained == {**drained_before, leaver: DRAIN_REASON}, drained  # root's health check drained nothing
        assert not job_ended(slurm_client, donor_like_id)  # the other user's job is not the donor clean-up's
        print(f"\nflood: {did['opened']} connections opened, {did['dropped_by_server']} dropped by the server "
              f"(longest held {did['drops_within_s'][-1]:.1f}s); {did['store_claims']} forged store claims; "
              f"migration downtime {m['downtime_s']:.3f}s")
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
        if ids:
            commands.run(["scancel", *map(str, ids)], timeout=10, env=env, check=False)
            wait_for("the test's jobs to end", lambda: all(job_ended(slurm_client, j) for j in ids), timeout=90,
                     interval=1.0)
        if leaver is not None:
            slurm_client.resume(leaver)


XID_NAME = "NVRM: Xid (PCI:0000:3b:00.0): 79, x"  # a critical XID, were it the driver's


def test_a_crashing_program_named_like_an_xid_line_is_no_xid():
    """The other user's program, named like an XID line, crashes for real: the kernel prints its
    name (truncated) and its file name in its own segfault line on this host's kernel log. Root's
    XID reading of that log finds no XID in it (what the health check drains on: a GPU node would
    be drained for a critical one). Negative control: the line is there, and the match the health
    check used before issue 37 (the pattern anywhere in the text) finds an XID 79 in it. No GPU
    here: the XID parser runs on the real /dev/kmsg, not the whole GPU check."""
    from trainmover.healthcheck import kmsg
    if not Path("/usr/bin/gcc").exists() or not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("needs gcc and a readable /dev/kmsg")
    d = Path(tempfile.mkdtemp(prefix="tm-xid-", dir="/tmp"))  # pytest's tmp_path is root's 0700: not the other user's
    d.chmod(0o755)
    try:
        _crash_and_read(d, kmsg)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _crash_and_read(d: Path, kmsg) -> None:
    (d / "c.c").write_text("int main(void) { *(volatile int *)0 = 1; return 0; }\n")
    prog = d / XID_NAME
    subprocess.run(["gcc", "-O0", "-o", str(prog), str(d / "c.c")], check=True, timeout=60)
    chown_other(d, prog)
    lines: list[str] = []
    for _ in range(5):  # the kernel rate-limits its segfault lines: try again, bounded
        crashed = as_other([str(prog)])
        assert crashed.returncode in (-11, 139), crashed  # SIGSEGV
        lines = [r for r in kmsg.read_kmsg("/dev/kmsg") if f"in {XID_NAME}[" in r]
        if lines:
            break
    assert lines, "the kernel printed no segfault line (exception-trace off?)"
    assert kmsg.XID_RE.search(lines[-1].partition(";")[2]), lines[-1]  # control: the old match
    assert kmsg.parse_xids(lines) == [], lines[-1]
    # nor in the whole log as root's check reads it (a real XID of this host would be another PCI address)
    assert [x for x in kmsg.parse_xids(kmsg.read_kmsg("/dev/kmsg")) if "3b:00.0" in str(x)] == []


def _root_cluster_command(*argv: str) -> subprocess.CompletedProcess:
    """Root's `trainmover cluster ...`, as an admin types it."""
    return subprocess.run([sys.executable, "-m", "trainmover.cli", "cluster", *argv], capture_output=True,
                          text=True, timeout=120)


def test_a_state_directory_planted_in_var_tmp_is_refused_and_nothing_is_made_through_it():
    """Before root's `cluster up`, the other user plants two state directories under /var/tmp
    (sticky, world-writable, where the embedded cluster keeps its state): a symbolic link to a
    directory of theirs, and a directory of theirs holding a `cluster.json` that names their own
    root filesystem (the daemons would run chrooted in it: root code execution) and the database
    password they would learn. Root's `cluster up`, `status` and `down --dir` refuse each with
    the path, why, and the way out; nothing is created through the link, no `.lock` in the
    planted directory, the planted file is never read as root's. Negative control: `status` on a
    directory root may use (none yet) answers, not configured."""
    acct = host_account(OTHER_USER)
    if acct is None:
        pytest.skip(f"{OTHER_USER} does not exist: the embedded cluster makes it (run with the e2e cluster)")
    tag = f"trainmover-cluster-planted-{os.getpid()}"
    target = Path(tempfile.mkdtemp(prefix="tm-planted-", dir="/tmp"))
    chown_other(target)
    link, own = Path("/var/tmp") / f"{tag}-link", Path("/var/tmp") / f"{tag}-dir"
    free = Path("/var/tmp") / f"{tag}-free"
    evil = {"state_dir": str(own), "nodes": 1, "standby": 0, "root": str(target), "db_password": "learnt"}
    try:
        assert as_other(["ln", "-s", str(target), str(link)]).returncode == 0
        assert as_other(["mkdir", "-m", "0755", str(own)]).returncode == 0
        assert as_other(["tee", str(own / "cluster.json")], input=json.dumps(evil)).returncode == 0
        for planted, why in ((link, "is a symbolic link"), (own, f"belongs to uid {acct.uid}")):
            for argv in (("up", "--nodes", "1", "--standby", "1"), ("status",), ("down",)):
                got = _root_cluster_command(*argv, "--dir", str(planted))
                said = got.stdout + got.stderr
                assert got.returncode != 0 and str(planted) in said and why in said and "remove it" in said, \
                    (argv, got.returncode, said[-2000:])
        assert os.listdir(target) == []  # nothing made through the link
        assert sorted(os.listdir(own)) == ["cluster.json"] and os.lstat(own / "cluster.json").st_uid == acct.uid
        control = _root_cluster_command("status", "--dir", str(free))
        assert '"configured": false' in control.stdout and not free.exists(), control
    finally:
        for p in (link, own, free):
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.exists():
                shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)


def _as_job_user_cli(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`trainmover ...` as the job's user types it in their submit directory."""
    from tests.e2e.conftest import JOB_USER
    return subprocess.run(["runuser", "-u", JOB_USER, "--", sys.executable, "-m", "trainmover.cli", *args],
                          capture_output=True, text=True, timeout=60, env=env, cwd=str(cwd))


def test_runs_renamed_and_replaced_mid_job_is_never_believed(env, slurm_client, reference):
    """A project directory opened to others (writable, not sticky: the case where another user
    can rename what is in it; docs/security.md) is the job's submit directory. Once the job
    trains and its standby is warm, the other user renames `runs/` and puts their own
    `runs/<job>` in its place: a status.json whose outcome says "done", a final.json with a
    forged digest, a journal whose `end` says ok. The job notices none of it and is unaffected:
    the keeper ends it on its own sealed outcome after every step, bit-exactly equal to the
    uninterrupted run; the ranks' checkpoints written after the swap (steps 200 and 250) are in
    the job's own directory, where it was moved, and nothing of the job's reaches the other
    user's; `trainmover status` refuses the other user's directory (naming it and its owner)
    and reads the job's own when pointed at it. Negative control: the forged files are there at
    the path, readable, and say "done"."""
    other_uid = host_account(OTHER_USER).uid
    project = user_dir("project")  # JOB_USER's own project directory ...
    project.chmod(0o777)           # ... opened to everyone, not sticky
    run = submit(env, project, "swapped", TM_INJECT="pace:0.05", TM_CHECKPOINT_EVERY=50)
    jid = run.job_id
    forged_dir = project / "runs" / str(jid)
    moved = Run(jid, project, run.env)
    moved.dir = project / "runs.moved" / str(jid)
    forged = {
        "status.json": json.dumps({"job_id": jid, "world_size": 3, "batch_host": "evil", "nodes": [], "standbys": [],
                                   "standby_pool": {"note": ""}, "migrations": [],
                                   "outcome": {"ok": True, "message": "forged: training finished"}}),
        "final.json": json.dumps({"job_id": jid, "steps": STEPS, "digest": "0" * 64}),
        "journal.jsonl": json.dumps({"v": 2, "seq": 1, "t": 0.0, "kind": "end", "ok": True, "message": "forged"}) + "\n",
    }
    try:
        start_training(run, slurm_client)
        wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]),
                 timeout=120, explain=run.explain)
        # --- the other user's swap ---------------------------------------------------------------
        swap = as_other(["mv", "runs", "runs.moved"], cwd=str(project))
        assert swap.returncode == 0, swap
        step_at_swap = moved.last_step()
        assert as_other(["mkdir", "-m", "0755", "-p", str(forged_dir)]).returncode == 0
        for name, text in forged.items():
            assert as_other(["sh", "-c", f"umask 022; cat > {forged_dir / name}"], input=text).returncode == 0
        # control: at the path the job's files had, a "done" outcome anyone can read
        assert json.loads((forged_dir / "status.json").read_text())["outcome"]["ok"] is True
        assert step_at_swap < 200, f"the swap came at step {step_at_swap}: after the checkpoints it should precede"

        assert run.wait_done(slurm_client, timeout=180) == "COMPLETED", run.slurm_out()[-3000:]
        assert_same_training(moved, reference)  # every step once, losses and final digest equal: unaffected
        assert moved.status()["outcome"]["ok"] is True and "forged" not in json.dumps(moved.status())
        kept = sorted(d.name for d in (moved.dir / "checkpoints").glob("step-*"))
        assert kept == ["step-000000200", "step-000000250"], kept  # the ranks' writes after the swap: the job's
        assert sorted((moved.dir / "checkpoints" / "step-000000250").iterdir()) == sorted(
            moved.dir / "checkpoints" / "step-000000250" / n for n in
            ("manifest.json", "rank-00000.h5", "rank-00001.h5", "rank-00002.h5"))
        assert sorted(os.listdir(forged_dir)) == sorted(forged), "nothing of the job's went to the other user's"
        assert all((forged_dir / n).read_text() == t for n, t in forged.items())
        assert "forged" not in run.slurm_out()
        assert private_tree(moved.dir) == []

        # `trainmover status`, as the job's user types it: the other user's directory is refused
        refused = _as_job_user_cli(run.env, project, "status", "--job", str(jid))
        assert refused.returncode == 2 and "forged" not in refused.stdout, refused
        assert f"{forged_dir} is not the job's user's own directory (uid {other_uid}" in refused.stderr, refused
        own = _as_job_user_cli(run.env, project, "status", "--job", str(jid), "--run-dir", str(moved.dir), "--json")
        assert own.returncode == 0 and json.loads(own.stdout)["outcome"]["ok"] is True, own
        assert "forged" not in own.stdout
        print(f"\nswap at step {step_at_swap}; job {jid} completed bit-exactly in its own directory; "
              f"checkpoints {kept}; status refused uid {other_uid}'s directory")
    finally:
        commands.run(["scancel", str(jid)], timeout=10, env=env, check=False)
        wait_for("the test's job to end", lambda: job_ended(slurm_client, jid), timeout=90, interval=1.0)


def test_a_rogue_pair_peer_feeds_the_joiner_nothing(env, slurm_client, reference):
    """During a drain migration the other user poses as the leaver's transfer pair: every TCP
    listener of the job's user on a node's address that appears (the migration's gloo pair and
    the new groups' listeners of the joiner and the stayers: /proc/net/tcp shows anyone each
    socket's owner) is connected to at once, 64 times, each with a guessed gloo sequence number
    and a forged state (RNG state, step counter); and every value the migration's store keys
    hold is read, looking for those listeners' addresses in it.

    What it shows: the store gives only ciphertext (no address in any value), and nothing of the
    forged state is loaded: every step the job logged has the uninterrupted run's losses (a
    poisoned RNG state or step counter would change them, or the step numbers). gloo itself
    admits whoever sends a pending pair's sequence number first, so the outcome depends on the
    race: either the job's own peers connect first and the migration is done and the job
    completes bit-exactly (an attempt the attack broke is aborted with its reason and retried, or
    a leaver whose send the attack broke stops as a lost rank and its rank is recovered), or the
    other user takes over a pair of the new groups (seen: of the new `world` group) and the job
    fails clearly, its message naming the peer and
    saying that it is none of the job's nodes (a denial of service: docs/security.md, "Known
    limits"); a
    hijacked transfer pair would be refused by the manifest's MAC or gloo's framing, never
    loaded. Controls: the attack code reached listeners of the job's user (its connections were
    accepted), it read the migration's values, and its search finds an address where one is in
    clear."""
    from tests.e2e.conftest import JOB_USER
    home = user_dir("rogue-pair")
    run = submit(env, home, "rogue-pair", TM_POLL_S=1, TM_INJECT="pace:0.05")
    leaver = None
    attacker = None
    theirs = user_dir("rogue-theirs", user=OTHER_USER)
    report, stop = theirs / "attack.json", theirs / "stop"
    try:
        start_training(run, slurm_client)
        wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]),
                 timeout=120, explain=run.explain)
        ep = json.loads((run.dir / "controller.json").read_text())  # the store's port: what a port scan finds
        attacker = subprocess.Popen(
            ["runuser", "-u", OTHER_USER, "--", "env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "tests.e2e.hostile",
             "--store", f"{ep['store_host']}:{ep['store_port']}", "--no-store-claims",
             "--pairs-uid", str(host_account(JOB_USER).uid), "--ranks", "3", "--seconds", "150",
             "--stop", str(stop), "--out", str(report)],
            cwd=str(theirs), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for("the attack to be on", lambda: Path(f"{report}.started").exists() or attacker.poll() is not None,
                 timeout=60)
        assert attacker.poll() is None, attacker.communicate()[0][-2000:]
        leaver = leaver_of(run)
        node_addrs = {i.addr for i in slurm_client.nodes().values()}
        commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={DRAIN_REASON}"],
                     timeout=10, env=run.env)
        state = run.wait_done(slurm_client, timeout=180)
        stop.touch()
        out = attacker.communicate(timeout=60)[0]
        did = json.loads(report.read_text())
        assert did["pair_targets"] and did["pair_connects"] > 0, (did, out[-2000:])  # control: it reached them
        assert did["store_values_read"], did  # control: it read the migration's values
        assert did["search_control"] and did["addresses_in_clear"] == [], did
        # nothing forged loaded: every logged step once, each with the uninterrupted run's losses
        ref = {m["step"]: m["losses"] for m in reference.metrics()}
        got = {m["step"]: m["losses"] for m in run.metrics()}
        assert sorted(got) == list(range(1, max(got) + 1)), "steps logged in order, each once"
        assert all(got[s] == ref[s] for s in got), [s for s in got if got[s] != ref[s]][:5]
        logs = "".join(p.read_text(errors="replace") for p in run.dir.glob("*.log"))
        refused = logs.count("is not sealed with the job's key") + logs.count("not the ones a rank holding")
        migrations = run.status()["migrations"]
        if state == "COMPLETED":
            # the drain's migration done; or an attempt the attack broke (a pair taken over, then
            # lost) aborted with its reason and retried; or the leaver's send failed, it stopped as
            # a lost rank (roles/switch.py) and its rank was recovered: never half-done
            done = [m for m in migrations if m["state"] == "done"]
            broken = [m for m in migrations if m["state"] != "done"]
            assert done and all(b["state"] in ("aborted", "failed") and b["note"] for b in broken), migrations
            if not any((m["leaver"], m["trigger"]) == (leaver, "drain") for m in done):
                assert any(b["trigger"] == "drain" and b["state"] == "failed" for b in broken), migrations
                assert any(m.get("recovery") and m["leaver"] == leaver for m in done), migrations
            assert all(b["state"] == "aborted" for b in broken if b["trigger"] != "drain"), broken
            assert_same_training(run, reference)
            outcome = ("the job completed bit-exactly: "
                       + "; ".join(f"{m['trigger']} of {m['leaver']} done ({m['downtime_s'] or 0:.3f}s down)" for m in done)
                       + "".join(f"; an attempt {b['state']} first: {b['note']}" for b in broken))
        else:  # the other user took over a pair first: a denial of service, clearly said
            said = run.slurm_out()
            assert state == "FAILED", (state, said[-3000:])
            found = re.search(rf"trainmover: job {run.job_id} FAILED: (.*?)\[((?:\d{{1,3}}\.){{3}}\d{{1,3}})\]:\d+",
                              said)  # gloo's [address]:port of the pair's peer
            assert found, said[-3000:]
            assert found.group(2) not in node_addrs, (found.group(0), node_addrs)  # none of the job's
            # and the job's own failure says what that means (controller/foreign_peer.py)
            assert f"peer {found.group(2)} is none of the job's nodes" in said, said[-3000:]
            assert not run.dir.joinpath("final.json").exists()
            outcome = (f"the job failed clearly at step {max(got)}: a pair was taken over from {found.group(2)} "
                       f"({found.group(1).strip()[:120]}...; a denial of service)")
        print(f"\nrogue pair peer: {len(did['pair_targets'])} listeners of the job's user attacked, "
              f"{did['pair_connects']} connections accepted, {did['pair_bytes_sent']} forged bytes sent; "
              f"{len(did['store_values_read'])} store values read, no address in them; states refused by MAC: "
              f"{refused}; {outcome}")
    finally:
        if attacker is not None and attacker.poll() is None:
            stop.touch()
            try:
                attacker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                attacker.kill()
        commands.run(["scancel", str(run.job_id)], timeout=10, env=env, check=False)
        wait_for("the test's job to end", lambda: job_ended(slurm_client, run.job_id), timeout=90, interval=1.0)
        if leaver is not None:
            slurm_client.resume(leaver)
