"""The agent's side of starting ranks: forked by the node's warm template (`rank_template`), or
cold, as fresh interpreters, where the template cannot serve. Either way the agent gets something
that behaves like `subprocess.Popen`. Standard library only."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import BinaryIO

from skytasks.node import rank_template
from skytasks.node.linux import PR_SET_CHILD_SUBREAPER, prctl
from skytasks.node.rank_template import (CTRL_FD, FDS_PER_RANK, MAX_FDS, MAX_MESSAGE, SCRIPT_ENV, serve_as_template,
                                         startup_differs, torch_import_env)


class ForkedProcess:
    """A rank the template forked, as the agent sees it: what the agent used of `Popen`. The rank
    is the agent's own child (the agent is a subreaper), so the agent reaps it as Popen would:
    `poll` reaps it once it has ended, never blocking. Nothing waits for it in a thread of its own:
    its `RankProcess` hears the end on the agent's reactor and polls (see `skytasks.reactor`)."""

    def __init__(self, pid: int, stdin: BinaryIO, stdout: BinaryIO, stderr: BinaryIO):
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._reaping = threading.Lock()  # the reactor and a stop may poll at once: one reaps

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # not ours after all: the template's report was wrong
                    pid, status = self.pid, -1
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status) if status != -1 else -signal.SIGKILL
                    self._ended.set()
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """As Popen's: until it has ended, reaped by whoever polls first. Whoever hears the end
        (the reactor) polls at once; the short poll here is only for a caller nobody told."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            self._ended.wait(left)
        assert self.returncode is not None
        return self.returncode


class RankStarter:
    """Starts a node's rank processes: forked from the template while it serves, else cold."""

    def __init__(self, template: socket.socket | None = None, template_pid: int | None = None,
                 template_env: dict[str, str] | None = None, torch_env: dict[str, str] | None = None):
        self._sock, self._template_pid = template, template_pid
        self._template_env = template_env or {}
        self._lock = threading.Lock()  # one fork request in flight at a time
        self._started: set[int] = set()  # every rank pid this started: someone else reaps those
        # The environment the template imported torch with, once it has (see `_import_torch`),
        # or the fork server did before the template was forked.
        self._torch_env = torch_env

    @classmethod
    def fork_template(cls) -> RankStarter:
        """Call first thing in the agent, before any thread. Falls back to cold starts where it cannot."""
        if sys.platform != "linux":  # /proc, SOCK_SEQPACKET, PDEATHSIG and subreapers are Linux's
            return cls()
        # The ranks' parent is then the agent, as a cold rank's is: reparented to it when the
        # template's short-lived middle process exits.
        if not prctl(PR_SET_CHILD_SUBREAPER, 1):
            return cls()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        agent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(ours.detach())  # the agent's end: held here, the agent's close would never be heard
            serve_as_template(theirs, agent)  # never returns
        theirs.close()
        # An agent forked from a fork server that imported torch (see `forkserver`) has it, and so
        # the template has it from its first moment.
        return cls(ours, pid, dict(os.environ), rank_template.TORCH_IMPORTED_WITH)

    def start_many(self, requests: list[tuple[dict[str, str], int]]) -> list[subprocess.Popen | ForkedProcess]:
        """A rank process for each (`env` whole, `ctrl_write` its channel to the agent), with
        stdin/stdout/stderr as pipes; the caller closes each `ctrl_write` afterwards. Those the
        template can serve are forked in batches, one request each; the rest start cold."""
        started: list[subprocess.Popen | ForkedProcess | None] = [None] * len(requests)
        warm = [i for i, (env, _) in enumerate(requests) if self._sock is not None and not self._changes_startup(env)]
        import_torch = None
        if self._torch_env is None:
            # The node's first torch rank: the template imports torch with its environment, and
            # ranks whose thread settings differ from it start cold.
            import_torch = next((requests[i][0] for i in warm if _wants_torch(requests[i][0])), None)
            if import_torch is not None:
                self._torch_env = torch_import_env(import_torch)
                warm = [i for i in warm if not self._changes_startup(requests[i][0])]
        for batch in _batches(warm, requests):
            forked = self._fork([requests[i] for i in batch], import_torch)
            import_torch = None
            for i, proc in zip(batch, forked or ()):
                started[i] = proc
        return [proc if proc is not None else self._cold(*requests[i]) for i, proc in enumerate(started)]

    def _cold(self, env: dict[str, str], ctrl_write: int) -> subprocess.Popen:
        cold = subprocess.Popen(
            [sys.executable, "-m", "skytasks.node.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**env, "SKYTASKS_CTRL_FD": str(ctrl_write)}, pass_fds=(ctrl_write,),
            # A session of its own, so stopping a rank also stops its DataLoader workers and any
            # other children it made (killpg).
            start_new_session=True,
        )
        self._started.add(cold.pid)
        return cold

    def _changes_startup(self, env: dict[str, str]) -> bool:
        """Whether a forked rank would differ from a cold one: the environment that the template's
        interpreter, and torch in it, took as they started is not this rank's."""
        if startup_differs(env, self._template_env):
            return True
        return self._torch_env is not None and torch_import_env(env) != self._torch_env

    def _fork(self, batch: list[tuple[dict[str, str], int]], import_torch: dict[str, str] | None = None,
              ) -> list[ForkedProcess] | None:
        pipes = [(os.pipe(), os.pipe(), os.pipe()) for _ in batch]  # stdin, stdout, stderr of each
        fds: list[int] = []
        for ((stdin_r, _), (_, stdout_w), (_, stderr_w)), (_, ctrl_write) in zip(pipes, batch):
            fds += [stdin_r, stdout_w, stderr_w, ctrl_write]
        request = json.dumps({"envs": [{**env, "SKYTASKS_CTRL_FD": str(CTRL_FD)} for env, _ in batch],
                              "import_torch": import_torch}).encode()
        try:
            with self._lock:
                if self._sock is None:
                    raise OSError("the template has gone")
                self._sock.settimeout(TEMPLATE_ANSWER_SECONDS)
                try:
                    socket.send_fds(self._sock, [request], fds)
                    reply = json.loads(self._sock.recv(MAX_MESSAGE) or b'{"error": "the template has gone"}')
                    if "pids" not in reply:
                        raise OSError(reply["error"])
                except OSError:
                    # A template that failed a request, or did not answer in time (its answer may
                    # still come, and would be read as the next request's), is not asked again;
                    # closing the socket also tells it to leave.
                    self._sock.close()
                    self._sock = None
                    raise
                self._started.update(reply["pids"])
            return [ForkedProcess(pid, os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"), os.fdopen(stderr_r, "rb"))
                    for pid, ((_, stdin_w), (stdout_r, _), (stderr_r, _)) in zip(reply["pids"], pipes)]
        except OSError as exc:  # a timeout is one
            for (_, stdin_w), (stdout_r, _), (stderr_r, _) in pipes:
                for fd in (stdin_w, stdout_r, stderr_r):
                    os.close(fd)
            print(f"skytasks agent: starting {len(batch)} rank(s) cold: {exc}", file=sys.stderr, flush=True)
            return None
        finally:
            for (stdin_r, _), (_, stdout_w), (_, stderr_w) in pipes:
                for fd in (stdin_r, stdout_w, stderr_w):
                    os.close(fd)

    def reap_orphans(self) -> None:
        """A subreaper inherits every orphan below it (a dead rank's DataLoader workers, a user's
        daemon): reap those that ended, and a template that died; never a rank, whose owner reaps it."""
        with self._lock:  # a rank being started is in `_started` before it can be seen here
            children: set[int] = set()
            try:
                for task in os.listdir("/proc/self/task"):  # an orphan may land on any thread
                    with open(f"/proc/self/task/{task}/children") as f:
                        children.update(int(p) for p in f.read().split())
            except OSError:
                return
            self._started &= children  # the rest were reaped by their owners: the numbers may come back
            orphans = children - self._started
        for pid in orphans:
            try:
                reaped, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if reaped and reaped == self._template_pid:
                self._template_pid = None

    def close(self) -> None:
        """The template leaves (its ranks were stopped first) and is reaped."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._template_pid is not None:
            try:
                os.waitpid(self._template_pid, 0)
            except ChildProcessError:
                pass


# A template that died is heard at once (its end of the socket closes); this bounds only one that
# hangs. A busy machine is no reason to give up on it: 128 nodes starting at once on 2 cores can
# take more than 10 s to answer, and cold starts instead would cost ten times the CPU.
TEMPLATE_ANSWER_SECONDS = 120.0
BATCH_BYTES = 128 * 1024  # a request's environments: well inside a socket's default buffer


def _wants_torch(env: dict[str, str]) -> bool:
    """A rank that makes a torch group (as the worker reads it), or runs a torchrun script, which
    is forked from the rank with the template's torch (see script_fork)."""
    return env.get("SKYTASKS_INIT_TORCH", "1") == "1" or env.get(SCRIPT_ENV) == "1"


def _batches(indices: list[int], requests: list[tuple[dict[str, str], int]]) -> list[list[int]]:
    """The ranks to fork, in requests the socket can carry: at most MAX_FDS descriptors and
    about BATCH_BYTES of environment each (a rank with a larger one goes alone)."""
    batches: list[list[int]] = []
    size = 0
    for i in indices:
        env_bytes = sum(len(k) + len(v) + 6 for k, v in requests[i][0].items())
        if not batches or size + env_bytes > BATCH_BYTES or FDS_PER_RANK * (len(batches[-1]) + 1) > MAX_FDS:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += env_bytes
    return batches
