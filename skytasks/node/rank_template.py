"""A node's ranks forked from one warm template process, not started as fresh interpreters.

Why: a fresh interpreter that imports the rank's side of skytasks costs about 50 ms of CPU. At
1,024 ranks on 128 nodes that is most of the pool's start, and all of a lost node's restart.
torch's forkserver answers the same cost the same way.

How:
- The agent forks the template at its very start, before it has any thread (fork is safe only
  then), and makes itself a subreaper. The template imports `skytasks.node.worker` and cloudpickle
  once.
- For each rank, the agent makes its pipes and hands their descriptors over a socketpair
  (SCM_RIGHTS). The template forks twice; the middle process exits at once, so the rank is
  reparented to the agent, as a cold rank is its child. The rank puts the pipes on fds 0-3, takes
  its environment and runs the worker's `main()`.
- The agent holds a `ForkedProcess` that behaves like the `subprocess.Popen` of a cold start: it
  reaps its own child, and `os.getppid()` in a rank is the agent either way.
- A dying agent takes the template and the ranks with it (PDEATHSIG).

A rank is started cold instead when the template cannot serve it:
- the agent was told `--rank-start exec`;
- the rank's environment changes what an interpreter reads only as it starts (`PYTHON*`, `LD_*`,
  `MALLOC_*`, `GLIBC_*`);
- the template has gone, or a thread appeared in it.

This module is the template's side; `rank_starter` is the agent's. Standard library only: the
agent imports it too.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

# Read only as an interpreter (or the dynamic loader) starts: a forked rank would not see a change.
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_")
UNBUFFERED = "PYTHONUNBUFFERED"  # every rank gets it; a forked rank's streams are made unbuffered
CTRL_FD = 3  # where a forked rank finds its channel to the agent (SKYTASKS_CTRL_FD)
MAX_MESSAGE = 1 << 20
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def retitle(*words: str) -> None:
    """Make `ps` show this process as `<python> <words>`: a forked rank is `-m skytasks.node.worker`,
    as a cold one is, and the template says what it is. Writes over the process's own argv area
    (as setproctitle does); a no-op where /proc has no such fields."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
        with open("/proc/self/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0]
        title = b"\0".join([argv0, *(w.encode() for w in words)]) + b"\0"
        if len(title) <= end - start:
            ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)
    except (OSError, ValueError, IndexError):
        pass


def _die_with(parent: int) -> None:
    """PDEATHSIG: when `parent` (this process's parent now) dies, the kernel kills this one too."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def serve_as_template(sock: socket.socket, agent: int) -> None:
    """The template's life: a rank for each request, until the agent closes or dies."""
    code = 1
    try:
        _die_with(agent)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)  # never hold the agent's frame streams: their end is how deaths are seen
        os.dup2(2, 1)
        os.close(devnull)
        # As a cold rank inherits them from the agent (see agent.main): Ctrl-C is the controller's,
        # and SIGUSR1 is ignored until the worker's faulthandler takes it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        retitle("-m", "skytasks.node.rank_template")
        import cloudpickle  # noqa: F401 - warm: every rank unpickles its call with it
        import skytasks.node.worker

        for name in skytasks.node.worker.STARTUP_MODULES:
            importlib.import_module(name)

        # Every object so far to the collector's permanent generation: a rank's first full
        # collection would otherwise write to all of them, and copy every page it shares with
        # this process (measured: 1,200 page copies and 7 ms of CPU per rank; Instagram's fix).
        gc.collect()
        gc.freeze()
        while True:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
            if not data:
                code = 0
                return  # the agent closed: it stopped its ranks first
            reply: dict[str, object]
            try:
                reply = {"pid": _fork_rank(sock, json.loads(data)["env"], fds, agent)}
            except Exception as exc:  # noqa: BLE001 - said to the agent, which starts the rank cold
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                for fd in fds:
                    os.close(fd)
            sock.send(json.dumps(reply).encode())
    except BaseException:  # noqa: BLE001 - the agent then starts its ranks cold
        traceback.print_exc()
    finally:
        os._exit(code)


def _fork_rank(sock: socket.socket, env: dict[str, str], fds: list[int], agent: int) -> int:
    """Fork twice: the middle process exits at once, so the rank is reparented to the agent
    (the subreaper) and the template keeps no children. Returns the rank's pid."""
    if threading.active_count() > 1 or len(os.listdir("/proc/self/task")) > 1:
        # fork copies only the calling thread: a lock another thread held would stay held forever
        raise RuntimeError("a thread appeared in the template")
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(pid_r)
            me = os.getpid()
            rank = os.fork()
            if rank == 0:
                os.close(pid_w)
                _become_rank(sock, env, fds, me, agent)  # never returns
            os.write(pid_w, str(rank).encode())
        finally:
            os._exit(0)
    os.close(pid_w)
    with os.fdopen(pid_r, "rb") as f:
        said = f.read()
    os.waitpid(middle, 0)  # once it is reaped, the rank's parent is the agent
    return int(said)


def _become_rank(sock: socket.socket, env: dict[str, str], fds: list[int], middle: int, agent: int) -> None:
    """In the forked child: what `python -m skytasks.node.worker` with these pipes would be."""
    code = 1
    try:
        while os.getppid() == middle:  # until the middle process has exited (microseconds)
            time.sleep(0.0002)
        _die_with(agent)  # now the agent is the parent: die with it, as a cold rank does
        os.setsid()  # its own session, as a cold rank's: killpg stops its children too
        sock.detach()  # closed below with the rest; the object must never close a reused number
        high = [os.dup(fd) for fd in fds]  # out of the way of 0-3 before they are filled
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        for name in os.listdir("/proc/self/fd"):  # the template's own and the copies above
            if int(name) > CTRL_FD:
                try:
                    os.close(int(name))
                except OSError:
                    pass  # the listing's own descriptor
        os.environ.clear()
        os.environ.update(env)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        from skytasks.node import worker

        sys.argv = [worker.__file__]
        retitle("-m", "skytasks.node.worker")
        worker.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        os._exit(code)
