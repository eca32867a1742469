"""provider="slurm": the nodes of one SLURM allocation, held by a batch job for the pool's life.

Start: check the request with `sbatch --test-only` (SLURM's own refusal, naming the field, before
anything is queued), submit the batch job, wait while it is pending (SLURM's reason and the
queue position said as progress; past `ready_timeout_seconds` it is cancelled), then start one
node agent per allocated node as a job step (`srun --jobid J --overlap -w NODE`), whose stdin and
stdout are the node's stream. The controller's skytasks reaches each node through that same
stream on first use (content-addressed under ~/.cache/skytasks, so a shared home gets it once).

A lost node is replaced by a one-node allocation of its own that excludes every node lost so far.
Stop, on every path: end the steps, `scancel` every job, and wait until none is left in the
queue. Without the controller, the batch job ends itself after `idle_minutes` of silence, and
`--time` (from `max_lifetime_minutes`; without it, the partition's limit) bounds it; `skytasks gc
--slurm` cancels skytasks jobs past their expiry, a lease renewed while the controller lives.
"""

from __future__ import annotations

import concurrent.futures
import logging
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from skytasks.errors import PoolConfigError, PoolGone, PoolStartError
from skytasks.pool_spec import PoolSpec
from skytasks.providers import Capabilities, NodeLink, NodeProvider, agent_args
from skytasks.providers.remote_fields import Lease
from skytasks.event_bus import PoolReporter
from skytasks.providers.teardown import uninterruptible
from skytasks.providers.slurm import job as slurm_job, lease as slurm_lease
from skytasks.providers.slurm.node_steps import NodeSteps
from skytasks.providers.slurm.shell import SlurmShell
from skytasks.providers.slurm.spec import SlurmSettings
from skytasks.settings import settings

# A job in one of these states is SLURM's word that it no longer runs ("": not in the queue).
ENDED_STATES = frozenset({"", "COMPLETED", "COMPLETING", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"})

POLL_SECONDS = 1.0
GROW_WAIT_SECONDS = 10.0  # how long a call may wait for the nodes that grow an elastic pool back


@dataclass
class AllocatedNode:
    name: str  # SLURM's node name (srun -w)
    address: str  # NodeAddr: where its peers reach it
    job_id: str


class SlurmProvider(NodeProvider):
    # An allocation waits in a queue and is billed: never a second one per call. An agent's step
    # lives on when srun's stream is lost (srun's own stdin and stdout closed, as when the
    # controller's link to slurm_login drops): a step beside it reaches it again. A replacement's
    # allocation excludes every node lost (or found unhealthy) so far.
    capabilities = Capabilities(gpus_from_config=True, reattaches=True, replaces_elsewhere=True)

    def __init__(self, spec: PoolSpec, reporter: PoolReporter | None = None):
        self._spec = spec
        self._slurm = spec.own(SlurmSettings)
        self.pool_id = f"{slurm_job.JOB_PREFIX}{uuid.uuid4().hex[:10]}"
        self.reporter = reporter or PoolReporter(spec.name, "slurm")
        self.reporter.key = self.pool_id
        self.shell = SlurmShell(self._slurm, self.reporter)
        self.jobs: list[str] = []  # every job this pool submitted, cancelled at stop
        self.nodes: dict[int, AllocatedNode] = {}  # node id -> where it runs
        self.lost: set[str] = set()  # node names lost so far: never allocated again by this pool
        self._steps = NodeSteps(self.shell, spec, self.reporter)
        self._aborted = threading.Event()
        self._stop_lock = threading.Lock()
        self._lease = Lease(self._slurm.idle_minutes, self._slurm.max_lifetime_minutes)
        self._lease.keep_warm_minutes = spec.keep_warm_minutes  # a released warm pool is no orphan
        self._ended: set[str] = set()  # jobs gone from the queue: their lease is not renewed

    def abort(self) -> None:
        self._aborted.set()

    # -- start ------------------------------------------------------------------------------

    def start(self) -> list[NodeLink]:
        spec = self._spec
        self._check_request()  # SLURM's refusal, before anything is queued
        self._lease.keep(self._renew_lease, lambda line: self.reporter.note(f"{self.pool_id}: {line}", logging.WARNING),
                         name=f"skytasks-lease-{self.pool_id}")
        try:
            job_id = self._submit(spec.nodes, fewest=spec.min_nodes)
            names = self._wait_running(job_id, spec.nodes)
            self.nodes = dict(enumerate(AllocatedNode(n, a, job_id) for n, a in self._addresses(names).items()))
            if len(names) < spec.nodes:  # an elastic pool: SLURM gave what was free
                self.reporter.note(f"{self.pool_id}: job {job_id} got {len(names)} of {spec.nodes} nodes "
                                     f"(--nodes={spec.min_nodes}-{spec.nodes}); {self._why_not_more(names)}")
            self.reporter.progress(0, len(names), f"job {job_id} running on {', '.join(names)}; starting node agents")
            with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as pool:
                links = list(pool.map(self._start_node, list(self.nodes)))
            self.reporter.progress(len(links), len(names), f"job {job_id}: every node agent is up")
            return links
        except BaseException:
            self.stop()
            raise

    def _renew_lease(self, until: datetime) -> None:
        self._ended.update(slurm_lease.renew(self.shell, [j for j in self.jobs if j not in self._ended], until))

    def _check_request(self) -> str:
        """SLURM's answer to `sbatch --test-only` ("Job N to start at ..."), or PoolConfigError
        naming the field it refuses. Also `skytasks check`'s (check.py)."""
        args = slurm_job.sbatch_args(self._spec, self.pool_id, self._spec.nodes)
        done = self.shell.run([*args, "--test-only"], input=b"#!/bin/bash\ntrue\n")
        if done.returncode == 0:
            return slurm_job.slurm_message(done.stderr or done.stdout)
        said = slurm_job.slurm_message(done.stderr)
        field = slurm_job.refused_field(said) or self._narrow_down(args)
        raise PoolConfigError(f"{field}: SLURM refused the allocation: {said} (sbatch {' '.join(args[1:])}); "
                              f"nothing was queued")

    def _narrow_down(self, args: list[str]) -> str:
        """SLURM said only "Requested node configuration is not available": ask again without each
        optional request to see which one it cannot meet."""
        for flag, field in (("--gres=", "slurm_gres"), ("--constraint=", "slurm_constraint"),
                            ("--ntasks-per-node=", "procs_per_node")):
            trial = [a for a in args if not a.startswith(flag)]
            if trial != args and self.shell.run([*trial, "--test-only"], input=b"#!/bin/bash\ntrue\n").returncode == 0:
                return field
        return "nodes"

    def _why_not_more(self, have: list[str]) -> str:
        """The partition's other nodes and their states, as SLURM says (sinfo)."""
        part = self._slurm.slurm_partition
        done = self.shell.run(["sinfo", "-h", "-N", "-o", "%N|%T", *([f"--partition={part}"] if part else [])])
        others = sorted({ln.strip() for ln in done.stdout.splitlines() if ln.strip() and ln.split("|")[0] not in have})
        if not others:
            return "the partition has no other node"
        return "the partition's other nodes: " + ", ".join(o.replace("|", " is ") for o in others)

    def _submit(self, nodes: int, exclude: tuple[str, ...] = (), fewest: int | None = None) -> str:
        args = slurm_job.sbatch_args(self._spec, self.pool_id, nodes, exclude=exclude, fewest=fewest,
                                     expires_at=self._lease.expiry())
        done = self.shell.run(args, input=slurm_job.batch_script(self._slurm.idle_minutes).encode())
        if done.returncode != 0:
            said = slurm_job.slurm_message(done.stderr)
            field = slurm_job.refused_field(said) or "slurm_extra_args"
            raise PoolConfigError(f"{field}: sbatch refused the allocation: {said}; nothing was queued")
        job_id = done.stdout.strip().split(";")[0]
        self.jobs.append(job_id)
        return job_id

    def _wait_running(self, job_id: str, nodes: int, timeout: float | None = None) -> list[str]:
        """Until the job runs: its node names. Pending is said with SLURM's reason and position."""
        timeout = timeout or self._slurm.ready_timeout_seconds
        deadline = time.monotonic() + timeout
        reason = "submitted"
        while True:
            q = self._queue(job_id)
            if q.state == "RUNNING" and q.nodelist:
                return self._hostnames(q.nodelist)
            if q.state in ("", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                           "DEADLINE", "OUT_OF_MEMORY"):
                raise PoolStartError(f"slurm job {job_id} ended before its nodes were up "
                                     f"({q.state or 'left the queue'}: {q.reason or reason})")
            reason = q.reason or q.state
            field = slurm_job.never_starts(reason)
            if field is not None:
                raise PoolConfigError(f"{field}: SLURM will never start job {job_id}: {reason}; it was cancelled")
            self.reporter.progress(0, nodes, f"job {job_id} {q.state.lower()}: {reason}{self._position(job_id)}")
            if time.monotonic() >= deadline:
                raise PoolStartError(f"ready_timeout_seconds: slurm job {job_id} still {q.state.lower()} after "
                                     f"{timeout:g}s (SLURM's reason: {reason}); it was cancelled")
            if self._aborted.wait(min(POLL_SECONDS, max(0.0, deadline - time.monotonic()))):
                raise InterruptedError(f"the allocation of {self.pool_id} was cancelled (job {job_id})")

    def _queue(self, job_id: str) -> slurm_job.QueueState:
        done = self.shell.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"])
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            raise PoolStartError(f"squeue failed on {self.shell.where}: {slurm_job.slurm_message(done.stderr)}")
        return slurm_job.parse_queue_line(done.stdout)

    def _position(self, job_id: str) -> str:
        part = self._slurm.slurm_partition
        done = self.shell.run(["squeue", "-h", "-t", "PD", "-o", "%i", "--sort=-p,i",
                               *([f"--partition={part}"] if part else [])])
        ids = done.stdout.split()
        return f"; position {ids.index(job_id) + 1} of {len(ids)} pending" if job_id in ids else ""

    def _hostnames(self, nodelist: str) -> list[str]:
        return self.shell.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()

    def _addresses(self, names: list[str]) -> dict[str, str]:
        found = slurm_job.parse_nodes(self.shell.run(["scontrol", "-o", "show", "node", ",".join(names)]).stdout)
        return {n: found.get(n, {}).get("NodeAddr") or n for n in names}

    def _start_node(self, node_id: int) -> NodeLink:
        node = self.nodes[node_id]
        link = self._steps.start_agent(node_id, node.name, node.address, node.job_id,
                                       agent_args(slurm_job.heartbeat_folders(node.job_id)))
        link.loss_detail = lambda: self.node_condition(node.name, node.job_id)
        return link

    def node_condition(self, name: str, job_id: str) -> str:
        """SLURM's view of a node, for the error that says it was lost."""
        info = slurm_job.parse_nodes(self.shell.run(["scontrol", "-o", "show", "node", name]).stdout).get(name, {})
        said = self._steps.last_words(name)
        text = f"SLURM: node {name} (job {job_id}) is {info.get('State', 'unknown')}"
        if info.get("Reason"):
            text += f", reason: {info['Reason']}"
        return text + (f"; srun said: {said}" if said else "")

    def reattach(self, node_id: int, door: str, timeout: float) -> NodeLink:
        """A new stream to the node's running agent: an `srun --overlap` step beside it in the same
        allocation. NodeGone when SLURM says the node is gone (its job no longer running, the node
        down) or nothing is behind the agent's door; anything else (slurmctld not answering, say)
        is tried again."""
        from skytasks.errors import NodeGone

        node = self.nodes.get(node_id)
        if node is None:
            raise NodeGone(f"node {node_id} is no longer in the pool's allocation")
        where = f"node {node_id} ({node.name}, job {node.job_id})"
        q = self._queue(node.job_id)
        if q.state != "RUNNING":
            raise NodeGone(f"{where}: SLURM says the job is {q.state.lower() or 'no longer in the queue'}")
        info = slurm_job.parse_nodes(self.shell.run(["scontrol", "-o", "show", "node", node.name]).stdout)
        if info.get(node.name, {}).get("State", "").startswith("DOWN"):
            raise NodeGone(self.node_condition(node.name, node.job_id))
        link = self._steps.attach(node_id, node.name, node.address, node.job_id, door, timeout)
        link.node_id = node_id
        link.loss_detail = lambda: self.node_condition(node.name, node.job_id)
        return link

    # -- warm pools: this process lets go, another takes over ------------------------------------

    def handle(self) -> dict[str, Any]:
        """The pool's jobs and which node runs where, for another process's `adopt` (no credential)."""
        return {"pool_id": self.pool_id, "jobs": list(self.jobs), "lost": sorted(self.lost),
                "started_at": self._lease.started_at.timestamp(),
                "nodes": {str(i): [n.name, n.address, n.job_id] for i, n in self.nodes.items()}}

    def adopt(self, handle: dict[str, Any]) -> None:
        """The allocation of another process's pool, its agents running in their steps: each is
        reached by a step beside it (`reattach`). PoolGone only on SLURM's own word that none of
        its jobs runs (each unknown to it, or ended); a failed `squeue` or a dropped login is
        raised as it is (the pool may run on: asked again later), as is a job that waits."""
        self.pool_id = self.reporter.key = str(handle["pool_id"])
        self.jobs = [str(j) for j in handle.get("jobs", [])]
        self.lost = set(handle.get("lost", []))
        self.nodes = {int(i): AllocatedNode(*v) for i, v in handle.get("nodes", {}).items()}
        self._lease.started_at = datetime.fromtimestamp(float(handle.get("started_at", time.time())), timezone.utc)
        states = {j: self._queue(j).state for j in self.jobs}  # a failure to ask raises: not the word "gone"
        running = [j for j, state in states.items() if state == "RUNNING"]
        if not running:
            said = ", ".join(f"{j} {state.lower() or 'unknown to SLURM'}" for j, state in states.items()) or "no job"
            if all(state in ENDED_STATES for state in states.values()):
                raise PoolGone(f"{self.pool_id}: none of its jobs runs any more ({said})")
            raise PoolStartError(f"{self.pool_id}: none of its jobs runs now ({said}); not taken for gone")
        self._ended.update(j for j in self.jobs if j not in running)
        self._lease.keep(self._renew_lease, lambda line: self.reporter.note(f"{self.pool_id}: {line}", logging.WARNING),
                         name=f"skytasks-lease-{self.pool_id}")

    def leave_running(self) -> None:
        """This process lets go of its steps' streams without signalling any srun (a signalled
        srun has its step cancelled, agent and all), and of the login connection; the jobs stay,
        their lease renewed to cover idle_minutes plus keep_warm_minutes."""
        with self._stop_lock:
            self._lease.stop()
            try:
                self._renew_lease(self._lease.expiry())
            except Exception as exc:  # noqa: BLE001 - the renewal before last still holds for a while
                self.reporter.note(f"{self.pool_id}: could not renew its lease as it was released: {exc}")
            # Each step's stream let go, no srun signalled; then the shell closes with no srun to
            # end (SlurmShell.close would SIGTERM them, which srun passes on to the agent).
            # TODO(owners of node_steps.py/shell.py): NodeSteps.let_go_all, SlurmShell.leave (requests.md).
            steps = {id(s): s for s in [*self._steps._steps.values(), *self._steps._agents.values()]}
            self._steps._steps.clear()
            self._steps._agents.clear()
            for step in steps.values():
                step.let_go()
            self.shell._procs = []
            self.shell.close()

    # -- the calls' needs -------------------------------------------------------------------

    def free_port(self, head: int) -> int:
        node = self.nodes[head]
        return self._steps.free_port(node.name, node.job_id)

    def prepare_workdir(self, request) -> tuple[str, str | None]:
        return self._steps.prepare_workdir(request, [(n.name, n.job_id) for n in self.nodes.values()])

    def replace(self, node_id: int) -> NodeLink:
        """A lost node: a one-node allocation of its own, on a machine that is neither one of the
        pool's other nodes nor one it lost before."""
        old = self.nodes[node_id]
        self.lost.add(old.name)
        self.release(node_id)
        try:
            job_id = self._submit(1, exclude=self._taken())
            [name] = self._wait_running(job_id, 1)
        except (PoolStartError, PoolConfigError) as exc:
            raise PoolStartError(f"node {node_id} ({old.name}) was lost and no replacement could be had: {exc}") \
                from exc
        self.nodes[node_id] = AllocatedNode(name, self._addresses([name])[name], job_id)
        self.reporter.note(f"{self.pool_id}: node {node_id} ({old.name}) replaced by {name} (job {job_id})")
        return self._start_node(node_id)

    def _taken(self) -> tuple[str, ...]:
        return tuple(self.lost | {n.name for n in self.nodes.values()})

    def grow(self, count: int) -> list[NodeLink]:
        """A job of up to `count` more nodes, if SLURM starts it within GROW_WAIT_SECONDS; one
        still pending then is cancelled: growing a pool never waits long in the queue."""
        job_id = None
        try:
            job_id = self._submit(count, exclude=self._taken(), fewest=1)
            names = self._wait_running(job_id, count, timeout=GROW_WAIT_SECONDS)
        except (PoolStartError, PoolConfigError) as exc:
            if job_id is not None:
                self.shell.run(["scancel", "--quiet", job_id])
            self.reporter.note(f"{self.pool_id}: could not grow by {count} node{'s' * (count != 1)} now: {exc}")
            return []
        first = max(self.nodes, default=-1) + 1
        for node_id, (name, address) in enumerate(self._addresses(names).items(), start=first):
            self.nodes[node_id] = AllocatedNode(name, address, job_id)
        self.reporter.note(f"{self.pool_id}: grew by {', '.join(names)} (job {job_id})")
        return [self._start_node(i) for i in range(first, first + len(names))]

    def release(self, node_id: int) -> None:
        """A node let go (lost, or preempted): its step ends, and a job none of whose nodes the
        pool still uses is cancelled now."""
        old = self.nodes.pop(node_id, None)
        if old is None:
            return
        self._steps.end(old.name, lost=True)
        kept = [n.name for n in self.nodes.values() if n.job_id == old.job_id]
        if not kept:
            self.shell.run(["scancel", "--quiet", old.job_id])
        else:  # the job gives the node back, so that it can be had again later (SLURM shrinks a job)
            self.shell.run(["scontrol", "update", f"JobId={old.job_id}", f"NodeList={','.join(kept)}"])

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """End the steps and cancel every job, waiting until none is left in the queue. Runs in a
        thread of its own and is waited for through Ctrl-C and SIGTERM."""
        uninterruptible(self._teardown, lambda: self.reporter.note("still cancelling the pool's SLURM jobs; please wait"),
                        name="skytasks-slurm-teardown")

    def _teardown(self) -> BaseException | None:
        with self._stop_lock:
            self._lease.stop()  # before the shell closes: no renewal runs after it
            self._steps.end_all()
            jobs = list(self.jobs)
            left: list[str] = []
            detail = ""
            try:
                if jobs:
                    done = self.shell.run(["scancel", "--quiet", *jobs])
                    if done.returncode != 0:
                        detail = f"scancel: {slurm_job.slurm_message(done.stderr)}"
                    left = self._wait_gone(jobs)
            except Exception as exc:  # noqa: BLE001 - reported below, with every job it concerns
                left, detail = jobs, f"{type(exc).__name__}: {exc}"
            finally:
                self.shell.close()
            self.jobs = [j for j in self.jobs if j in left]
            if left:
                return self.reporter.teardown_failed(
                    [f"slurm job {j}" for j in left], detail or "still in the queue after the teardown's wait")
            return None

    def _wait_gone(self, jobs: list[str]) -> list[str]:
        deadline = time.monotonic() + settings().teardown_wait_seconds
        while True:
            try:  # bounded by what is left of the wait: a slurmctld that does not answer is no reason to wait longer
                done = self.shell.run(["squeue", "-h", "-o", "%i", "-j", ",".join(jobs)],
                                      timeout=max(1.0, deadline - time.monotonic()))
            except (subprocess.TimeoutExpired, TimeoutError):  # here, or over SSH to the login node
                return jobs
            left = [j for j in done.stdout.split() if j in jobs] if done.returncode == 0 else []
            if done.returncode != 0 and "Invalid job id" not in done.stderr:
                left = jobs
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.5)
