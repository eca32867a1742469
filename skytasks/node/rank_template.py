"""A node's ranks forked from one warm template process, not started as fresh interpreters.

Why: a fresh interpreter that imports the rank's side of skytasks costs about 50 ms of CPU. At
1,024 ranks on 128 nodes that is most of the pool's start, and all of a lost node's restart.
torch's forkserver answers the same cost the same way.

How:
- The agent forks the template at its very start, before it has any thread (fork is safe only
  then), and makes itself a subreaper. The template imports `skytasks.node.worker` and cloudpickle
  once.
- For a node's ranks (one SPAWN), the agent makes their pipes and hands the descriptors over a
  socketpair (SCM_RIGHTS), in one message. The template forks a middle process, which forks
  every rank and exits, so the ranks are reparented to the agent, as a cold rank is its child.
  Each rank puts its pipes on fds 0-3, takes its environment and runs the worker's `main()`.
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
import fcntl
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
from typing import Callable, NoReturn

from skytasks.node import socket_interface
from skytasks.node.linux import PR_SET_PDEATHSIG, prctl

# Read only as an interpreter (or the dynamic loader) starts: a forked rank would not see a change.
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_")
# Read as torch (and the thread pools it loads: OpenMP, MKL, OpenBLAS) is imported. The template
# imports torch with its first torch rank's values of these; a rank with other values starts cold.
TORCH_IMPORT_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "TORCH_", "PYTORCH_")
# TORCH_ variables torch reads only when a process group is made, never at import: every rank
# gets the flight recorder's, and a template that imported torch without it still forks them;
# every torchrun script gets NCCL's error handling, as under torchrun.
READ_AFTER_IMPORT = frozenset({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
SCRIPT_ENV = "SKYTASKS_SCRIPT"  # "1": the rank runs a torchrun script (run_script)
UNBUFFERED = "PYTHONUNBUFFERED"  # every rank gets it; a forked rank's streams are made unbuffered
CTRL_FD = 3  # where a forked rank finds its channel to the agent (SKYTASKS_CTRL_FD)
MAX_MESSAGE = 1 << 20
FDS_PER_RANK = 4  # stdin, stdout, stderr, and the channel to the agent
MAX_FDS = 250  # at most 62 ranks a request: Linux passes 253 descriptors in one message (SCM_MAX_FD)


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
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
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
        global _STACK_FD
        _STACK_FD = _register_stack_dumps()

        # Every object so far to the collector's permanent generation: a rank's first full
        # collection would otherwise write to all of them, and copy every page it shares with
        # this process (about 1,200 page copies and 7 ms of CPU per rank).
        gc.collect()
        gc.freeze()
        native_threads = _threads()
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
            except ConnectionResetError:  # the agent closed with our last answer unread: gone all the same
                data, fds = b"", []
            if not data:
                code = 0
                return  # the agent closed: it stopped its ranks first

            def fork(request: dict, fds: list[int]) -> dict[str, object]:
                nonlocal native_threads
                if request.get("import_torch") is not None and "torch" not in sys.modules:
                    native_threads = _import_torch(request["import_torch"])
                # The interface towards each head, found once for the node's ranks (see routes).
                socket_interface.find_routes({env.get("MASTER_ADDR", "") for env in request["envs"]})
                return {"pids": _fork_ranks(request["envs"], fds, agent, native_threads)}

            answer(sock, data, fds, fork)
    except BaseException:  # noqa: BLE001 - the agent then starts its ranks cold
        traceback.print_exc()
    finally:
        os._exit(code)


def answer(sock: socket.socket, data: bytes, fds: list[int],
           handle: Callable[[dict, list[int]], dict[str, object]]) -> None:
    """One request to a fork server (this template, or the agents' `forkserver`): `handle` makes
    the reply; its exception is said as {"error": ...} to the asker, which then starts what it
    asked for the old way. The descriptors that came with the request are closed either way."""
    reply: dict[str, object]
    try:
        reply = handle(json.loads(data), fds)
    except Exception as exc:  # noqa: BLE001 - said to the asker
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for fd in fds:
            os.close(fd)
    sock.send(json.dumps(reply).encode())


# The descriptor the template registered faulthandler on; each forked rank puts its stack file there.
_STACK_FD: int | None = None


def _register_stack_dumps() -> int:
    """faulthandler for SIGUSR1 and SIGTERM, registered once here for every rank forked from now
    on, which inherit it (a rank's own registration cost 0.5 ms of CPU and 100 page copies, per
    rank). It writes to a descriptor of its own, clear of a rank's 0-3, that each rank points at
    its stack file; here it is /dev/null. A rank forked from here can be asked for its stack the
    moment it exists."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    fd = fcntl.fcntl(devnull, fcntl.F_DUPFD, 10)
    os.close(devnull)
    from skytasks.node import worker

    worker.dump_stacks_to(fd)
    return fd


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _import_torch(env: dict[str, str]) -> int:
    """torch once, here, for every torch rank of the node: 8 ranks importing it each cost 8 times
    its CPU (3 s each on a slow 2-core machine) and memory; forked, they share its pages. Imported
    with a rank's own environment, since its thread pools read theirs as they load. CUDA is
    initialised only later, in the rank, with its own devices visible. Returns the threads this
    process now has: numpy's OpenBLAS starts a pool as it loads, which is fork-safe (it stops the
    pool before each fork and restarts it lazily, in parent and child alike)."""
    global TORCH_IMPORTED_WITH
    saved = dict(os.environ)
    set_environ(env)
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except Exception:  # noqa: BLE001 - a rank that needs torch says what is wrong, as a cold one would
        pass
    else:
        TORCH_IMPORTED_WITH = torch_import_env(env)
    finally:
        set_environ(saved)
    gc.collect()
    gc.freeze()
    return _threads()


# What torch was imported with in this process (by the template, or the fork server before it),
# the variables of `torch_import_env`; None while it has no torch. Forked ranks inherit it.
TORCH_IMPORTED_WITH: dict[str, str] | None = None


def torch_imported_with() -> dict[str, str] | None:
    return TORCH_IMPORTED_WITH


def torchrun_threads(env: dict[str, str]) -> dict[str, str]:
    """torchrun's default for several workers on one node, for a script rank's environment:
    OMP_NUM_THREADS=1 unless the node's own environment sets it. Given to the rank itself, not
    only its script, so the template imports torch with it and the script can be forked."""
    if env.get(SCRIPT_ENV) == "1" and int(env.get("LOCAL_WORLD_SIZE", "1")) > 1 and "OMP_NUM_THREADS" not in env:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def startup_differs(env: dict[str, str], started_with: dict[str, str]) -> bool:
    """Whether `env` differs from the environment an interpreter started with in what it reads
    only as it starts (a forked process would not see the change); PYTHONUNBUFFERED aside, whose
    streams a forked process makes for itself."""
    keys = (set(env) | set(started_with)) - {UNBUFFERED}
    return any(k.startswith(STARTUP_ENV_PREFIXES) and env.get(k) != started_with.get(k) for k in keys)


def torch_import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` that torch and its thread pools read as they load."""
    return {k: v for k, v in env.items() if k.startswith(TORCH_IMPORT_ENV_PREFIXES) and k not in READ_AFTER_IMPORT}


def set_environ(env: dict[str, str]) -> None:
    """This process's environment becomes `env`, changing only what differs (a rank's is mostly
    the agent's, as the template's is): each change is a libc call."""
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _fork_ranks(envs: list[dict[str, str]], fds: list[int], agent: int, native_threads: int = 1) -> list[int]:
    """Fork a middle process, which forks every rank of the request (4 descriptors each, in
    order) and exits: the ranks are reparented to the agent (the subreaper) and the template
    keeps no children. One middle for a node's whole SPAWN, not one per rank: a fork and an exit
    saved per rank. Returns the ranks' pids. `native_threads`: what the template's own imports
    left running (see `_import_torch`)."""
    if threading.active_count() > 1 or _threads() > native_threads:
        # fork copies only the calling thread: a lock another thread held would stay held forever
        raise RuntimeError("a thread appeared in the template")
    if len(fds) != FDS_PER_RANK * len(envs):
        raise RuntimeError(f"{len(fds)} descriptors for {len(envs)} ranks")
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(pid_r)
            # Each rank waits for the middle to exit (then the agent is its parent) by reading
            # this pipe to its end, which comes when the middle's copy closes as it exits: asleep,
            # not polling, while the middle forks its siblings (at 1,024 ranks on 2 cores a
            # middle can wait its turn for the CPU a long time).
            gate_r, gate_w = os.pipe()
            me, pids = os.getpid(), []
            for i, env in enumerate(envs):
                rank = os.fork()
                if rank == 0:
                    os.close(pid_w)
                    os.close(gate_w)
                    _become_rank(env, fds[FDS_PER_RANK * i:FDS_PER_RANK * (i + 1)], me, agent, gate_r)  # never returns
                pids.append(rank)
            os.write(pid_w, json.dumps(pids).encode())
        finally:
            os._exit(0)
    os.close(pid_w)
    with os.fdopen(pid_r, "rb") as f:
        said = f.read()
    os.waitpid(middle, 0)  # once it is reaped, the ranks' parent is the agent
    pids = json.loads(said or b"null")
    if not isinstance(pids, list) or len(pids) != len(envs):
        raise RuntimeError("the middle process could not fork every rank")
    return pids


def _become_rank(env: dict[str, str], fds: list[int], middle: int, agent: int, gate: int) -> None:
    """In the forked child: what `python -m skytasks.node.worker` with these pipes would be."""

    def life() -> None:
        os.read(gate, 1)  # its end: the middle is exiting
        os.close(gate)
        while os.getppid() == middle:  # an exit closes its files before it reparents the children: microseconds
            time.sleep(0.0002)
        _die_with(agent)  # now the agent is the parent: die with it, as a cold rank does
        os.setsid()  # its own session, as a cold rank's: killpg stops its children too
        high = [os.dup(fd) for fd in fds]  # out of the way of 0-3 before they are filled
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        close_fds_above(CTRL_FD, keep=_STACK_FD)  # the template's own and the copies above
        set_environ(env)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        from skytasks.node import worker

        sys.argv = [worker.__file__]
        retitle("-m", "skytasks.node.worker")
        worker.main(forked=True, stack_fd=_STACK_FD)

    live_then_exit(life)


def close_fds_above(highest: int, keep: int | None = None) -> None:
    """In a forked child: close every descriptor above `highest` (but `keep`), what it inherited
    from the process it was forked from, as an exec'd process would not have them."""
    for name in os.listdir("/proc/self/fd"):
        if int(name) > highest and int(name) != keep:
            try:
                os.close(int(name))
            except OSError:
                pass  # the listing's own descriptor


def live_then_exit(life: Callable[[], None]) -> NoReturn:
    """A forked child's whole life: `life`, then `os._exit` with its code (a SystemExit's; 1 for
    any other exception, whose traceback goes to stderr). It never returns into the code of the
    process it was forked from, nor runs that process's exit handlers."""
    code = 1
    try:
        life()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
