"""A controller process that uses a saved warm pool once, as a flow run, for the warm pool tests
(tests/test_warm_pools.py, test_warm_fleets.py and the holders' tests), on any provider.

    python warm_call.py POOL_NAME OUT_JSON [SECONDS]

Inside `with pool:` it runs one call whose ranks sleep SECONDS (0: none; less if OUT_JSON.release
appears meanwhile), writing OUT_JSON.ready<RANK> once the ranks are inside it, then writes what it saw to OUT_JSON: each node's agent
pid, where it runs (host or pod) and its node id, how long the pool took to come up and its first
call, and its flow run's id and name.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefect import flow  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

from skytasks import GPUPool, distributed_task, rank_info  # noqa: E402

NAME, OUT = sys.argv[1], Path(sys.argv[2])
SECONDS = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0


@distributed_task
def work(seconds: float) -> int:
    if seconds:
        partial = OUT.parent / f"partial-{rank_info().rank}-{OUT.name}"  # not matched by a test's `*.ready*`
        partial.write_text(str(os.getpid()))
        os.replace(partial, OUT.parent / f"{OUT.name}.ready{rank_info().rank}")  # whole when seen: read at once
        deadline, release = time.monotonic() + seconds, OUT.parent / f"{OUT.name}.release"
        while time.monotonic() < deadline and not release.exists():  # a test may end the hold early
            time.sleep(0.1)
    return rank_info().rank


@flow(name="warm-call")
def use_pool() -> dict:
    pool = GPUPool.load(NAME)
    started = time.monotonic()
    with pool:
        up = time.monotonic() - started
        ranks = work(SECONDS)
        first = time.monotonic() - started
        session = pool.runtime().session
        nodes = session.nodes
        seen = {"pids": [n.pid for n in nodes], "where": [n.link.where or n.link.address for n in nodes],
                "node_ids": [n.link.node_id for n in nodes]}
        if pool.provider == "local":  # the private folder its agents log to, as its record names it
            seen["log_dir"] = session.provider.handle().get("log_dir")
    run = FlowRunContext.get().flow_run
    return {**seen, "up_seconds": up, "first_call_seconds": first, "ranks": ranks, "flow_run_id": str(run.id),
            "flow_run_name": run.name}


if __name__ == "__main__":
    OUT.write_text(json.dumps(use_pool()))
