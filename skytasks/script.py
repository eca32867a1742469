"""`run_script`: an existing torchrun script, unchanged, on every rank of a pool.

Each rank of an ordinary distributed call (`init_torch=False`, so the port stays free) starts
`python SCRIPT ARGS...` (or `python -m MODULE ARGS...`) with the node's Python, in the workdir,
with exactly the environment torchrun gives a worker. The script calls `init_process_group`
itself, as it does under torchrun. Its lines are relayed as the rank's own output; a non-zero exit
fails the call like a raising rank, with the tail of its stderr. Everything else (pools,
providers, retries, timeouts, Prefect task runs, fail-fast) is the distributed call's.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from skytasks.errors import PoolConfigError, ScriptFailed

STDERR_TAIL_LINES = 40
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class ScriptResult:
    rank: int
    exit_code: int


def torchrun_environment(*, attempt: int, max_restarts: int, run_id: str, error_file: str) -> dict[str, str]:
    """What torchrun adds to a worker's environment beyond the rank variables every skytasks rank
    already has (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK). Checked against torchrun itself in tests/test_run_script.py."""
    env = os.environ
    world, local_world = env["WORLD_SIZE"], int(env["LOCAL_WORLD_SIZE"])
    added = {
        "ROLE_NAME": "default",
        "ROLE_RANK": env["RANK"],
        "ROLE_WORLD_SIZE": world,
        "GROUP_WORLD_SIZE": str(int(world) // local_world),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(attempt - 1),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        # As under torchrun: the store on MASTER_PORT is hosted outside the script (by rank 0's
        # skytasks rank, `_StoreHost`) and every script rank, rank 0's too, is its client. Left to
        # the script's rank 0, torch would listen on every interface.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCHELASTIC_ERROR_FILE": error_file,  # @record writes the script's exception here
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if local_world > 1 and "OMP_NUM_THREADS" not in env:
        added["OMP_NUM_THREADS"] = "1"  # torchrun's default for several workers on one node
    return added


def run_on_rank(command: Sequence[str], extra_env: Mapping[str, str], max_restarts: int, run_id: str) -> ScriptResult:
    """The body of every rank of a `run_script` call (runs on the node)."""
    import collections
    import tempfile
    import threading

    from skytasks.rank import rank_info

    info = rank_info()
    with tempfile.TemporaryDirectory(prefix="skytasks-script-") as tmp:
        error_file = os.path.join(tmp, "error.json")
        env = {**os.environ, **torchrun_environment(attempt=info.attempt, max_restarts=max_restarts,
                                                     run_id=run_id, error_file=error_file), **extra_env}
        env.pop("SKYTASKS_CTRL_FD", None)  # the rank's own channel; the script must not write to it
        env["PYTHONUNBUFFERED"] = "1"  # lines reach the UI as they are printed
        host = _StoreHost(info) if info.rank == 0 else None  # bound before the script starts: its port is ours
        try:
            proc = _start_script(command, env)
            tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)

            def relay(stream: Any, to: Any, keep: bool) -> None:
                for raw in iter(stream.readline, b""):
                    line = raw.decode("utf-8", "replace").rstrip("\n")
                    if keep:
                        tail.append(line)
                    print(line, file=to, flush=True)

            threads = [threading.Thread(target=relay, args=(proc.stdout, sys.stdout, False), daemon=True),
                       threading.Thread(target=relay, args=(proc.stderr, sys.stderr, True), daemon=True)]
            for t in threads:
                t.start()
            if host is not None:
                try:
                    host.serve()  # while the script starts; its clients wait in the backlog meanwhile
                except BaseException:
                    proc.kill()
                    raise
            code = proc.wait()
            for t in threads:
                t.join(timeout=5)
            if code == 0:  # as torchrun's store outlives every worker, rank 0's waits for all scripts
                _script_done(info, host)
        finally:
            if host is not None:
                host.close()  # before the next call on this group binds the port again
        if code != 0:
            raise ScriptFailed(info.rank, code, "\n".join(tail), _recorded_error(error_file))
    return ScriptResult(info.rank, code)


def _start_script(command: Sequence[str], env: dict[str, str]) -> Any:
    """`python *command`: forked from this rank where it has torch already (see script_fork),
    else a fresh interpreter. Same process group as this rank either way: when fail-fast stops
    the rank, the script goes with it."""
    import subprocess

    from skytasks.node.script_fork import ForkedScript, can_fork

    if can_fork(list(command), env) is None:
        return ForkedScript(list(command), env)
    return subprocess.Popen([sys.executable, *command], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


DONE_WAIT_SECONDS = 30.0  # how long rank 0 keeps the store for scripts still ending (destroying their group)


def _script_done(info: Any, host: Any) -> None:
    """Rank 0 keeps the store up until every script has ended (a script still in
    `destroy_process_group` aborts when the store it uses goes). Each script holds a connection to
    the store until it ends, so rank 0 waits until none is open; the other ranks have nothing to
    do, and import no torch for it (a second of CPU each, after their scripts ended)."""
    if host is None or host._store is None:
        return
    deadline = time.monotonic() + DONE_WAIT_SECONDS
    while time.monotonic() < deadline:
        if not _scripts_connected(info.head_port):  # 0, or None: this system cannot tell
            return
        time.sleep(0.05)


def _scripts_connected(port: int) -> int | None:
    """How many connections to the store this process serves at `port` are open, less its own
    (the master store is a client of its own daemon too), from the kernel's socket tables."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    mine = set()
    for fd in fds:
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    served = own = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for fields in (row.split() for row in rows):
            if len(fields) < 10 or fields[3] != "01":  # 01: ESTABLISHED
                continue
            local, remote = (int(field.rpartition(":")[2], 16) for field in fields[1:3])
            if local == port:
                served += 1
            elif remote == port and f"socket:[{fields[9]}]" in mine:
                own += 1
    return served - own


class _StoreHost:
    """torchrun's agent's part, on rank 0's node: the TCPStore that a script's
    `init_process_group` (env://, with TORCHELASTIC_USE_AGENT_STORE=True) connects to, listening on
    the peers' interface only (`peer_listener`) and handed to torch as `master_listen_fd`.

    Why here and not in the script: the script is unchanged user code, and torch reads no setting
    that would make its rank 0 bind one address. Why this process: it outlives the script's rank
    0 (as torchrun's agent does its workers), and it is already the rank 0 skytasks owns."""

    def __init__(self, info: Any):
        from skytasks.node.socket_interface import peer_listener

        self._info = info
        self._listener: Any = peer_listener(info.head_addr, info.head_port, list(info.peers))
        self._store: Any = None

    def serve(self) -> None:
        try:
            from torch.distributed import TCPStore
        except ImportError:  # no torch on the node: the script makes no torch group either
            self.close()
            return
        # torch owns the descriptor from here (detach: the store closes it, once). If the store
        # cannot start, the call fails and its rank leaves, descriptor and all.
        fd = self._listener.detach()
        self._listener = None
        self._store = TCPStore(self._info.head_addr, self._info.head_port, is_master=True,
                               wait_for_workers=False, master_listen_fd=fd)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._store = None  # the last reference: the store's daemon stops and its port closes


def _recorded_error(path: str) -> str | None:
    """The message torch's `@record` wrote, when the script uses it."""
    import json

    try:
        with open(path) as f:
            message = json.load(f).get("message", {})
    except (OSError, ValueError):
        return None
    if isinstance(message, dict):
        return message.get("message")
    return str(message)


def script_command(script: str | os.PathLike, args: Iterable[Any], module: bool, workdir: Path | None) -> list[str]:
    """`[SCRIPT, *ARGS]` or `["-m", MODULE, *ARGS]`, checked before anything starts."""
    if not isinstance(script, (str, os.PathLike)) or not str(script):
        raise PoolConfigError(f"script: expected a path or module name, got {script!r}")
    if isinstance(args, (str, bytes)):
        raise PoolConfigError(f"args: expected a sequence of arguments, got the string {args!r} (use shlex.split)")
    argv = [str(a) for a in args]
    if module:
        if not _MODULE_NAME.match(str(script)):
            raise PoolConfigError(f"script: {script!r} is not a module name (module=True takes e.g. 'pkg.train')")
        return ["-m", str(script), *argv]
    base = workdir if workdir is not None else Path.cwd()
    path = Path(script) if Path(script).is_absolute() else base / script
    if not path.is_file():
        where = f"in workdir {base}" if workdir is not None else f"from the current directory {base}"
        raise PoolConfigError(f"script: {str(script)!r} not found {where}")
    if workdir is not None and path.resolve().is_relative_to(workdir):
        return [str(path.resolve().relative_to(workdir)), *argv]  # the node's copy, not this path
    return [str(path.resolve()), *argv]


def run_script(script: str | os.PathLike, args: Iterable[Any] = (), *, pool: Any = None, module: bool = False,
               workdir: str | os.PathLike | None = None, nodes: int | None = None, procs_per_node: int | None = None,
               env: Mapping[str, str] | None = None, timeout_seconds: float | None = None,
               hang_timeout_seconds: float | None = None, retries: int = 0,
               retry_delay_seconds: float = 0, node_recoveries: int = 3, rank_runs: str | None = None,
               name: str | None = None, tags: Iterable[str] = ()) -> list[ScriptResult]:
    """Run `python SCRIPT ARGS...` (or `python -m MODULE ARGS...`) unchanged on every rank, with
    torchrun's environment; returns a `ScriptResult` per rank, in rank order.

    `workdir` (default: the current directory, as under torchrun) is where every rank starts and
    what the script path is relative to; it travels to ssh and aws nodes. A rank that exits
    non-zero fails the call like a raising rank (`DistributedTaskError` of `ScriptFailed`)."""
    task, call_args = script_task(script, args, pool=pool, module=module, workdir=workdir, nodes=nodes,
                                  procs_per_node=procs_per_node, env=env, timeout_seconds=timeout_seconds,
                                  hang_timeout_seconds=hang_timeout_seconds, retries=retries,
                                  retry_delay_seconds=retry_delay_seconds, node_recoveries=node_recoveries,
                                  rank_runs=rank_runs, name=name, tags=tags)
    return task(*call_args)


def script_options(script: str | os.PathLike, args: Iterable[Any] = (), *, pool: Any = None, module: bool = False,
                   workdir: str | os.PathLike | None = None, nodes: int | None = None,
                   procs_per_node: int | None = None, env: Mapping[str, str] | None = None,
                   timeout_seconds: float | None = None, hang_timeout_seconds: float | None = None,
                   retries: int = 0, retry_delay_seconds: float = 0, node_recoveries: int = 3,
                   rank_runs: str | None = None, name: str | None = None,
                   tags: Iterable[str] = ()) -> tuple[Any, tuple]:
    """`run_script`'s checked options (its pool not yet looked up) and `run_on_rank`'s arguments."""
    import uuid

    from skytasks.call_options import CallOptions
    from skytasks.workdir import check_workdir

    root = check_workdir(workdir) or Path.cwd().resolve()
    command = script_command(script, args, module, root)
    label = name or (str(script).rsplit(".", 1)[-1] if module else Path(script).stem)
    options = CallOptions(name=label, pool=pool, nodes=nodes, procs_per_node=procs_per_node, init_torch=False,
                          runs_script=not module, timeout_seconds=timeout_seconds, hang_timeout_seconds=hang_timeout_seconds,
                          retries=retries, retry_delay_seconds=retry_delay_seconds, node_recoveries=node_recoveries,
                          rank_runs=rank_runs, workdir=root, tags=tuple(tags))
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(env).items()):
        raise PoolConfigError("env: expected a mapping of strings to strings")
    return options, (command, dict(env or {}), retries, f"skytasks-{uuid.uuid4().hex[:12]}")


def script_task(script: str | os.PathLike, args: Iterable[Any] = (), **options: Any) -> tuple[Any, tuple]:
    """`run_script`'s call, checked and not yet started: the distributed task and its arguments."""
    checked, call_args = script_options(script, args, **options)
    return task_on_its_pool(checked, call_args[0], module=options.get("module", False)), call_args


def task_on_its_pool(checked: Any, command: list[str], module: bool) -> Any:
    """The distributed task of checked `script_options`, once its pool is looked up (a saved
    block's name is loaded through the API)."""
    from skytasks.providers.registry import provider_class
    from skytasks.task import DistributedTask, resolve_pool

    pool = resolve_pool(checked.pool, nodes=checked.nodes, procs_per_node=checked.procs_per_node)
    if not module and os.path.isabs(command[0]) and not provider_class(pool.provider).runs_on_this_machine:
        raise PoolConfigError(f"script: {command[0]!r} is outside the workdir {checked.workdir}; "
                              f"{pool.provider} nodes only get the workdir")
    return DistributedTask(run_on_rank, checked.replace(pool=pool))
