"""@distributed_task: a thin decorator. It checks its options, finds the pool, and hands the call
to the runner (`skytasks.controller.runner`): directly outside a flow, as a Prefect task run
inside one (`skytasks.prefect_records.parent_task`)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable, Iterable

from prefect.context import FlowRunContext

from skytasks.controller.console import ConsoleObserver
from skytasks.controller.packing import pack_call
from skytasks.controller.pool_runtime import active_pool
from skytasks.call_options import CallOptions
from skytasks.controller.runner import PreparedCall, run_call
from skytasks.errors import PoolConfigError
from skytasks.providers.registry import provider_class
from skytasks.rank import in_rank
from skytasks.workdir import check_workdir

class DistributedTask:
    """What `@distributed_task` makes: called, it runs the function on every rank of its pool and
    returns each rank's value in rank order (a Prefect task run with a child run per rank, inside
    a flow). `.submit(...)` returns a PrefectFuture of that list, `.with_options(...)` a copy with
    options changed, and `.fn` is the plain function."""

    def __init__(self, fn: Callable, options: CallOptions):
        if not callable(fn):
            raise TypeError(f"distributed_task: expected a function, got {type(fn).__qualname__}")
        self._fn = fn
        self.options = options
        self.name = options.name
        self._prefect_task = None  # the Prefect Task this is in flows, made on first use
        functools.update_wrapper(self, fn)

    @property
    def fn(self) -> Callable:
        """The plain function, to call or test without any fan-out."""
        return self._fn

    def with_options(self, **changes: Any) -> DistributedTask:
        return DistributedTask(self._fn, self.options.replace(**changes))

    def prepare(self) -> PreparedCall:
        """The call's pool and checked options, before anything starts."""
        if in_rank():
            raise RuntimeError(
                f"distributed task {self.name!r} was called inside a rank: nested fan-out is not "
                "supported; call the plain function with .fn instead"
            )
        o = self.options
        pool = resolve_pool(o.pool, nodes=o.nodes, procs_per_node=o.procs_per_node)
        shape = {k: v for k, v in (("nodes", o.nodes), ("procs_per_node", o.procs_per_node)) if v is not None}
        if shape and any(getattr(pool, k) != v for k, v in shape.items()):
            if not provider_class(pool.provider).reshape_is_cheap:
                asked = ", ".join(f"{k}={v}" for k, v in shape.items())
                raise PoolConfigError(
                    f"nodes/procs_per_node: {self.name!r} asks for {asked}, but its pool {pool.display_name!r} "
                    f"(provider={pool.provider!r}) has nodes={pool.nodes}, procs_per_node={pool.procs_per_node}; a "
                    f"{pool.provider} pool never brings up a second set of machines for one call. Drop "
                    f"{asked} from the task to use the pool as it is, or give the task a pool of that shape")
            pool = pool.reshaped(**shape)  # another shape cannot use the warm nodes
        options = o.replace(workdir=check_workdir(o.workdir))  # exists now, resolved
        return PreparedCall(self._fn, pool.runtime(), options)

    def _parent_task(self):
        from skytasks.prefect_records.parent_task import parent_task

        if self._prefect_task is None:
            self._prefect_task = parent_task(self.name)
        return self._prefect_task

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Every rank's return value, in rank order. In an async flow, an awaitable of it: the
        call runs in a thread, and the event loop goes on."""
        call = self.prepare()
        flow_run = FlowRunContext.get()
        if flow_run is None:
            payload = pack_call(self._fn, args, kwargs)
            return run_call(call.runtime, payload, call.options, ConsoleObserver())
        from skytasks.prefect_records import parent_task as prefect_task

        if flow_run.flow is not None and flow_run.flow.isasync and _loop_running_here():
            return prefect_task.call_in_async_flow(self._parent_task(), call, args, kwargs)
        return prefect_task.call_in_flow(self._parent_task(), call, args, kwargs)

    def submit(self, *args: Any, wait_for: Any = None, **kwargs: Any) -> Any:
        """Start the call in the flow's task runner; a `PrefectFuture` of the per-rank list.
        Calls on different pools run at the same time; calls on one pool take turns."""
        if FlowRunContext.get() is None:
            raise RuntimeError(f"{self.name}.submit(): submit needs a flow run (as Prefect's Task.submit does); "
                               "outside a flow, call the distributed task directly")
        from skytasks.prefect_records import parent_task as prefect_task

        return prefect_task.submit_in_flow(self._parent_task(), self.prepare(), args, kwargs, wait_for=wait_for)

    def __repr__(self) -> str:
        return f"DistributedTask({self.name!r})"


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def resolve_pool(pool: Any, nodes: int | None = None, procs_per_node: int | None = None) -> Any:
    """The pool object for a call: a block, a saved block's name, the active `with pool:`, or
    with none of them a local pool of the call's shape (2 x 1 by default), as torchrun would run
    on this machine."""
    from skytasks.blocks.gpu_pool import GPUPool

    if pool is None:
        found = active_pool()
        if found is None:
            found = GPUPool(provider="local", nodes=nodes or 2, procs_per_node=procs_per_node or 1)
            say_default_pool(found)
        return found
    if isinstance(pool, GPUPool):
        return pool
    if isinstance(pool, str):
        active = active_pool()
        if active is not None and active.saved_name == pool:
            return active
        return GPUPool.load(pool)
    raise PoolConfigError(f"pool: expected a GPUPool, a saved block name or None, got {type(pool).__qualname__}")


def say_default_pool(pool: Any) -> None:
    """One line, on the console and in the run's log: the call runs here because nothing said where."""
    per = f" x {pool.procs_per_node} processes" if pool.procs_per_node > 1 else ""
    line = f"no pool given: a local pool of {pool.nodes} nodes{per} on this machine"
    from skytasks.event_bus import PoolReporter
    from skytasks.wiring import hear_pool_events_in_prefect

    hear_pool_events_in_prefect()  # said before the pool's runtime (the composition root) is built
    PoolReporter(pool.display_name, "local").note(line)


def distributed_task(fn: Callable | None = None, *, pool=None, nodes=None, procs_per_node=None, backend=None,
                     init_torch=True, timeout_seconds=None, hang_timeout_seconds=None, retries=0,
                     retry_delay_seconds=0, node_recoveries=3, rank_runs=None, workdir=None, name=None,
                     tags: Iterable[str] = ()) -> Any:
    """Fan a function out to every rank of a pool; returns every rank's result in rank order."""
    def make(f: Callable) -> DistributedTask:
        if not callable(f):
            raise TypeError(f"distributed_task: expected a function, got {type(f).__qualname__}")
        return DistributedTask(f, CallOptions(
            name=name or getattr(f, "__name__", "distributed_task"), pool=pool, nodes=nodes,
            procs_per_node=procs_per_node, backend=backend, init_torch=init_torch, timeout_seconds=timeout_seconds,
            hang_timeout_seconds=hang_timeout_seconds, retries=retries, retry_delay_seconds=retry_delay_seconds,
            node_recoveries=node_recoveries, rank_runs=rank_runs, workdir=workdir, tags=tuple(tags)))

    return make if fn is None else make(fn)
