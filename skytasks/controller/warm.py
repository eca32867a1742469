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

**The record** (`WarmStore`: skytasks/controller/warm_claim.py, kept as Prefect secrets) holds the
pool's key and TLS key, the nodes' doors and the provider's handle. Its writes are generations
(compare-and-set): a process that lost the pool writes nothing, and ends nothing. A new holder
writes a fresh key into the record's next generation, then hands it to every agent (LEASE, PEERS):
the key a past holder or an old record knows reaches no rank. Only the provider's definite word
(`PoolGone`, or every node's `NodeGone`) ends a pool found idle; anything else is asked again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Callable

from skytasks.controller.pool_relay import PoolRelay
from skytasks.controller.session import PoolSession
from skytasks.controller.warm_claim import (ASK_AGAIN, HELD_BACKOFF, NODE_GONE, POOL_GONE, RECORD_VERSION, STARTING,
                                            UNREAD, UNREAD_BACKOFF, UP, Backoff, ClaimKeeper, ClaimWatch, NodeTries,
                                            WarmStore, tombstone, verdict)
from skytasks.controller.warm_nodes import (REACH_SECONDS, HeldElsewhere, Unread, ask_first_node, give_back, hold,
                                            leave, who_am_i)
from skytasks.errors import PoolConfigError, PoolGone, PoolStartError
from skytasks.event_bus import PoolReporter
from skytasks.events import PoolAttached, PoolExpired, PoolReleased
from skytasks.pool_spec import PoolSpec
from skytasks.providers import NodeLink, NodeProvider

__all__ = ["REACH_SECONDS", "WarmPool", "WarmStore", "spec_digest", "who_am_i"]

DEFAULT_WAIT_SECONDS = 900.0  # ready_timeout_seconds' default, for providers that have no such field


def spec_digest(spec: PoolSpec) -> str:
    """The pool's shape and settings as a hash: nodes of another shape are not attached to."""
    shape = [spec.provider, spec.nodes, spec.min_nodes, spec.procs_per_node, spec.accelerators_per_node,
             sorted(spec.env.items()), repr(spec.part)]
    return hashlib.sha256(json.dumps(shape, default=str).encode()).hexdigest()[:16]


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
        self.generation = 0  # the record's generation this process read or wrote last
        self.attached = False

    # -- taking the pool ---------------------------------------------------------------------

    def open(self) -> PoolSession:
        """The pool's nodes, held by this process: attached when warm, else started; waits in line
        while another process holds them, up to ready_timeout_seconds (then PoolStartError)."""
        deadline = time.monotonic() + wait_limit(self.spec)
        while True:
            session = self._take(deadline)
            if session is None:
                started = self._claim_and_start()
                if started is not None:
                    return started
                continue  # another process claimed it first: wait for it in line
            if self.record.get("digest") != spec_digest(self.spec):
                self.reporter.note(f"warm pool {self.name}'s nodes were of another shape: ending them, starting afresh")
                session.close()
                self._forget()
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
            self._forget()
        return True

    def probe(self) -> dict[str, Any] | None:
        """What the pool's first node that answers says of it (`skytasks pools`; mode "probe":
        nothing is taken): its record's fields, with `holder`, `unheld_since`, `expires_at` where
        the agent says them; None when it has no record. Only reads: a pool whose nodes are
        found gone is said so (`ended`), and the next process that uses it clears its record; one
        that cannot be asked now is said so, never taken for gone."""
        _, record = self.store.newest(self.name)
        if record is None or record.get("state") == STARTING:
            return record
        provider = self.make_provider()
        try:
            provider.adopt(record.get("handle") or {})
        except PoolGone as exc:
            return {**record, "ended": str(exc)}
        except PoolConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - not the provider's word that it is gone
            return {**record, "holder": f"(cannot be asked now: {type(exc).__name__}: {exc})"}
        try:
            return ask_first_node(provider, record)
        finally:
            leave(provider)

    def _take(self, deadline: float) -> PoolSession | None:
        """The pool's running nodes, held by this process (waiting in line for them); None when
        it has none: no record, or they had all ended (then its record is a tombstone)."""
        held_wait, unread_wait, claim = Backoff(*HELD_BACKOFF), Backoff(*UNREAD_BACKOFF), ClaimWatch()
        unread_since: float | None = None
        while True:
            self.generation, record = self.store.newest(self.name)
            if record is None:
                return None
            if record.get("state") == STARTING:
                if claim.abandoned(self.generation, time.monotonic()):
                    self._forget()  # its starter stopped rewriting it: it died before saving the pool
                    continue
                self._wait(record.get("who", "another process"), record.get("claimed_at"), deadline, "started",
                           held_wait)
                continue
            try:
                session = self._attach(record, unread_since)
            except HeldElsewhere as held:
                unread_since = None
                self._wait(held.holder, held.since, deadline, "held", held_wait)
                continue
            except Unread as exc:
                held_some = bool(exc.args[1]) if len(exc.args) > 1 else False
                unread_since = (unread_since or time.monotonic()) if held_some else None
                self._unread(str(exc.args[0]), deadline, unread_wait)
                continue
            if session is not None:
                return session

    def _wait(self, who: str, since: Any, deadline: float, how: str, backoff: Backoff) -> None:
        when = time.strftime("%H:%M:%S", time.localtime(float(since))) if since else "a moment ago"
        if time.monotonic() > deadline:
            raise PoolStartError(f"warm pool {self.name} is {how} by {who} (since {when}); waited "
                                 f"{wait_limit(self.spec):g}s (ready_timeout_seconds) for it")
        self.reporter.progress(0, self.spec.nodes, f"waiting for warm pool {self.name}, {how} by {who} since {when}")
        time.sleep(min(backoff.wait(), max(0.0, deadline - time.monotonic()) + 0.05))

    def _unread(self, why: str, deadline: float, backoff: Backoff) -> None:
        if time.monotonic() > deadline:
            raise PoolStartError(f"warm pool {self.name}: could not tell whether its nodes still run ({why}); asked "
                                 f"again for {wait_limit(self.spec):g}s (ready_timeout_seconds); nothing was ended")
        self.reporter.note(f"warm pool {self.name}: {why}; not taken for gone, asking again", level=logging.WARNING)
        time.sleep(min(backoff.wait(), max(0.0, deadline - time.monotonic()) + 0.05))

    def _claim_and_start(self) -> PoolSession | None:
        """Start the pool under a claim (its "starting" placeholder, rewritten while it starts);
        None when another process claimed it first, or took this claim for abandoned."""
        placeholder = {"version": RECORD_VERSION, "pool": self.name, "state": STARTING, "who": who_am_i(),
                       "claimed_at": time.time(), "beat": 0}
        if not self.store.write(self.name, placeholder, self.generation):
            return None
        keeper = ClaimKeeper(self.store, self.name, placeholder, self.generation + 1).start()
        try:
            session = self._build(self.make_provider(), None).start()
        except BaseException:
            mine = keeper.stop()
            if mine is not None:
                self._write(tombstone(self.name), mine)
            raise
        mine = keeper.stop()
        if mine is None:  # taken for abandoned while it started: these nodes are nobody's but ours
            self.reporter.note(f"warm pool {self.name}: its claim was taken while it started; ending what it started",
                               level=logging.WARNING)
            session.close()
            return None
        self.generation = mine
        self.record = {"version": RECORD_VERSION, "pool": self.name, "state": UP, "provider": self.spec.provider,
                       "digest": spec_digest(self.spec), "up_since": time.time(), "calls": 0,
                       "keep_warm_minutes": self.spec.keep_warm_minutes, **_keys(session.relay)}
        try:  # e.g. a provider that cannot keep these nodes warm says so here: nothing is left running
            written = self._write(self._refreshed(session), self.generation)
        except BaseException:
            session.close()
            self._forget()
            raise
        if not written:
            session.close()
            return None
        self.generation += 1
        return session

    def _attach(self, record: dict[str, Any], unread_since: float | None) -> PoolSession | None:
        """Hold every node of the record, in node-id order, then give the pool a fresh key; None
        when none runs any more (the pool is then expired). HeldElsewhere, or Unread when the
        provider or some nodes could not be read (nothing is ended then)."""
        provider = self.make_provider()
        try:
            provider.adopt(record.get("handle") or {})
        except PoolGone as exc:
            self.expire(provider, str(exc))
            return None
        except PoolConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed read is not the provider's word that it is gone
            leave(provider)
            raise Unread(f"the provider could not be read: {type(exc).__name__}: {exc}", False) from None
        session = self._build(provider, PoolRelay())  # the pool's next key: the agents get it once held
        held: list[tuple[NodeLink, dict[str, Any]]] = []
        gone: list[tuple[int, str, str]] = []
        unread: list[tuple[int, str, str]] = []
        try:
            for node in sorted(record.get("nodes", []), key=lambda n: n["node_id"]):
                kind, taken = hold(provider, node, bytes.fromhex(record["pool_key"]), session.holder)
                if kind == NODE_GONE or kind == UNREAD:
                    (gone if kind == NODE_GONE else unread).append((node["node_id"], node.get("address", ""), taken))
                else:
                    held.append(taken)
        except HeldElsewhere:
            give_back(held, provider)
            raise
        decision = verdict(NodeTries(len(held), len(gone), len(unread)), unread_since, time.monotonic(),
                           max(self.spec.reattach_seconds, 10.0))
        if decision == ASK_AGAIN:
            give_back(held, provider)
            raise Unread(f"node {unread[0][0]} ({unread[0][1]}) {unread[0][2]}", bool(held))
        if decision == POOL_GONE:
            self.expire(provider, "none of its nodes runs any more")
            return None
        fresh = {**{k: v for k, v in record.items() if k != "generation"}, **_keys(session.relay), "state": UP}
        if not self._write(fresh, self.generation):  # the record moved on as we took the nodes: read it again
            give_back(held, provider)
            raise HeldElsewhere("the process that just wrote the pool's record", time.time())
        self.generation += 1
        self.record = fresh
        return session.adopt(held, gone, unread)

    def expire(self, provider: NodeProvider, why: str) -> None:
        """The provider said the pool's nodes are gone: its record becomes a tombstone (only if
        nobody wrote it since it was read), then what is left of the nodes is cleared, quietly."""
        if not self._forget():
            leave(provider)
            return
        try:
            provider.stop()
        except Exception:  # noqa: BLE001 - what was left is the provider's gc's now
            pass
        self.reporter.event(PoolExpired(self.name, why))

    def _forget(self) -> bool:
        """The record's next generation is a tombstone; False when another process wrote first."""
        written = self._write(tombstone(self.name), self.generation)
        if written:
            self.generation += 1
        return written

    def _write(self, record: dict[str, Any], after: int) -> bool:
        return self.store.write(self.name, record, after)

    # -- letting it go -----------------------------------------------------------------------

    def release(self, session: PoolSession, calls: int) -> None:
        """The ranks end, the agents stay for the next process; the record says where they are.
        A process that lost the pool meanwhile writes nothing and ends nothing: it lets go of
        the streams it still has, and the nodes are their new holder's."""
        if session.evicted_by:
            self.reporter.note(f"warm pool {self.name} was taken over by {session.evicted_by}: this process leaves "
                               f"it to them", level=logging.WARNING)
            session.release()
            return
        self.record["calls"] = int(self.record.get("calls", 0)) + calls
        try:
            record = self._refreshed(session)
        except Exception as exc:  # noqa: BLE001 - nodes nobody could find again must not stay up
            self.reporter.note(f"warm pool {self.name}: cannot be kept warm ({exc}); its nodes are ended",
                               level=logging.WARNING)
            if self._forget():
                session.close()
            else:
                session.release()
            return
        try:
            written = self._write(record, self.generation)  # before the agents are free: the next holder reads this
        except Exception as exc:  # noqa: BLE001 - the agents are released all the same: they end unheld
            self.reporter.note(f"warm pool {self.name}: its record could not be saved ({exc}); the next process "
                               f"may start it afresh", level=logging.WARNING)
            written = True
        if not written:
            self.reporter.note(f"warm pool {self.name}: another process wrote its record since this one took it; "
                               f"it is theirs, and this process leaves it as it is", level=logging.WARNING)
            session.release()
            return
        self.generation += 1
        session.release()
        self.reporter.event(PoolReleased(self.name, sum(1 for n in record["nodes"] if n["door"]),
                                         self.spec.keep_warm_minutes, time.time() + self.spec.keep_warm_minutes * 60))

    def _refreshed(self, session: PoolSession) -> dict[str, Any]:
        # A node this process lost may still run (only its stream was lost): its door stays in
        # the record unless its provider said it is gone.
        nodes = [{"node_id": n.link.node_id, "address": n.link.address,
                  "door": n.door if (n.alive or not getattr(n, "gone_for_sure", False)) else "",
                  "instance": n.instance, "where": n.link.where} for n in session.nodes]
        self.record.update(nodes=nodes, handle=session.provider.handle(), released_at=time.time(), state=UP)
        return dict(self.record)


def _keys(relay: PoolRelay) -> dict[str, str]:
    peers = relay.peers_message("")
    return {"pool_key": relay.key, "tls_cert": peers["cert"], "tls_key": peers["key"]}

