"""A controller process that uses a saved warm pool once, as a flow run, for tests/test_warm_fleets.py.

    python warm_fleet_call.py POOL_NAME OUT_JSON

Inside `with pool:` it runs one call (each rank returns its rank and the agent that started it),
then writes to OUT_JSON what it saw: each node's agent pid and where it runs (host or pod), how
long the pool took to come up and its first call, and its flow run's id.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefect import flow  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

from skytasks import GPUPool, distributed_task, rank_info  # noqa: E402

NAME, OUT = sys.argv[1], Path(sys.argv[2])


@distributed_task
def work() -> int:
    return rank_info().rank


@flow(name="warm-fleet-call")
def use_pool() -> dict:
    pool = GPUPool.load(NAME)
    started = time.monotonic()
    with pool:
        up = time.monotonic() - started
        ranks = work()
        first = time.monotonic() - started
        nodes = pool.runtime().session.nodes
        seen = {"pids": [n.pid for n in nodes], "where": [n.link.where or n.link.address for n in nodes],
                "node_ids": [n.link.node_id for n in nodes]}
    run = FlowRunContext.get().flow_run
    return {**seen, "up_seconds": up, "first_call_seconds": first, "ranks": ranks, "flow_run_id": str(run.id)}


if __name__ == "__main__":
    OUT.write_text(json.dumps(use_pool()))
