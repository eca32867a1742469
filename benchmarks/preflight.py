"""What the node health check adds to a healthy pool's start (docs/benchmarks.md, "Node health").

A cold call on a local pool brought up for it (a trivial all-reduce), with preflight "off",
"basic" and "full", on 2 and 4 nodes; the levels interleaved round by round so the machine's drift
falls on all three alike (and each comes first in some rounds). Also the check's own time (`PoolHealthy.seconds`: the probe call,
including the rank group's start that the first call then reuses).

    .venv/bin/python benchmarks/preflight.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEVELS = ("off", "basic", "full")


def all_reduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from skytasks import GPUPool, distributed_task
    from skytasks.events import listen
    from skytasks.preflight.report import PoolHealthy

    distributed_task(all_reduce, pool=GPUPool(nodes=2, preflight="off"))()  # the fork server and torch, once
    results = {}
    for nodes in (2, 4):
        calls: dict[str, list[float]] = {level: [] for level in LEVELS}
        checks: dict[str, list[float]] = {level: [] for level in LEVELS}
        for round_ in range(args.rounds):
            for level in LEVELS[round_ % 3:] + LEVELS[:round_ % 3]:  # each level first in some rounds
                task = distributed_task(all_reduce, pool=GPUPool(nodes=nodes, preflight=level))
                with listen() as heard:
                    started = time.perf_counter()
                    assert task() == [float(nodes)] * nodes
                    calls[level].append(time.perf_counter() - started)
                checks[level] += [e.seconds for e in heard if isinstance(e, PoolHealthy)]
        off = statistics.median(calls["off"])
        results[f"{nodes} nodes"] = {
            level: {"call_median_s": round(statistics.median(calls[level]), 3),
                    "added_s": round(statistics.median(calls[level]) - off, 3),
                    "check_median_s": round(statistics.median(checks[level]), 3) if checks[level] else None}
            for level in LEVELS}
    print(json.dumps(results, indent=2))
    (HERE / "results-preflight.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
