"""Local agents forked from a warm interpreter (`skytasks.node.forkserver`) instead of started
as fresh ones: a few milliseconds of CPU each instead of about 0.15 s, and, where the session's
ranks initialise torch, templates that have torch before the first call.

One fork server per controller process for each startup environment (what an interpreter reads
only as it starts) and torch choice, started on first use; it leaves when the controller exits.
Whatever it cannot do, the provider does the old way: `agent_process` then returns None.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import BinaryIO

from skytasks.node.rank_template import STARTUP_ENV_PREFIXES

MAX_SERVERS = 4  # startup environments a controller keeps a server for; past that, agents start fresh
# Warming imports torch, which on a busy 2-core machine has taken 10 s and more; a fork is
# milliseconds, but the server may be waiting its turn for the CPU.
WARM_SECONDS = 120.0
FORK_SECONDS = 30.0
UNKNOWN_EXIT = 255  # an agent whose server died before it could say how the agent ended (as ssh says)


class AgentProcess:
    """An agent the fork server forked, as the provider and `end_child` use a `Popen`: its pipes,
    `poll`, `wait`, `terminate`, `kill`. It is the server's child, not ours: its end is seen on a
    pidfd, signals go through the pidfd (never to a reused pid), and the server reaps it."""

    stderr = None  # the controller's own, as Popen's default

    def __init__(self, server: ForkServer, pid: int, stdin: BinaryIO, stdout: BinaryIO):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        self._server = server
        self._pidfd: int | None = os.pidfd_open(pid)  # a zombie until reaped: it cannot be missed
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._ended(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"node agent {self.pid}", timeout or 0.0)
        return code

    def _ended(self, timeout: float | None) -> int | None:
        pidfd = self._pidfd
        if self.returncode is None and pidfd is not None:
            waiting = select.poll()  # not select(): a controller of many nodes has descriptors past 1,024
            waiting.register(pidfd, select.POLLIN)
            try:
                ended = bool(waiting.poll(None if timeout is None else max(0, int(timeout * 1000))))
            except (OSError, ValueError):  # closed by whoever reaped it meanwhile
                ended = True
            if ended:
                with self._lock:
                    if self._pidfd is not None:
                        self.returncode = self._server.reap(self.pid)
                        os.close(self._pidfd)
                        self._pidfd = None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:
                    pass  # it has ended; reaped on the next poll

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class AdoptedAgent:
    """The agent of a warm pool's node that another process started (`LocalProvider.adopt`), as
    `end_child` uses a Popen: watched and signalled through a pidfd (never a reused pid: its start
    time is checked first), with no pipes (the stream to it is its door's socket). Its exit code
    is its parent's to read: -1 once it ended."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, started: int | None):
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd: int | None = None
        try:
            if started is None or started_at(pid) == started:
                self._pidfd = os.pidfd_open(pid)
        except OSError:  # no such process
            pass
        if self._pidfd is None or (started is not None and started_at(pid) != started):
            self._ended()

    def _ended(self) -> None:
        self.returncode = -1
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"node agent {self.pid}", timeout or 0.0)
        return code

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None and self._pidfd is not None:
            waiting = select.poll()
            waiting.register(self._pidfd, select.POLLIN)
            if waiting.poll(None if timeout is None else max(0, int(timeout * 1000))) or _zombie(self.pid):
                self._ended()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def end(self, wait: float = 10.0) -> None:
        """As `end_child` ends a child: it was told END over its door's stream (or cannot hear):
        given `wait` seconds, then SIGKILL."""
        try:
            self.wait(wait)
        except subprocess.TimeoutExpired:
            self.kill()
            self._wait(wait)


def boot_id() -> str:
    """This boot of this machine: a pid means nothing on another."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def started_at(pid: int) -> int | None:
    """When a process started (clock ticks since boot): with its pid, who it is."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _zombie(pid: int) -> bool:
    """Ended, waiting for its parent to read its exit code: gone as far as anyone else can tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class ForkServer:
    """One `python -m skytasks.node.forkserver`, warmed, and the socket to it."""

    def __init__(self, env: dict[str, str], torch_env: dict[str, str] | None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()  # one request in flight at a time
        self._sock: socket.socket | None = ours
        self.live = 0  # agents forked and not yet reaped
        self._live_lock = threading.Lock()
        try:
            # Its command line says whose it is, and leaves room for the titles its children take in
            # `ps` (`-m skytasks.node.rank_template` is written over the same bytes).
            argv = [sys.executable, "-m", "skytasks.node.forkserver", "--controller", str(os.getpid())]
            self._proc = subprocess.Popen(argv, stdin=theirs.fileno(),
                                          stdout=subprocess.DEVNULL, env=env, start_new_session=True)
        finally:
            theirs.close()
        self._ask({"warm": torch_env}, WARM_SECONDS)  # answered once its imports are done

    def fork_agent(self, argv: list[str], env: dict[str, str], stderr: int = 2) -> AgentProcess:
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        try:
            reply = self._ask({"argv": argv, "env": env, "cwd": os.getcwd()}, FORK_SECONDS,
                              fds=[stdin_r, stdout_w, stderr])
        except BaseException:
            for fd in (stdin_w, stdout_r):
                os.close(fd)
            raise
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        agent = AgentProcess(self, int(reply["pid"]), os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"))
        with self._live_lock:
            self.live += 1
        return agent

    def reap(self, pid: int) -> int:
        with self._live_lock:
            self.live -= 1
        try:
            return int(self._ask({"reap": pid}, FORK_SECONDS)["code"])
        except OSError:
            return UNKNOWN_EXIT

    def _ask(self, request: dict, timeout: float, fds: list[int] | None = None) -> dict:
        with self._lock:
            if self._sock is None:
                raise OSError("the fork server has gone")
            try:
                self._sock.settimeout(timeout)
                socket.send_fds(self._sock, [json.dumps(request).encode()], fds or [])
                reply = json.loads(self._sock.recv(1 << 20) or b'{"error": "the fork server has gone"}')
            except OSError:
                self._close_locked()  # an answer that came late would be read as the next one's
                raise
            if "error" in reply:
                raise OSError(reply["error"])
            return reply

    def close(self) -> None:
        """It leaves once its agents have (they end when their pools close their streams)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


_servers: dict[tuple, ForkServer | None] = {}  # least recently used first; None: that one could not be had
_servers_lock = threading.Lock()


def agent_process(argv: list[str], env: dict[str, str], torch_env: dict[str, str] | None,
                  stderr: int = 2) -> AgentProcess | None:
    """A local agent forked from this controller's fork server for `env`'s startup environment,
    whose templates have torch imported with `torch_env` when it is given; None when no server
    can be had (then the caller starts the agent fresh). `stderr`: the agent's (a warm pool's
    agents outlive this process: theirs is a file, not this process's)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return None
    key = (sys.executable, _only(env, STARTUP_ENV_PREFIXES), None if torch_env is None else tuple(sorted(torch_env.items())))
    with _servers_lock:
        if key in _servers:
            server = _servers[key] = _servers.pop(key)  # now the most recently used
        elif not _room_for_one_more():
            return None
        else:
            try:
                server = _servers[key] = ForkServer(env, torch_env)
            except (OSError, ValueError, KeyError) as exc:
                server = _servers[key] = None
                print(f"skytasks: local node agents start as fresh interpreters: no fork server ({exc})",
                      file=sys.stderr, flush=True)
    if server is None:
        return None
    try:
        return server.fork_agent(argv, env, stderr)
    except (OSError, ValueError, KeyError) as exc:
        with _servers_lock:
            _servers[key] = None
        server.close()
        print(f"skytasks: local node agents start as fresh interpreters: the fork server failed ({exc})",
              file=sys.stderr, flush=True)
        return None


def _room_for_one_more() -> bool:
    """Past MAX_SERVERS, the least recently used servers with no agent left go (a server whose
    agents still run must stay: it alone can reap them)."""
    idle = [key for key, server in _servers.items() if server is None or server.live == 0]
    while len(_servers) >= MAX_SERVERS and idle:
        server = _servers.pop(idle.pop(0))
        if server is not None:
            server.close()
    return len(_servers) < MAX_SERVERS


def _only(env: dict[str, str], prefixes: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(prefixes)))
