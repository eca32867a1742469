"""A warm pool's nodes, one door at a time: holding a node's agent for this process (`hold`),
asking the first node that answers what it knows without taking anything (`ask_first_node`, for
`WarmPool.probe`), and letting go of what was taken (`give_back`, `let_go`, `leave`).

Each agent admits one holder at a time at its door (ATTACH mode "hold"); mode "probe" takes
nothing. What a node's answer means for the whole pool is decided in warm.py and warm_claim.py:
here a node is only held, gone for sure (NODE_GONE), or unread (maybe only out of reach).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from skytasks.controller.reconnect import HANDSHAKE_SECONDS, Refused, door_handshake
from skytasks.controller.warm_claim import HELD, NODE_GONE, UNREAD
from skytasks.errors import NodeGone
from skytasks.protocol import Op, message
from skytasks.providers import NodeLink, NodeProvider
from skytasks.wire import FrameWriter

REACH_SECONDS = 15.0  # the most one node's way in is given


class HeldElsewhere(Exception):
    def __init__(self, holder: str, since: float | None):
        super().__init__(holder)
        self.holder, self.since = holder, since


class Unread(Exception):
    """The provider, or some of the pool's nodes, could not be read now: maybe only out of reach."""


def who_am_i() -> str:
    """This process as another one waiting for the pool reads it: its flow run, pid and host."""
    where = f"pid {os.getpid()} on {socket.gethostname()}"
    context = sys.modules.get("prefect.context")
    try:
        run = context.FlowRunContext.get().flow_run if context else None
    except Exception:  # noqa: BLE001
        run = None
    return f"flow run {run.name!r} ({run.id}), {where}" if run is not None else where


def hold(provider: NodeProvider, node: dict[str, Any], key: bytes, holder: str) -> tuple[str, Any]:
    """One node's agent, held: (HELD, (its new stream, what it says of itself)); or (NODE_GONE
    or UNREAD, why). HeldElsewhere when another process holds it."""
    if not node.get("door"):
        return NODE_GONE, "it was lost before the pool was released"
    try:
        link = provider.reattach(node["node_id"], node["door"], REACH_SECONDS)
    except NodeGone as exc:
        return NODE_GONE, f"found gone while the pool was warm: {exc}"
    except Exception as exc:  # noqa: BLE001 - out of reach now is not gone
        return UNREAD, f"could not be reached: {type(exc).__name__}: {exc}"
    try:
        attached = door_handshake(link, key, node.get("instance", ""), holder, "hold", 0, who_am_i(),
                                  time.monotonic() + HANDSHAKE_SECONDS)
    except Refused as exc:
        let_go(link)
        if exc.holder:
            raise HeldElsewhere(exc.holder, exc.since) from None
        if exc.restarted:
            return NODE_GONE, str(exc)
        return UNREAD, str(exc)  # e.g. a key newer than the record read: read it again
    except Exception as exc:  # noqa: BLE001
        let_go(link)
        return UNREAD, f"its door did not answer: {type(exc).__name__}: {exc}"
    link.address = node.get("address") or link.address
    return HELD, (link, {**attached.get("state", {}), "door": node["door"], "instance": node.get("instance", "")})


def ask_first_node(provider: NodeProvider, record: dict[str, Any]) -> dict[str, Any]:
    """The record with what its first node that answers says (mode "probe": nothing is taken):
    `holder`, `held_since`, `unheld_since`, `expires_at` where the agent says them. A pool none
    of whose nodes could be asked says why in `holder` (never taken for gone); one whose nodes
    are all gone says so in `ended`."""
    key, unreachable = bytes.fromhex(record["pool_key"]), ""
    for node in sorted(record.get("nodes", []), key=lambda n: n["node_id"]):
        if not node.get("door"):
            continue
        try:
            link = provider.reattach(node["node_id"], node["door"], REACH_SECONDS)
        except NodeGone:
            continue
        except Exception as exc:  # noqa: BLE001 - maybe only out of reach now: never taken for gone
            unreachable = f"{type(exc).__name__}: {exc}"
            continue
        try:
            state = dict(door_handshake(link, key, node.get("instance", ""), "probe", "probe", 0, who_am_i(),
                                        time.monotonic() + HANDSHAKE_SECONDS).get("state") or {})
        except Refused as exc:
            if not exc.holder:
                unreachable = str(exc)
                continue
            state = {"holder": exc.holder, "held_since": exc.since}
        except Exception as exc:  # noqa: BLE001
            unreachable = f"{type(exc).__name__}: {exc}"
            continue
        finally:
            let_go(link)
        return {**record, **state}
    if unreachable:
        return {**record, "holder": f"(no node answered: {unreachable})"}
    return {**record, "ended": "none of its nodes runs any more"}


def leave(provider: NodeProvider) -> None:
    try:
        provider.leave_running()
    except Exception:  # noqa: BLE001 - it let go of nothing this process holds
        pass


def let_go(link: NodeLink) -> None:
    try:
        link.let_go_lost()
    except Exception:  # noqa: BLE001
        pass


def give_back(held: list[tuple[NodeLink, dict[str, Any]]], provider: NodeProvider) -> None:
    """Nodes taken and given back at once (another process holds the rest, or some could not be
    read): RELEASE on each new stream, then close; the provider lets go, ending nothing."""
    for link, _ in held:
        try:
            FrameWriter(link.outbound).send(message(Op.RELEASE))
        except Exception:  # noqa: BLE001 - its stream closing frees it too
            pass
        let_go(link)
    leave(provider)
