"""Node to node: a large call relayed down a tree of agents, so it leaves the controller once.

At 128 nodes a 100 MB argument sent to every node by the controller is 12.8 GB through the
controller's one link. Instead the controller sends it to the first node with a ROUTE (the tree
below it), and each agent streams the frame on, as it arrives, to its ranks and to its children
in the tree over a link of their own (cut-through: no agent holds the frame whole). The links are
TLS, both ends proving the pool's key (peer_links.py, tls_link.py).

Once every node's listener is open the controller sends the tree down it (LINKS), and each agent
opens the links to its children then, side by side, usually long before the pool's first large
call. A call that comes sooner waits for the handshakes under way rather than making its own,
and a link that is missing at a call (a node replaced since, a child that did not answer) is
opened then.

Standard library only, like the rest of the node side.
"""

from __future__ import annotations

import io
import itertools
import sys
import threading
from typing import Any, Callable, Protocol, Sequence

from skytasks.node.peer_links import PeerLinks, PeerListener
from skytasks.node.relay import read_meta, relay_frame
from skytasks.node.tls_link import PeerTLS
from skytasks.protocol import Op, check, message
from skytasks.wire import (HEADER, LENGTH, MAX_BUFFERS, MAX_META, RELAY, ChannelClosed, FrameWriter, Readable, read_body,
                           read_exact)

SPAWN_WAIT_SECONDS = 60.0  # a CALL that came down the tree waits this long for its group's SPAWN


def relay_tree(peers: list[tuple[str, int]], fan_out: int = 2) -> list[dict[str, Any]]:
    """The relay tree below the first of `peers` ((address, port) pairs, in node order), as the
    ROUTE's children: each node sends to `fan_out` others (heap order), so 128 nodes are 7 hops."""

    def below(j: int) -> list[dict[str, Any]]:
        return [{"address": peers[c][0], "port": peers[c][1], "children": below(c)}
                for c in range(fan_out * j + 1, min(fan_out * j + 1 + fan_out, len(peers)))]

    return below(0)


MAX_TREE_DEPTH = 64  # a controller's tree of 2 children a node is 7 deep at 128 nodes


def check_tree(children: Any) -> None:
    """A relay tree as a peer sent it (the children of its ROUTE or LINKS): each child an
    address, a port and its own children, nothing else, and each peer in it once; ValueError
    naming what is wrong. Each child is looked at once: a pickle may make branches share a child
    (or hold themselves), which a walk of the branches would visit exponentially often, and
    which a tree never does."""
    seen: set[tuple[str, int]] = set()
    level, depth = [children], 0
    while level:
        if depth > MAX_TREE_DEPTH:
            raise ValueError(f"a relay tree deeper than {MAX_TREE_DEPTH} levels")
        below = []
        for kids in level:
            if type(kids) is not list:
                raise ValueError(f"a relay tree's children are a list, not {type(kids).__name__}")
            for child in kids:
                if type(child) is not dict or set(child) != {"address", "port", "children"}:
                    raise ValueError(f"a relay tree's child is address, port and children, not {str(child)[:80]}")
                address, port = child["address"], child["port"]
                if type(address) is not str or type(port) is not int or not 0 < port < 65536:
                    raise ValueError(f"a relay tree's child names an address (text) and a port (1-65535), "
                                     f"not {address!r:.40} and {port!r:.10}")
                if (address, port) in seen:
                    raise ValueError(f"a relay tree names {address}:{port} twice (shared branches, or a cycle)")
                seen.add((address, port))
                below.append(child["children"])
        level, depth = below, depth + 1


class Refused(ValueError):
    """A peer's frame refused before any of it reached this node's ranks."""


def allow_call(meta: Any, count: int) -> None:
    """`relay_frame`'s check of a frame a peer relays: a CALL, well formed (its out-of-band
    buffers stand in as empty bytes: they are streamed on, never read here); Refused otherwise."""
    try:
        msg = read_body(io.BytesIO(bytes(meta) + LENGTH.pack(0) * count), len(meta), count)
        check(msg)
    except (ChannelClosed, ValueError) as exc:
        raise Refused(f"a relayed frame that is not a CALL: {exc}") from None
    if msg["op"] != Op.CALL:
        raise Refused(f"a peer relays CALL frames only, not {msg['op']!r}")


class LocalRank(Protocol):
    """A rank of this node as the relay sees it (a `RankProcess`)."""

    to_rank: FrameWriter  # its pipe: the frames it reads between calls

    def hand_fd(self, token: int, fd: int) -> bool:
        """Give the rank `fd`, named `token`, beside its pipe; False if it could not be given."""
        ...


_tokens = itertools.count(1)


def hand_over_to(ranks: Sequence[LocalRank]) -> Callable[[int], int | None]:
    """`relay_frame`'s hand_over for these ranks: the memory file to each of them, one token for
    all; None (the bytes go inline) if a rank that is still there could not take it."""

    def hand_over(fd: int) -> int | None:
        token = next(_tokens)
        return token if all(rank.hand_fd(token, fd) for rank in ranks) else None  # past a refusal: inline, no more fds

    return hand_over


def why_broken(exc: BaseException) -> str:
    """A peer link that broke in the middle of a frame, in words."""
    import ssl

    if isinstance(exc, ssl.SSLError):
        return (f"a frame from its parent in the relay tree failed TLS's integrity check, so the link was cut "
                f"(the bytes were altered on the way, or the link is faulty): {exc}")
    return f"the link from its parent in the relay tree broke in the middle of a frame: {exc}"


def _say(reason: str) -> None:
    print(f"skytasks agent: {reason}", file=sys.stderr, flush=True)


class RelayNode:
    """An agent's part in the relay tree: its listener for its parent, its connections to its
    children, and the streaming of a CALL frame to its ranks and on down the tree.
    `broken(reason)` hears a peer link that broke in the middle of a frame: this node's ranks then
    hold part of a call, so the agent fails them and says why (AGENT_ERROR: a lost node).
    `refused(reason)` hears a peer's frame refused before any of it reached the ranks (a peer has
    the pool's key, but its frames are checked all the same): the link is cut, the ranks run on."""

    def __init__(self, ranks_of: Callable[[int | None, float], Sequence[LocalRank]],
                 broken: Callable[[str], None] = _say, refused: Callable[[str], None] = _say):
        self._ranks_of = ranks_of  # (group, wait) -> that group's ranks here
        self._broken, self._refused = broken, refused
        self._listener: PeerListener | None = None
        self._links: PeerLinks | None = None
        self._secret = b""  # the key the listener and links were opened with

    def open(self, secret: bytes, address: str, tls: PeerTLS | None = None) -> int:
        """Listen for this node's parent; the port. A new key (a warm pool's next holder sends
        one) opens a new listener and new links on it, and the old listener closes: the old key
        is refused from then on."""
        if self._listener is not None and self._secret == secret:
            return self._listener.port
        if self._listener is not None:
            self._listener.close()
        self._secret = secret
        self._links = PeerLinks(secret, tls)
        self._listener = PeerListener(address, secret, self.serve_peer, tls)
        return self._listener.port

    def open_links(self, children: list[dict[str, Any]]) -> None:
        """LINKS: open the links to this node's children now, and hand each its part of the tree
        to do the same, so the pool's first large call waits for no handshake. On a thread of its
        own: the stream it came on goes on being read. A link that cannot be opened now is left
        to the call that needs it, which tries again and says why it failed."""
        if self._links is None or not children:
            return
        threading.Thread(target=self._open_links, args=(self._links, children), daemon=True,
                         name="skytasks-links").start()

    @staticmethod
    def _open_links(links: PeerLinks, children: list[dict[str, Any]]) -> None:
        try:
            failed = links.open_all([(child["address"], child["port"]) for child in children])
            for child in children:
                peer = (child["address"], child["port"])
                if peer in failed:
                    continue
                writer = None
                try:
                    writer = links.writer(*peer)  # opened above, or here if it was the only one
                    if child["children"]:
                        writer.send(message(Op.LINKS, children=child["children"]))
                except ChannelClosed:
                    if writer is not None:
                        links.forget(*peer, writer)
        except Exception as exc:  # noqa: BLE001 - a link not opened now is opened by the call that needs it
            _say(f"the relay links were not opened ahead: {exc}")

    def serve_peer(self, stream: Readable) -> None:
        """Frames from the parent: LINKS, and a ROUTE then the CALL frame it announces. The parent
        closing the link between frames is no news (the controller hears of a lost node on its
        own). A frame refused before any of it reached the ranks (a frame past the size caps, a
        malformed tree, a relayed frame with no ROUTE before it or that is no CALL, any other op)
        cuts the link, said (`refused`); the link breaking inside a frame is `broken`."""
        route: dict[str, Any] | None = None
        while True:
            try:
                meta_len, count, flags = header = HEADER.unpack(read_exact(stream, HEADER.size))
            except ChannelClosed:
                return
            except Exception as exc:  # noqa: BLE001 - ssl.SSLError and the like: the link is not to be trusted
                self._broken(why_broken(exc))
                return
            try:
                if meta_len > MAX_META or count > MAX_BUFFERS:
                    raise Refused(f"a frame of {meta_len} bytes and {count} buffers, past the caps")
                if flags & RELAY:
                    if route is None:  # the controller's own calls come straight, never from a peer
                        raise Refused("a relayed frame with no ROUTE before it")
                    self.relay_call(stream, header, route, allow=allow_call)
                    route = None
                    continue
                msg = read_body(stream, *header)
                if msg.get("op") not in (Op.ROUTE, Op.LINKS):
                    raise Refused(f"a peer may send LINKS, ROUTE and CALL frames only, not {msg.get('op')!r:.40}")
                check(msg)
                check_tree(msg["children"])
                if msg["op"] == Op.LINKS:
                    self.open_links(msg["children"])
                else:
                    route = msg
            except Exception as exc:  # noqa: BLE001 - whatever it was, the link is done
                if isinstance(exc, Refused) or not flags & RELAY and isinstance(exc, (ValueError, ChannelClosed)):
                    self._refused(f"a frame from a peer was refused and its link cut: {exc}")
                else:  # the ranks may hold part of a frame
                    self._broken(why_broken(exc))
                return

    def relay_call(self, stream: Readable, header: tuple[int, int, int], route: dict[str, Any] | None,
                   allow: Callable[[Any, int], None] | None = None) -> None:
        """Stream one CALL frame, as it arrives, to this node's ranks and (with a ROUTE) to its
        children, each told its own part of the tree first. A child whose frame could not be
        finished is let go: its link is closed, so it hears its frame broke off. `allow(meta,
        count)` may refuse the frame (Refused) by its own pickle before anything of it is sent on
        or waited for: a peer's frames are checked so; the controller's are its own."""
        meta = read_meta(stream, header)
        if allow is not None:  # before anything is sent on, or waited for
            allow(meta, header[1])
        if route is None:  # straight from the controller, as every call on a small pool
            self._to_ranks(stream, header, meta, self._ranks_of(None, 0.0))
            return
        onward: list[FrameWriter] = []
        children: list[tuple[tuple[str, int], FrameWriter]] = []
        assert self._links is not None, "a ROUTE before PEERS"
        failed = self._links.open_all([(child["address"], child["port"]) for child in route["children"]])
        for child in route["children"]:
            peer = (child["address"], child["port"])
            announce = message(Op.ROUTE, group=route["group"], children=child["children"])
            for last_try in (False, True):  # a kept link the child has since cut (a broken frame): once more, anew
                writer = None
                try:
                    if not last_try and peer in failed:
                        raise failed[peer]  # that was its first try
                    writer = self._links.writer(*peer)
                    writer.send(announce)
                    onward.append(writer)
                    children.append((peer, writer))
                    break
                except ChannelClosed as exc:  # the controller hears of that node's loss on its own
                    if writer is not None:
                        self._links.forget(*peer, writer)
                    if last_try:
                        _say(f"relay to {child['address']}: {exc}")
        try:
            self._to_ranks(stream, header, meta, self._ranks_of(route["group"], SPAWN_WAIT_SECONDS), onward)
        except BaseException:
            for peer, writer in children:
                self._links.forget(*peer, writer)
            raise

    @staticmethod
    def _to_ranks(stream: Readable, header: tuple[int, int, int], meta: Any, ranks: Sequence[LocalRank],
                  onward: list[FrameWriter] | None = None) -> None:
        relay_frame(stream, header, [r.to_rank for r in ranks], onward=onward or (), hand_over=hand_over_to(ranks),
                    meta=meta)
