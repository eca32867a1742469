"""One warm interpreter per controller that forks the node agents of its local pools.

Why: a local node's agent started as a fresh interpreter costs about 0.15 s of CPU (the
interpreter and skytasks' node modules); 128 local nodes are 20 s of CPU before a rank exists.
And where the pool's ranks initialise torch, each node's template imported torch again (2 s of
CPU each on a slow 2-core machine). Forked from here, an agent costs a few milliseconds, and when
this process imported torch, so has every agent's template (see `rank_starter`).

How:
- The controller starts `python -m skytasks.node.forkserver` with the startup environment its
  agents would have (`PYTHON*`, `LD_*`: what an interpreter reads only as it starts) and talks
  to it over a SOCK_SEQPACKET socket on fd 0. The first message says what to import: the agent's
  modules always, torch (with the environment the ranks will import it with) when asked.
- For each agent: its argv, environment and working directory, with its stdin, stdout and
  stderr as descriptors (SCM_RIGHTS). The child takes them as fds 0-2, a session of its own,
  its environment, and runs the agent's `main()`, shown in `ps` as `-m skytasks.node.agent`.
- The controller watches each agent with a pidfd and asks here for its exit code (`reap`): the
  agents are this process's children.
- When the controller's end closes (it exited, or was killed), this process leaves. Agents it
  forked go on until their own streams from the controller close, as a fresh agent would.

Standard library only, apart from the modules it warms.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import socket
import sys
import traceback

from skytasks.node.rank_template import (answer, close_fds_above, live_then_exit, retitle, set_environ,
                                         torch_import_env)

MAX_MESSAGE = 1 << 20
FDS_PER_AGENT = 3  # its stdin, stdout and stderr
_STARTED_IN = os.getcwd()  # `python -m` put it first on sys.path; an agent's own goes there


def serve(sock: socket.socket) -> None:
    """Answer requests until the controller's end closes; then wait for the agents still running."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, FDS_PER_AGENT)
        except ConnectionResetError:
            data, fds = b"", []
        if not data:
            break
        answer(sock, data, fds, _handle)  # an error is said to the controller, which starts that agent fresh
    # The controller has gone, its agents may not have (a warm pool's stay for the next process):
    # keep nothing of its (a terminal, or a pipe its own parent waits to see closed).
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    while True:  # reap the agents still running, so none is left a zombie of this process
        try:
            os.wait()
        except ChildProcessError:
            return


def _handle(request: dict, fds: list[int]) -> dict[str, object]:
    if "reap" in request:
        return {"code": _reap(int(request["reap"]))}
    if "warm" in request:
        _warm(request["warm"])
        return {"warm": True}
    return {"pid": _fork_agent(request["argv"], request["env"], request["cwd"], fds)}


def _warm(torch_env: dict[str, str] | None) -> None:
    """The agent's modules and those its template takes, once for every agent forked from here;
    torch too when `torch_env` is given, imported with those of its variables (its thread pools
    read them as they load)."""
    import cloudpickle  # noqa: F401 - the template warms it for every rank
    import hashlib  # noqa: F401 - and these an agent of a pool of 3 nodes or more takes for its relay links
    import hmac  # noqa: F401
    import ssl  # noqa: F401

    import skytasks.node.agent  # noqa: F401
    import skytasks.node.worker

    for name in skytasks.node.worker.STARTUP_MODULES:
        importlib.import_module(name)
    if torch_env is not None:
        from skytasks.node import rank_template
        saved = dict(os.environ)
        set_environ({**{k: v for k, v in saved.items() if k not in torch_import_env(saved)}, **torch_env})
        try:
            import torch  # noqa: F401
            import torch.distributed  # noqa: F401
        except Exception:  # noqa: BLE001 - each template imports it (or says why) as it would have
            pass
        else:
            rank_template.TORCH_IMPORTED_WITH = dict(torch_env)  # the agent's template, and its ranks, have it
        finally:
            set_environ(saved)
    # As the template does: every object so far to the collector's permanent generation, so that
    # an agent's collections do not copy the pages it shares with this process.
    gc.collect()
    gc.freeze()


def _fork_agent(argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> int:
    if len(fds) != FDS_PER_AGENT:
        raise RuntimeError(f"{len(fds)} descriptors for an agent")
    if argv[:2] != ["-m", "skytasks.node.agent"]:
        raise RuntimeError(f"not an agent's command line: {argv[:2]}")
    pid = os.fork()
    if pid == 0:
        _become_agent(argv[2:], env, cwd, fds)  # never returns
    return pid


def _become_agent(args: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> None:
    def life() -> None:
        os.setsid()  # as `start_new_session=True`: Ctrl-C at the terminal is the controller's alone
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # dup2 clears close-on-exec: the agent's own children may inherit
        close_fds_above(2)  # this process's socket, the descriptors as received
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(cwd)
        if sys.path and sys.path[0] == _STARTED_IN:
            sys.path[0] = cwd  # `python -m` puts the directory it started in first
        from skytasks.node.agent import main

        set_environ(env)
        retitle("-m", "skytasks.node.agent")
        sys.argv = ["-m", "skytasks.node.agent", *args]
        main(args)

    live_then_exit(life)


def _reap(pid: int) -> int:
    """An agent's exit code, once the controller saw it end (its pidfd): it is a zombie, so this
    does not wait."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    sock = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller's Ctrl-C; its end closing ends this
    try:
        serve(sock)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
