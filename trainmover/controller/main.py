"""The job-step controller: runs in the batch step, launches workers and standby agents as
Slurm steps, watches the job's nodes and carries out the policy's actions.

This is the only place of the controller with effects: Slurm calls (through
`trainmover.slurm`), processes, sockets and files. Decisions live in `policy`.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from trainmover.config import Config
from trainmover.control import channel
from trainmover.control.messages import make
from trainmover.controller import records
from trainmover.controller.actions import AcquireStandby, Finish, LaunchStandby, Record, ReleaseNode, Send
from trainmover.controller.policy import JobView, Policy
from trainmover.errors import ConfigError, SlurmError, TrainMoverError
from trainmover.runtime.spec import ENV as SPEC_ENV, WorkerSpec
from trainmover.slurm.client import CliSlurm
from trainmover.slurm.model import BatchHostRelease, NoStandbyAvailable
from trainmover.workloads import base as workloads

log = logging.getLogger("trainmover.controller")


class Controller:
    def __init__(self, cfg: Config, job_id: int, slurm=None, environ=os.environ):
        self.cfg, self.job_id = cfg, job_id
        self.slurm = slurm or CliSlurm()
        self.environ = dict(environ)
        job = self.slurm.job(job_id)
        self.job = job
        nodes = list(job.nodes)
        infos = self.slurm.nodes(nodes)
        self.addr = {n: infos[n].addr for n in nodes}
        self.batch_host = job.batch_host or nodes[0]
        self.host = self.addr[self.batch_host]  # bind to our node's own address, from Slurm
        k = cfg.ranks_per_node
        self.view = JobView(job_id, len(nodes) * k, k, self.batch_host,
                            {i * k + j: n for i, n in enumerate(nodes) for j in range(k)})
        # A layout that cannot fit the job (TP x PP x DP != ranks) fails here, before any launch.
        workloads.load(cfg.workload, cfg.workload_kwargs()).group_specs(self.view.world_size)
        self.policy = Policy(cfg, self.view)
        self.files = records.RunFiles(Path(cfg.run_dir or records.run_dir(job.work_dir or os.getcwd(), job_id)))
        try:
            self.key = channel.write_secret(str(self.files.secret))
        except FileExistsError:
            raise ConfigError(f"{self.files.root} already holds a job secret: a controller of job {job_id} ran "
                              "there before (a requeued job?). Move that directory away, or set TM_RUN_DIR "
                              "to a new one; TrainMover never reuses another controller's secret.") from None
        self.server = channel.Server(self.host, self.key)
        self.store, self.store_port = self._store()
        self.files.write("controller", {"host": self.server.address[0], "port": self.server.address[1],
                                        "job_id": job_id, "batch_host": self.batch_host})
        self.events: queue.Queue = queue.Queue()   # results of background Slurm work
        self.conns: dict[str, list] = {}           # node -> authenticated worker connections
        self.steps: dict[str, subprocess.Popen] = {}
        self.outcome: tuple[bool, str] | None = None

    def _store(self):
        # TCPStore for gloo rendezvous, on a socket bound to this node's address: every node
        # of the local cluster shares one port space, and a real cluster has several NICs.
        sock = socket.create_server((self.host, 0), backlog=1024)
        port = sock.getsockname()[1]
        store = dist.TCPStore(self.host, port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.cfg.group_timeout_s),
                              master_listen_fd=sock.detach(), use_libuv=False)
        return store, port

    # --- launching -----------------------------------------------------------------------
    def _spec(self, role: str, node: str, ranks: tuple[int, ...]) -> WorkerSpec:
        return WorkerSpec(role=role, ranks=ranks, world_size=self.view.world_size, node=node,
                          node_addr=self.addr[node], controller=tuple(self.server.address),
                          store=(self.host, self.store_port), secret_file=str(self.files.secret),
                          workload=self.cfg.workload, workload_options=self.cfg.workload_kwargs(),
                          device=self.cfg.device, backend=self.cfg.backend,
                          record_iterations=self.cfg.record_iterations, record_rank=self.cfg.record_rank,
                          recording_path=str(self.files.root / "recordings" / f"rank{self.cfg.record_rank}.h5")
                          if self.cfg.record_iterations else "",
                          record_from_step=self.cfg.record_from_step, record_versions=self.cfg.record_versions,
                          standby_warmup=self.cfg.standby_warmup,
                          seed=self.cfg.seed, steps=self.cfg.steps, group_timeout_s=self.cfg.group_timeout_s,
                          switch_timeout_s=self.cfg.switch_timeout_s, recovery_timeout_s=self.cfg.recovery_timeout_s,
                          shadow_steps=self.cfg.shadow_steps,
                          inject=self.cfg.inject)

    def _launch(self, role: str, node: str, ranks: tuple[int, ...]) -> None:
        spec = self._spec(role, node, ranks)
        argv = self.slurm.step_argv(self.job_id, node, [sys.executable, "-m", "trainmover.runtime.worker"],
                                    ntasks=self.cfg.ranks_per_node)
        env = self.slurm.step_env(self.slurm.job(self.job_id), self.environ)
        env[SPEC_ENV] = spec.to_env()
        log_path = self.files.root / f"{role}-{node}.log"
        with open(log_path, "ab") as out:
            self.steps[node] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
        log.info("launched %s on %s (ranks %s), log %s", role, node, list(ranks), log_path)

    # --- background Slurm work -------------------------------------------------------------
    def _background(self, name: str, fn) -> None:
        def run():
            try:
                self.events.put(fn())
            except Exception as exc:  # noqa: BLE001 - turned into an event for the policy
                self.events.put(("error", name, exc))
        threading.Thread(target=run, name=f"tm-{name}", daemon=True).start()

    def _acquire(self):
        try:
            node = self.slurm.grow(self.job_id, reservation=self.cfg.reservation, timeout=self.cfg.standby_wait_s)
        except NoStandbyAvailable as exc:
            return ("unavailable", str(exc))
        except SlurmError as exc:
            return ("unavailable", f"taking a standby failed: {exc}")
        self.addr[node] = self.slurm.nodes([node])[node].addr
        return ("acquired", node)

    def _release(self, node: str):
        keep = [n for n in self.slurm.job(self.job_id).nodes if n != node]
        try:
            self.slurm.shrink(self.job_id, keep)
            return ("released", node, True, "")
        except BatchHostRelease:
            return ("released", node, False, f"{node} runs the batch script: it stays in the job until the job ends")
        except SlurmError as exc:
            return ("released", node, False, f"release failed: {exc}")

    # --- the loop ------------------------------------------------------------------------
    def apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, AcquireStandby):
                self._background("acquire", self._acquire)
            elif isinstance(a, LaunchStandby):
                self._launch("standby", a.node, ())
            elif isinstance(a, Send):
                for node in a.nodes:
                    for conn in self.conns.get(node, []):
                        try:
                            conn.send(a.msg)
                        except OSError as exc:
                            log.warning("cannot send %s to %s: %s", a.msg["type"], node, exc)
            elif isinstance(a, ReleaseNode):
                self._background("release", lambda n=a.node: self._release(n))
            elif isinstance(a, Record):
                if a.stream == "final":
                    self.files.write("final", a.payload)
                else:
                    self.files.append(a.stream, a.payload)
            elif isinstance(a, Finish):
                self.outcome = (a.ok, a.message)

    def handle_peer(self, conn, msg, now: float) -> list:
        kind = msg["type"]
        if kind == "hello":
            self.conns.setdefault(msg["node"], []).append(conn)
            return []
        if kind in ("migrate", "status"):  # CLI requests: one reply, then the CLI hangs up
            if kind == "migrate":
                ok, text, actions = self.policy.request(now, msg["node"], "manual")
            else:
                ok, text, actions = True, "", []
            try:
                conn.send(make("reply", ok=ok, message=text, data=self.policy.status()))
            except OSError as exc:  # the requester is gone (or was dropped for a bad message): its loss
                log.warning("could not reply to %s: %s", conn.peer, exc)
            return actions
        node = (conn.identity or {}).get("node")
        if node is None:
            return []
        if kind == "failed":
            log.error("rank %d on %s failed in %s: %s", msg["rank"], node, msg["phase"], msg["error"])
        return self.policy.on_message(now, node, msg)

    def handle_gone(self, conn, now: float) -> list:
        """A peer's connection closed. For a rank's agent that has not finished or handed its
        state over, this is the fastest sign that it died (the kernel closes a killed
        process's sockets at once; Slurm reports the step's end later)."""
        hello = conn.identity or {}
        node = hello.get("node")
        if hello.get("type") != "hello" or node is None:
            return []  # a CLI request, or a peer that never authenticated
        if conn in self.conns.get(node, []):
            self.conns[node].remove(conn)
        return self.policy.on_peer_gone(now, node)

    def run(self) -> int:
        for node in self.view.train_nodes():
            self._launch("worker", node, self.view.ranks_of(node))
        self.apply(self.policy.start(time.time()))
        next_poll = 0.0
        last_status = None
        while self.outcome is None:
            now = time.time()
            actions = []
            if now >= next_poll:
                next_poll = now + self.cfg.poll_s
                watched = self.view.train_nodes() + list(self.view.standbys) + self.view.released
                try:
                    actions += self.policy.on_nodes(now, self.slurm.nodes(watched))
                except SlurmError as exc:  # slurmctld slow or down: keep training, try again
                    log.warning("node poll failed: %s", exc)
                actions += self.policy.on_tick(now)
            for node, proc in list(self.steps.items()):
                code = proc.poll()
                if code is not None:
                    del self.steps[node]
                    actions += self.policy.on_step_exit(now, node, code)
            while True:
                try:
                    ev = self.events.get_nowait()
                except queue.Empty:
                    break
                actions += self._on_event(now, ev)
            self.apply(actions)
            try:
                conn, msg = self.server.inbox.get(timeout=min(0.2, max(0.01, next_poll - time.time())))
                # then what queued up, without waiting, but bounded: step reports of many ranks
                # arrive faster than one loop turn, and node polls and step exits must still run
                budget = time.monotonic() + 0.1
                while True:
                    self.apply(self.handle_peer(conn, msg, time.time()) if msg is not None
                               else self.handle_gone(conn, time.time()))
                    if time.monotonic() > budget:
                        break
                    conn, msg = self.server.inbox.get_nowait()
            except queue.Empty:
                pass
            status = self.policy.status()
            if status != last_status:
                self.files.write("status", status)
                last_status = status
        return self.shutdown()

    def _on_event(self, now: float, ev) -> list:
        kind = ev[0]
        if kind == "acquired":
            log.info("standby %s joined the allocation", ev[1])
            return self.policy.on_standby_acquired(now, ev[1])
        if kind == "unavailable":
            return self.policy.on_standby_unavailable(now, ev[1])
        if kind == "released":
            return self.policy.on_released(now, ev[1], ev[2], ev[3])
        log.error("background %s failed: %s", ev[1], ev[2])
        if ev[1] == "acquire":
            return self.policy.on_standby_unavailable(now, str(ev[2]))
        return []

    def shutdown(self) -> int:
        ok, message = self.outcome
        status = self.policy.status()
        status["outcome"] = {"ok": ok, "message": message}
        self.files.write("status", status)
        log.info("controller: %s", message)
        if hasattr(self.slurm, "cancel_donors"):  # a standby being taken right now must not outlive us
            try:
                gone = self.slurm.cancel_donors(self.job_id)
                if gone:
                    log.info("withdrew donor allocation(s) %s", gone)
            except SlurmError as exc:
                log.warning("could not withdraw donor allocations: %s", exc)
        for conns in self.conns.values():  # standbys exit when the channel closes
            for conn in conns:
                conn.close()
        deadline = time.time() + 30
        for node, proc in self.steps.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                log.warning("step on %s did not end; terminating it", node)
                proc.terminate()
        self.server.close()
        self.files.close()
        return 0 if ok else 1


def main(argv=None) -> int:
    logging.basicConfig(level=os.environ.get("TM_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        job_id = int(os.environ["SLURM_JOB_ID"])
    except (KeyError, ValueError):
        raise ConfigError("trainmover controller runs inside a Slurm job (SLURM_JOB_ID is not set)") from None
    cfg = Config.from_env()
    return Controller(cfg, job_id).run()
