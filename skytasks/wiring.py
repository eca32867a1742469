"""The composition root: the one place the controller is handed what Prefect provides.

The controller and the providers never import Prefect, and `prefect_records` (which does) stands
above them, so neither may reach up for the other's parts. Instead this module, above both, hands
them over when a pool's runtime is built (`GPUPool.runtime()`, `skytasks run`'s local pool,
`skytasks pools`):

- the store of warm pools' records (Prefect Secret blocks, `prefect_records/warm_store.py`),
  given as a maker the runtime calls at a warm pool's first use: a pool that is never warm never
  imports Prefect's blocks for it;
- the node health check before user code (`skytasks/preflight/`), which runs its probe as a call
  through the controller and so stands above it: the runner runs what it is handed;
- the sink that hears every pool's events (`prefect_records/pool_events.py`: the flow run's log,
  progress artifacts, Prefect events), added to the pool event bus (`skytasks.event_bus`).

Nothing is wired by importing a module, and nothing is looked up by name: only a call here wires,
and a second call wires nothing twice. Everything it imports, it imports when called, so a fresh
process pays for no more than it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skytasks.controller.pool_runtime import PoolRuntime
    from skytasks.controller.warm_claim import WarmStore
    from skytasks.pool_spec import PoolSpec


def pool_runtime(spec: PoolSpec, owner: Any) -> PoolRuntime:
    """A pool's runtime (`owner`: its GPUPool block, or None), its events heard by Prefect and its
    warm record kept in Prefect's secrets."""
    from skytasks.controller.pool_runtime import PoolRuntime

    hear_pool_events_in_prefect()
    return PoolRuntime(spec, owner, warm_store=prefect_warm_store, health_check=preflight)


def hear_pool_events_in_prefect() -> None:
    """Every pool's events reach Prefect too: the flow run's log, progress artifacts, Prefect
    events (emitted inside a flow run, and a warm pool's outside one as well)."""
    from skytasks.event_bus import add_sink
    from skytasks.prefect_records.pool_events import record_pool_event

    add_sink(record_pool_event)


def prefect_warm_store() -> WarmStore:
    """Warm pools' records in the Prefect API this process talks to."""
    from skytasks.prefect_records.warm_store import PrefectWarmStore

    return PrefectWarmStore()


def preflight(session: Any, spec: PoolSpec, group_spec: Any, observer: Any, *, replacements: int) -> None:
    """The node health check (`controller.runner.HealthCheck`), imported at a pool's first call."""
    from skytasks.preflight.check import node_health_check

    node_health_check(session, spec, group_spec, observer, replacements=replacements)
