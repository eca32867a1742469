"""One distributed call, without Prefect: pack the payload, find the pool, run with retries.

`skytasks.task` wraps this in Prefect task runs when there is a flow; outside a flow it is
called directly with a console observer.
"""

from __future__ import annotations

import contextvars
import os
import pickle
import site
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import cloudpickle

from skytasks.devices import check_backend_before_launch
from skytasks.errors import DistributedTaskError, PoolConfigError
from skytasks.serialization import Blob, blob_size, dumps_out_of_band
from skytasks.wire import BlobRef
from skytasks.controller.rank_group import DEFAULT_INIT_TIMEOUT_SECONDS, CallObserver, GroupSpec, RankOutcome
from skytasks.workdir import WorkdirRequest, read_workdir


# Set by `skytasks run`: rank lines are printed plainly on the console inside a flow too.
ECHO_RANK_LINES: contextvars.ContextVar[bool] = contextvars.ContextVar("skytasks_echo_rank_lines", default=False)


@dataclass(frozen=True)
class CallOptions:
    label: str
    backend: str | None
    init_torch: bool
    timeout_seconds: float | None
    retries: int
    retry_delay_seconds: float
    workdir: Path | None = None
    hang_timeout_seconds: float | None = None


_INSTALLED_ROOTS = tuple(
    os.path.realpath(p) + os.sep
    for p in {*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["stdlib"],
              sysconfig.get_paths()["platstdlib"]}
)
# Installed on every node (the controller's own version is what runs there).
_SHIPPED_PACKAGES = {"skytasks"}


def project_modules() -> list[ModuleType]:
    """Modules of the user's own project: imported from files outside any installed location.

    They are pickled by value, so a function that imports a helper from a sibling file works on a
    node that does not have the project, and a rank does not re-import the caller's module (and
    with it prefect, pytest, ...) just to find one function.
    """
    found = []
    for name, module in sys.modules.copy().items():  # copy(): other threads may be importing
        if name not in _IS_PROJECT:
            file = getattr(module, "__file__", None)
            top = name.partition(".")[0]
            real = os.path.realpath(file) if file else ""
            _IS_PROJECT[name] = bool(
                file and name != "__main__" and top not in _SHIPPED_PACKAGES
                and not _is_installed_file(real) and not _is_other_library(top, real)
            )
        if _IS_PROJECT[name]:
            found.append(module)
    return found


_IS_PROJECT: dict[str, bool] = {}  # module name -> from the user's project (files never move)


def _is_installed_file(path: str) -> bool:
    # Any environment's site-packages counts, not only this interpreter's own: a venv can see
    # another's through a .pth line or PYTHONPATH.
    parts = path.split(os.sep)
    return path.startswith(_INSTALLED_ROOTS) or "site-packages" in parts or "dist-packages" in parts


def _is_other_library(top: str, path: str) -> bool:
    """An editable install of someone else's library (pip install -e ~/src/lib) is a library:
    pickling it by value would copy the whole library into every call. A distribution that
    lives under the current directory is the user's own project, and travels by value."""
    global _DISTRIBUTION_NAMES
    if _DISTRIBUTION_NAMES is None:
        from importlib.metadata import packages_distributions

        _DISTRIBUTION_NAMES = set(packages_distributions())
    return top in _DISTRIBUTION_NAMES and not path.startswith(os.path.realpath(os.getcwd()) + os.sep)


_DISTRIBUTION_NAMES: set[str] | None = None


# Top-level arguments whose pickle is at least this large travel as blobs of their own: once per
# node, and not again while a warm rank group still holds the same bytes (see RankGroup.run).
BLOB_BYTES = 1 << 20


@dataclass(frozen=True)
class PackedCall:
    head: bytes  # cloudpickle of (fn, args, kwargs), large arguments replaced by BlobRef(i)
    blobs: list[Blob]  # blobs[i]: one large argument, pickled with out-of-band buffers


def pack_call(fn: Callable, args: tuple, kwargs: dict) -> PackedCall:
    """cloudpickle the call, or say exactly which part cannot travel, before any rank starts."""
    registered = []
    for module in project_modules():
        try:
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
        except ValueError:
            pass
    try:
        blobs: list[Blob] = []
        args = tuple(_as_blob(a, blobs) for a in args)
        kwargs = {k: _as_blob(v, blobs) for k, v in kwargs.items()}
        return PackedCall(_dumps_or_explain(fn, args, kwargs), blobs)
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def _as_blob(value: Any, blobs: list[Blob]) -> Any:
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    try:
        blob = dumps_out_of_band(value)
    except Exception:  # noqa: BLE001 - left in place; _dumps_or_explain names it
        return value
    if blob_size(blob) < BLOB_BYTES:
        return value
    blobs.append(blob)
    return BlobRef(len(blobs) - 1)


def _dumps_or_explain(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return cloudpickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as whole:  # noqa: BLE001 - find the culprit for the message
        parts: list[tuple[str, Any]] = [(f"the function {getattr(fn, '__qualname__', fn)!r}", fn)]
        parts += [(f"positional argument {i}", a) for i, a in enumerate(args)]
        parts += [(f"argument {k!r}", v) for k, v in kwargs.items()]
        for what, obj in parts:
            try:
                cloudpickle.dumps(obj)
            except Exception as exc:  # noqa: BLE001
                raise TypeError(
                    f"cannot send {what} (a {type(obj).__qualname__}) to the ranks: it cannot be "
                    f"pickled with cloudpickle: {exc}"
                ) from exc
        raise TypeError(f"cannot pickle the call to send it to the ranks: {whole}") from whole


def resolve_pool(pool: Any):
    """The pool object for a call: a block, a saved block's name, or the active `with pool:`."""
    from skytasks.blocks.gpu_pool import GPUPool, active_pool

    if pool is None:
        found = active_pool()
        if found is None:
            raise PoolConfigError(
                "no pool for this distributed task: pass pool= to @distributed_task (a GPUPool or "
                "the name of a saved GPUPool block), or call it inside `with pool:`"
            )
        return found
    if isinstance(pool, GPUPool):
        return pool
    if isinstance(pool, str):
        active = active_pool()
        if active is not None and getattr(active, "_block_document_name", None) == pool:
            return active
        return GPUPool.load(pool)
    raise PoolConfigError(f"pool: expected a GPUPool, a saved block name or None, got {type(pool).__qualname__}")


def run_call(
    pool: Any,
    payload: PackedCall,
    options: CallOptions,
    observer_for_attempt: Callable[[int, int], CallObserver],
) -> list[Any]:
    """Run the call on every rank, restarting the whole group on failure up to `retries` times."""
    deadline = None if options.timeout_seconds is None else time.monotonic() + options.timeout_seconds
    init_timeout = float(os.environ.get("SKYTASKS_INIT_TIMEOUT_SECONDS", DEFAULT_INIT_TIMEOUT_SECONDS))
    world = pool.nodes * pool.procs_per_node
    check_backend_before_launch(options.backend, pool.provider, pool.nodes, pool.procs_per_node,
                                pool.accelerators_per_node)
    workdir = None
    if options.workdir is not None:
        root = options.workdir  # already checked and resolved by the task
        # Read (and held to the size limit) before any node is up, when it has to travel.
        workdir = WorkdirRequest(root, None if pool.provider == "local" else read_workdir(root))
    spec = GroupSpec(options.backend, options.init_torch, init_timeout, workdir)
    with pool._nodes() as session:
        for attempt in range(1, options.retries + 2):
            observer = observer_for_attempt(attempt, world)
            try:
                return session.call(payload, spec, attempt=attempt, deadline=deadline, observer=observer,
                                    label=options.label, hang_timeout=options.hang_timeout_seconds)
            except DistributedTaskError as err:
                timed_out = any(isinstance(e, TimeoutError) for e in err.exceptions)
                if attempt > options.retries or (deadline is not None and timed_out):
                    raise
                # A collective cannot survive a partial restart: the next attempt is a fresh group.
                print(
                    f"[skytasks] {options.label}: attempt {attempt} failed ({err.exceptions[0]!r}); "
                    f"restarting all {world} ranks in {options.retry_delay_seconds:g}s",
                    file=sys.stderr,
                )
                time.sleep(options.retry_delay_seconds)
    raise AssertionError("unreachable")


class ConsoleObserver:
    """Outside a flow: each rank's lines on this process's console, prefixed `[rank R]`."""

    def on_output(self, rank: int, stream: str, line: str) -> None:
        print(f"[rank {rank}] {line}", file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)

    def on_log(self, rank: int, level: int, line: str) -> None:
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        pass

    def on_notice(self, text: str) -> None:
        print(f"[skytasks] {text}", file=sys.stderr, flush=True)

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        from skytasks.stacks import where

        for rank, stack in sorted(stacks.items()):
            print(f"[rank {rank}] was {where(stack) or 'somewhere unreadable'} ({why})", file=sys.stderr, flush=True)

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        shown = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print(f"[rank {rank}] report: {shown}", flush=True)
