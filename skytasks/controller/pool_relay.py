"""The controller's part in a pool's relay tree (skytasks.node.peers): the pool's secret and TLS
key, handed to each agent in its PEERS message, and the tree's links opened ahead of the first
large call (LINKS).

Why ahead: opening a link is each agent's first use of TLS and a handshake per link, about 0.15 s
under load, which a pool's first large call would otherwise wait for. Only the controller knows
when a pool is large enough to relay and who its members are, so it sends the tree once every
member's listener is open, and again when the members change.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from skytasks.controller.channel import RELAY_TREE_NODES, NodeChannel
from skytasks.tls.pool_identity import PoolTLS, pool_tls
from skytasks.node.peers import relay_tree
from skytasks.protocol import Op, message
from skytasks.resume import RELAY_LABEL, subkey
from skytasks.event_bus import console_logger
from skytasks.settings import settings


TLS_OFF_WARNING = ("SKYTASKS_PEER_TLS=0: this pool's relay links between nodes run without TLS, so its "
                   "arguments cross the network in the clear and can be altered on the way; unset it "
                   "unless you are measuring what TLS costs")


class PoolRelay:
    """One pool start's relay keys: a fresh secret and (at the first PEERS) a fresh TLS key, never
    reused by another pool or a later start of this one. They live in this object's memory and the
    agents' for as long as the pool runs."""

    def __init__(self) -> None:
        if not settings().peer_tls:  # every pool start says so: it is never to be left on by mistake
            console_logger().warning(TLS_OFF_WARNING)
        self._secret = secrets.token_bytes(32)  # the peer challenge's: only the pool's agents know it
        self._tls: PoolTLS | None = None  # made at the first PEERS (tls/pool_identity.py)
        self._linked: tuple[tuple[str, int], ...] = ()  # the tree whose links the agents were told to open
        self._lock = threading.Lock()  # the tree sent last
        self._tls_lock = threading.Lock()

    @classmethod
    def from_stored(cls, secret: str, cert: str, key: str) -> PoolRelay:
        """The relay of a warm pool another process started (its stored key and TLS, hex and PEM):
        a node replaced now joins the same tree, with the same key at its door."""
        relay = cls()
        relay._secret = bytes.fromhex(secret)
        relay._tls = PoolTLS(cert, key) if cert else None
        return relay

    def peers_message(self, address: str) -> dict[str, Any]:
        """PEERS for the agent whose node peers reach at `address`: its relay listener opens there,
        TLS both ways for the pool's members only, with the key handed over the controller's own
        channel. Its PEER_READY sets the channel's peer_port; calls go straight until it has."""
        cert, key = self._credentials()
        return message(Op.PEERS, secret=subkey(self._secret, RELAY_LABEL).hex(), address=address, cert=cert, key=key)

    @property
    def key(self) -> str:
        """The pool's key (hex): the LEASE's and a warm record's; the relay gets its subkey only."""
        return self._secret.hex()

    def _credentials(self) -> tuple[str, str]:
        """The pool's TLS certificate and key, PEM; ("", "") with SKYTASKS_PEER_TLS=0 (measuring what
        TLS costs: the links then run in the clear)."""
        if not settings().peer_tls:
            return "", ""
        with self._tls_lock:
            if self._tls is None:
                self._tls = pool_tls()
            return self._tls.cert, self._tls.key

    def open_links(self, nodes: list[NodeChannel]) -> None:
        """LINKS down the tree of `nodes` (the session's list of members, in node order) once every
        one has a listener, unless it was sent for these members already. A node without a
        listener (an address not its own, behind NAT): calls go straight, and there is no tree.
        The members are read, and the tree sent, under one lock: an older tree never reaches
        node 0 after a newer one."""
        with self._lock:
            members = list(nodes)
            if len(members) < RELAY_TREE_NODES or not all(n.alive and n.peer_port for n in members):
                return
            peers = tuple((n.link.address, n.peer_port) for n in members)
            if peers == self._linked:
                return
            self._linked = peers
            members[0].send(message(Op.LINKS, children=relay_tree(list(peers))))
