"""Warm pools: a saved pool's nodes outlive the process that holds them (`keep_warm_minutes`).

The first process that uses the pool starts its nodes as always and leases them to itself with a
keep-warm time (LEASE `keep_warm_seconds`). When it is done (the end of the call, or of `with
pool:`), it releases them (RELEASE) instead of ending them, and stores what attaching needs in the
pool's record. The next process attaches to the running agents through their doors instead of
starting nodes; agents nobody holds for `keep_warm_minutes` end themselves.

**The agents are the lock.** Each agent admits one holder at a time (ATTACH mode "hold"); a
process takes a pool's nodes in node-id order and lets go of what it took when one is held by
another, so two processes never split a pool. No clock is compared across machines and nothing
depends on the Prefect API mid-call. A holder that dies breaks its streams: its agents are free
again within `reattach_seconds` (at once on local).

**The record** (`WarmStore`, a Prefect Secret block: skytasks/prefect_records/warm_store.py) holds
the pool's key and TLS key, the nodes' doors and the provider's handle; only the holder writes it.
Claiming it is one atomic create, so two processes that find no pool do not both start one.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import socket
import sys
import time
from typing import Any, Callable, Protocol

from skytasks.controller.pool_relay import PoolRelay
from skytasks.controller.reconnect import HANDSHAKE_SECONDS, Refused, door_handshake
from skytasks.controller.session import PoolSession
from skytasks.errors import NodeGone, PoolConfigError, PoolStartError
from skytasks.events import PoolAttached, PoolExpired, PoolReleased
from skytasks.pool_spec import PoolSpec
from skytasks.protocol import Op, message
from skytasks.providers import NodeLink, NodeProvider
from skytasks.providers.reporting import PoolReporter
from skytasks.wire import FrameWriter

RECORD_VERSION = 1
POLL_SECONDS = 0.5  # how often a process waiting in line asks again
REACH_SECONDS = 15.0  # the most one node's way in is given
DEFAULT_WAIT_SECONDS = 900.0  # ready_timeout_seconds' default, for providers that have no such field


class WarmStore(Protocol):
    """Where warm pools' records are kept, by pool name (a secret store: they hold the pool's key)."""

    def load(self, pool: str) -> dict[str, Any] | None: ...
    def claim(self, pool: str, record: dict[str, Any]) -> bool: ...  # atomic create; False: one exists
    def save(self, pool: str, record: dict[str, Any]) -> None: ...
    def delete(self, pool: str) -> None: ...
    def names(self) -> list[str]: ...


_store: WarmStore | None = None


def register_store(store: WarmStore) -> None:
    """The Prefect side registers its store as it is imported (skytasks.prefect_records.warm_store)."""
    global _store
    _store = store


def default_store() -> WarmStore:
    if _store is None:  # registers itself; named, so the controller never imports Prefect
        importlib.import_module("skytasks.prefect_records.warm_store")
    assert _store is not None
    return _store


class HeldElsewhere(Exception):
    def __init__(self, holder: str, since: float | None):
        super().__init__(holder)
        self.holder, self.since = holder, since


def spec_digest(spec: PoolSpec) -> str:
    """The pool's shape and settings as a hash: nodes of another shape are not attached to."""
    shape = [spec.provider, spec.nodes, spec.min_nodes, spec.procs_per_node, spec.accelerators_per_node,
             sorted(spec.env.items()), repr(spec.part)]
    return hashlib.sha256(json.dumps(shape, default=str).encode()).hexdigest()[:16]


def who_am_i() -> str:
    """This process as another one waiting for the pool reads it: its flow run, pid and host."""
    where = f"pid {os.getpid()} on {socket.gethostname()}"
    context = sys.modules.get("prefect.context")
    try:
        run = context.FlowRunContext.get().flow_run if context else None
    except Exception:  # noqa: BLE001
        run = None
    return f"flow run {run.name!r} ({run.id}), {where}" if run is not None else where


def wait_limit(spec: PoolSpec) -> float:
    return float(getattr(spec.part, "ready_timeout_seconds", None) or DEFAULT_WAIT_SECONDS)


class WarmPool:
    """One process's use of a warm pool: `open` attaches (or starts it), `release` lets go."""

    def __init__(self, spec: PoolSpec, name: str | None, store: WarmStore, make_provider: Callable[[], NodeProvider],
                 build: Callable[[NodeProvider, PoolRelay | None], PoolSession]):
        if not name:
            raise PoolConfigError("keep_warm_minutes: save the pool first (pool.save('NAME')): a warm pool is found "
                                  "again by its saved name")
        self.spec, self.name, self.store = spec, name, store
        self.make_provider, self._build = make_provider, build
        self.reporter = PoolReporter(spec.name, spec.provider)
        self.record: dict[str, Any] = {}
        self.attached = False

    # -- taking the pool ---------------------------------------------------------------------

    def open(self) -> PoolSession:
        """The pool's nodes, held by this process: attached when warm, else started; waits in line
        while another process holds them, up to ready_timeout_seconds (then PoolStartError)."""
        deadline = time.monotonic() + wait_limit(self.spec)
        while True:
            session = self._take(deadline)
            if session is None:
                if self.store.claim(self.name, self._placeholder()):
                    return self._start()
                continue  # another process claimed it first: wait for it in line
            if self.record.get("digest") != spec_digest(self.spec):
                self.reporter.note(f"warm pool {self.name}'s nodes were of another shape: ending them, starting afresh")
                session.close()
                self._forget(self.record)
                continue
            self.attached = True
            self.reporter.event(PoolAttached(self.name, len(session.nodes), time.time() - float(self.record["up_since"]),
                                             int(self.record.get("calls", 0))))
            return session

    def down(self) -> bool:
        """End the pool's nodes now (`skytasks pools down`), once it is this process's turn;
        False when it had no nodes."""
        session = self._take(time.monotonic() + wait_limit(self.spec))
        if session is None:
            return False
        try:
            session.close()
        finally:
            self._forget(self.record)
        return True

    def _take(self, deadline: float) -> PoolSession | None:
        """The pool's running nodes, held by this process (waiting in line for them); None when
        it has none: no record, or they had all ended (then its record is gone too)."""
        while True:
            record = self.store.load(self.name)
            if record is None:
                return None
            if record.get("state") == "starting":
                if time.time() - float(record.get("claimed_at", 0)) > wait_limit(self.spec) + 60:
                    self._forget(record)  # its starter died before saving the pool
                    continue
                self._wait(record.get("who", "another process"), record.get("claimed_at"), deadline, "started")
                continue
            try:
                session = self._attach(record)
            except HeldElsewhere as held:
                self._wait(held.holder, held.since, deadline, "held")
                continue
            if session is not None:
                self.record = dict(record)
            return session

    def _placeholder(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "pool": self.name, "state": "starting", "who": who_am_i(),
                "claimed_at": time.time()}

    def _wait(self, who: str, since: Any, deadline: float, how: str) -> None:
        when = time.strftime("%H:%M:%S", time.localtime(float(since))) if since else "a moment ago"
        if time.monotonic() > deadline:
            raise PoolStartError(f"warm pool {self.name} is {how} by {who} (since {when}); waited "
                                 f"{wait_limit(self.spec):g}s (ready_timeout_seconds) for it")
        nodes = self.spec.nodes
        self.reporter.progress(0, nodes, f"waiting for warm pool {self.name}, {how} by {who} since {when}")
        time.sleep(POLL_SECONDS)

    def _start(self) -> PoolSession:
        try:
            session = self._build(self.make_provider(), None).start()
        except BaseException:
            self.store.delete(self.name)
            raise
        now = time.time()
        self.record = {"version": RECORD_VERSION, "pool": self.name, "state": "up", "provider": self.spec.provider,
                       "digest": spec_digest(self.spec), "up_since": now, "calls": 0,
                       "keep_warm_minutes": self.spec.keep_warm_minutes, **_keys(session.relay)}
        try:  # e.g. a provider that cannot keep these nodes warm says so here: nothing is left running
            self.store.save(self.name, self._refreshed(session))
        except BaseException:
            session.close()
            self.store.delete(self.name)
            raise
        return session

    def _attach(self, record: dict[str, Any]) -> PoolSession | None:
        """Hold every node of the record, in node-id order; None when none runs any more."""
        provider = self.make_provider()
        try:
            provider.adopt(record.get("handle") or {})
        except PoolStartError as exc:
            self.expire(record, provider, str(exc))
            return None
        session = self._build(provider, PoolRelay.from_stored(record["pool_key"], record.get("tls_cert", ""),
                                                              record.get("tls_key", "")))
        held: list[tuple[NodeLink, dict[str, Any]]] = []
        gone: list[tuple[int, str, str]] = []
        try:
            for node in sorted(record.get("nodes", []), key=lambda n: n["node_id"]):
                taken = self._hold(provider, node, bytes.fromhex(record["pool_key"]), session.holder)
                if isinstance(taken, str):
                    gone.append((node["node_id"], node.get("address", ""), taken))
                else:
                    held.append(taken)
        except HeldElsewhere:
            for link, _ in held:
                _let_go_held(link)
            provider.leave_running()
            raise
        if not held:
            self.expire(record, provider, "none of its nodes runs any more")
            return None
        if (current := self.store.load(self.name)) is None or current.get("nodes") != record.get("nodes"):
            for link, _ in held:  # its holder changed the pool as we took it: read it again
                _let_go_held(link)
            provider.leave_running()
            raise HeldElsewhere("the process that just released it", time.time())
        return session.adopt(held, gone)

    def _hold(self, provider: NodeProvider, node: dict[str, Any], key: bytes,
              holder: str) -> tuple[NodeLink, dict[str, Any]] | str:
        """One node's agent, held: its new stream and what it says of itself; or why it is gone."""
        if not node.get("door"):
            return "it was lost before the pool was released"
        try:
            link = provider.reattach(node["node_id"], node["door"], REACH_SECONDS)
        except NodeGone as exc:
            return f"found gone while the pool was warm: {exc}"
        except Exception as exc:  # noqa: BLE001 - unreachable now is gone for this holder: replaced
            return f"could not be reached: {type(exc).__name__}: {exc}"
        try:
            attached = door_handshake(link, key, node.get("instance", ""), holder, "hold", 0, who_am_i(),
                                      time.monotonic() + HANDSHAKE_SECONDS)
        except Refused as exc:
            _let_go(link)
            if exc.holder:
                raise HeldElsewhere(exc.holder, exc.since) from None
            return str(exc)
        except Exception as exc:  # noqa: BLE001
            _let_go(link)
            return f"its door did not answer: {type(exc).__name__}: {exc}"
        link.address = node.get("address") or link.address
        return link, {**attached.get("state", {}), "door": node["door"], "instance": node.get("instance", "")}

    def expire(self, record: dict[str, Any], provider: NodeProvider, why: str) -> None:
        """The pool's nodes are gone: clear what is left of them and its record, quietly."""
        try:
            provider.stop()
        except Exception:  # noqa: BLE001 - what was left is the provider's gc's now
            pass
        self._forget(record)
        self.reporter.event(PoolExpired(self.name, why))

    def _forget(self, record: dict[str, Any]) -> None:
        current = self.store.load(self.name)
        if current is not None and current.get("pool_key") == record.get("pool_key") \
                and current.get("claimed_at") == record.get("claimed_at"):
            self.store.delete(self.name)  # not one that another process has made meanwhile

    # -- letting it go -----------------------------------------------------------------------

    def release(self, session: PoolSession, calls: int) -> None:
        """The ranks end, the agents stay for the next process; the record says where they are."""
        self.record["calls"] = int(self.record.get("calls", 0)) + calls
        try:
            record = self._refreshed(session)
        except Exception as exc:  # noqa: BLE001 - nodes nobody could find again must not stay up
            self.reporter.note(f"warm pool {self.name}: cannot be kept warm ({exc}); its nodes are ended",
                               level=logging.WARNING)
            session.close()
            self._forget(self.record)
            return
        try:
            self.store.save(self.name, record)  # before the agents are free: the next holder reads this
        except Exception as exc:  # noqa: BLE001 - the agents are released all the same: they end unheld
            self.reporter.note(f"warm pool {self.name}: its record could not be saved ({exc}); the next process "
                               f"may start it afresh", level=logging.WARNING)
        session.release()
        self.reporter.event(PoolReleased(self.name, sum(1 for n in record["nodes"] if n["door"]),
                                         self.spec.keep_warm_minutes, time.time() + self.spec.keep_warm_minutes * 60))

    def _refreshed(self, session: PoolSession) -> dict[str, Any]:
        nodes = [{"node_id": n.link.node_id, "address": n.link.address, "door": n.door if n.alive else "",
                  "instance": n.instance, "where": n.link.where} for n in session.nodes]
        self.record.update(nodes=nodes, handle=session.provider.handle(), released_at=time.time(), state="up")
        return dict(self.record)


def _keys(relay: PoolRelay) -> dict[str, str]:
    peers = relay.peers_message("")
    return {"pool_key": peers["secret"], "tls_cert": peers["cert"], "tls_key": peers["key"]}


def _let_go(link: NodeLink) -> None:
    try:
        link.let_go_lost()
    except Exception:  # noqa: BLE001
        pass


def _let_go_held(link: NodeLink) -> None:
    """A node taken and given back at once (another process holds the rest): RELEASE, then close."""
    try:
        FrameWriter(link.outbound).send(message(Op.RELEASE))
    except Exception:  # noqa: BLE001 - its stream closing frees it too
        pass
    _let_go(link)
