"""`skytasks pools` (the warm pools there are, each asked through its first node that answers)
and `skytasks pools down NAME` (end one now, once no process holds it).

A warm pool is a saved pool with `keep_warm_minutes` whose nodes outlive the process that held
them (skytasks.controller.warm). Its record is a Prefect secret; this command reads it, and has
the warm pool ask a node's agent what it knows (`WarmPool.probe`: who holds the pool, since when
it is idle, when it ends). It only reads: it never writes a record or ends a node, and a provider
that cannot be read now is said so.
"""

from __future__ import annotations

import sys
import time
from typing import Any, cast

HEADER = ("NAME", "PROVIDER", "NODES", "UP SINCE", "HOLDER / IDLE SINCE", "ENDS")


def add_parser(commands: Any) -> None:
    pools = commands.add_parser("pools", help="list warm pools (keep_warm_minutes); `pools down NAME` ends one")
    pools.add_argument("action", nargs="?", choices=["down"], help="down: end the warm pool NAME now")
    pools.add_argument("name", nargs="?", help="the saved pool's name (with down)")


def pools_command(args: Any) -> int:
    from skytasks.wiring import hear_pool_events_in_prefect, prefect_warm_store

    hear_pool_events_in_prefect()  # e.g. skytasks.pool.expired, when `down` finds the pool gone
    if args.action == "down":
        if not args.name:
            print("skytasks pools down: which pool? (skytasks pools down NAME)", file=sys.stderr)
            return 2
        return _down(args.name)
    rows = []
    for name in prefect_warm_store().names():
        row = _row(name)
        if row is not None:
            rows.append(row)
    if not rows:
        print("skytasks pools: no warm pool is up")
        return 0
    widths = [max(len(r[i]) for r in (HEADER, *rows)) for i in range(len(HEADER))]
    for r in (HEADER, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def _warm_pool(name: str) -> Any:
    from skytasks.blocks.gpu_pool import GPUPool
    from skytasks.errors import PoolConfigError

    try:
        pool = cast(GPUPool, GPUPool.load(name))
    except ValueError as exc:  # Prefect's "Unable to find block document named ... for block type gpu-pool"
        if "Unable to find block document" not in str(exc):
            raise
        raise PoolConfigError(f"no GPUPool block is saved under that name in this Prefect API (GPUPool(...)"
                              f".save({name!r}) saves one; `skytasks pools` lists the warm ones)") from None
    return pool.runtime().warm_pool()


def _row(name: str) -> tuple[str, ...] | None:
    try:
        info = _warm_pool(name).probe()
    except Exception as exc:  # noqa: BLE001 - one pool that cannot be asked does not hide the others
        return (name, "?", "?", "?", f"cannot be asked: {exc}", "?")
    if info is None:
        return None  # its record was cleared meanwhile
    if info.get("ended"):
        return (name, str(info.get("provider", "?")), "0", _when(info.get("up_since")), f"ended: {info['ended']}",
                "cleared by the next use")
    if info.get("state") == "starting":
        return (name, str(info.get("provider", "?")), "-", "starting", str(info.get("who", "")), "-")
    nodes = sum(1 for n in info.get("nodes", []) if n.get("door"))
    keep = float(info.get("keep_warm_minutes", 0))
    if info.get("holder"):
        held = f"held by {info['holder']}" + (f" since {_when(info['held_since'])}" if info.get("held_since") else "")
        ends = f"{keep:g} min after its release"
    else:
        idle = info.get("unheld_since") or info.get("released_at")
        held = f"idle since {_when(idle)}" if idle else "idle"
        end = info.get("expires_at") or (float(idle) + keep * 60 if idle else None)
        ends = _when(end) if end else f"{keep:g} min unheld"
    return (name, str(info.get("provider", "?")), str(nodes), _when(info.get("up_since")), held, ends)


def _when(epoch: Any) -> str:
    if not epoch:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(epoch)))


def _down(name: str) -> int:
    from skytasks.errors import PoolConfigError, PoolStartError

    try:
        ended = _warm_pool(name).down()
    except (ValueError, PoolConfigError, PoolStartError) as exc:
        print(f"skytasks pools down: {name}: {exc}", file=sys.stderr)
        return 1
    print(f"skytasks pools down: {name}: {'ended' if ended else 'no warm pool of that name is up'}")
    return 0
