"""@distributed_task: a thin decorator over `skytasks.controller.call` and `skytasks.controller.prefect_runs`."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterable

from skytasks.controller.call import CallOptions, ConsoleObserver, pack_call, resolve_pool, run_call
from skytasks.errors import PoolConfigError
from skytasks.rank import in_rank
from skytasks.workdir import check_workdir

_OPTION_NAMES = (
    "pool", "nodes", "procs_per_node", "backend", "init_torch", "timeout_seconds", "hang_timeout_seconds",
    "retries", "retry_delay_seconds", "workdir", "name", "tags",
)


class DistributedTask:
    def __init__(self, fn: Callable, *, pool=None, nodes=None, procs_per_node=None, backend=None,
                 init_torch=True, timeout_seconds=None, hang_timeout_seconds=None, retries=0, retry_delay_seconds=0,
                 workdir=None, name=None, tags=()):
        if not callable(fn):
            raise TypeError(f"distributed_task: expected a function, got {type(fn).__qualname__}")
        for field, value in (("nodes", nodes), ("procs_per_node", procs_per_node)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PoolConfigError(f"{field}: must be an integer ≥ 1, got {value!r}")
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise PoolConfigError(f"timeout_seconds: must be > 0 or None, got {timeout_seconds!r}")
        if hang_timeout_seconds is not None and not hang_timeout_seconds > 0:
            raise PoolConfigError(f"hang_timeout_seconds: must be > 0 or None, got {hang_timeout_seconds!r}")
        if not isinstance(retries, int) or retries < 0:
            raise PoolConfigError(f"retries: must be an integer ≥ 0, got {retries!r}")
        if retry_delay_seconds < 0:
            raise PoolConfigError(f"retry_delay_seconds: must be ≥ 0, got {retry_delay_seconds!r}")
        if backend is not None and backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
            raise PoolConfigError(f"backend: unknown torch.distributed backend {backend!r}")
        if workdir is not None and not isinstance(workdir, (str, os.PathLike)):
            raise PoolConfigError(f"workdir: expected a directory path, got {type(workdir).__qualname__}")
        self._fn = fn
        self.workdir = workdir
        self.pool, self.nodes, self.procs_per_node = pool, nodes, procs_per_node
        self.backend, self.init_torch, self.timeout_seconds = backend, bool(init_torch), timeout_seconds
        self.hang_timeout_seconds = hang_timeout_seconds
        self.retries, self.retry_delay_seconds = retries, retry_delay_seconds
        self.name = name or getattr(fn, "__name__", "distributed_task")
        self.tags = tuple(tags)
        functools.update_wrapper(self, fn)

    @property
    def fn(self) -> Callable:
        """The plain function, to call or test without any fan-out."""
        return self._fn

    def with_options(self, **changes: Any) -> DistributedTask:
        unknown = set(changes) - set(_OPTION_NAMES)
        if unknown:
            raise TypeError(f"with_options: unknown option(s) {sorted(unknown)}; known: {list(_OPTION_NAMES)}")
        current = {k: getattr(self, k) for k in _OPTION_NAMES}
        return DistributedTask(self._fn, **{**current, **changes})

    def _pool_for_call(self):
        pool = resolve_pool(self.pool)
        shape = {k: v for k, v in (("nodes", self.nodes), ("procs_per_node", self.procs_per_node)) if v is not None}
        if shape and any(getattr(pool, k) != v for k, v in shape.items()):
            # Another shape cannot use the warm nodes: a copy is brought up for this call.
            pool = pool.model_copy(update=shape)
            pool._session = None
        return pool

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        if in_rank():
            raise RuntimeError(
                f"distributed task {self.name!r} was called inside a rank: nested fan-out is not "
                "supported; call the plain function with .fn instead"
            )
        payload = pack_call(self._fn, args, kwargs)
        pool = self._pool_for_call()
        options = CallOptions(
            label=self.name, backend=self.backend, init_torch=self.init_torch,
            timeout_seconds=self.timeout_seconds, retries=self.retries,
            retry_delay_seconds=self.retry_delay_seconds, workdir=check_workdir(self.workdir),
            hang_timeout_seconds=self.hang_timeout_seconds,
        )
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is None:
            return run_call(pool, payload, options, lambda attempt, world: ConsoleObserver())

        from skytasks.controller.prefect_runs import run_as_parent_task

        run_tags = (*self.tags, f"pool:{pool.display_name}")
        return run_as_parent_task(
            self.name, pool.display_name, run_tags, lambda observer_for: run_call(pool, payload, options, observer_for)
        )

    def __repr__(self) -> str:
        return f"DistributedTask({self.name!r})"


def distributed_task(fn: Callable | None = None, *, pool=None, nodes=None, procs_per_node=None, backend=None,
                     init_torch=True, timeout_seconds=None, hang_timeout_seconds=None, retries=0,
                     retry_delay_seconds=0, workdir=None, name=None, tags: Iterable[str] = ()) -> Any:
    """Fan a function out to every rank of a pool; returns every rank's result in rank order."""
    options = dict(pool=pool, nodes=nodes, procs_per_node=procs_per_node, backend=backend, init_torch=init_torch,
                   timeout_seconds=timeout_seconds, hang_timeout_seconds=hang_timeout_seconds, retries=retries,
                   retry_delay_seconds=retry_delay_seconds, workdir=workdir, name=name, tags=tuple(tags))
    if fn is None:
        return lambda f: DistributedTask(f, **options)
    return DistributedTask(fn, **options)
