"""A node whose stream broke is reached again: a new stream to the same, running agent.

Once an agent holds a LEASE (controller/session.py sends one where the provider `reattaches` and
`reattach_seconds` > 0), a closed or silent stream no longer means a lost node: the agent keeps its
ranks and what they send, and the controller asks the provider for a new stream through the
agent's door (`NodeProvider.reattach`), proves the pool's key in the door's handshake (CHALLENGE,
ATTACH, ATTACHED: `skytasks.resume`), and each side resends what the other has not read. The
frames, the parser that was cut mid-frame and the running call never notice (design 52, B.4).

`ResumableOut` is the controller's writing end of such a stream; `Reconnector` the thread that
brings a broken one back, or gives the node up as lost (`NodeChannel.mark_lost`, the only place a
node becomes lost) when the provider says it is gone or `reattach_seconds` pass.
"""

from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from skytasks.errors import NodeGone
from skytasks.protocol import Op, check, message
from skytasks.resume import Outbox, agent_proof, controller_proof, new_nonce, proof_matches
from skytasks.wire import ChannelClosed, FrameWriter, read_frame

if TYPE_CHECKING:
    from skytasks.providers import NodeLink, NodeProvider


class BrokenChannel(Protocol):
    """What re-attaching needs of a node's channel (`channel.NodeChannel` is one): its link, the
    agent's door and instance from its hello, the bytes read from it, and the two ways out."""

    link: NodeLink
    alive: bool
    door: str
    instance: str
    got: int

    def mark_lost(self, reason: str) -> None: ...

    def swap(self, link: NodeLink, agent_got: int, down_seconds: float) -> bool: ...


HANDSHAKE_SECONDS = 10.0  # the most one door handshake may take (the agent's own bound is the same)
ATTEMPT_SECONDS = 15.0  # the most one `reattach` is given
BACKOFF_FIRST, BACKOFF_MOST = 0.25, 5.0


@dataclass(frozen=True)
class Lease:
    """What the controller told an agent in its LEASE, and what it needs to attach to it again."""

    provider: NodeProvider
    key: bytes  # the pool's key (the relay's secret)
    holder: str  # this session's id
    seconds: float  # reattach_seconds


class ResumableOut:
    """The controller's writing end of a node's stream, under `wire.FrameWriter`: every byte is
    counted, and once the agent holds a lease, kept until the agent says it read it, so a new
    transport can carry on from where the agent's reading stopped.

    Before a lease it is the plain stream it wraps: a failed write raises, as it always did. After
    one, a failed write is a break (`on_break`): the bytes stay kept and the writer goes on; while
    the stream is broken, writes only keep their bytes."""

    def __init__(self, stream: Any, on_break: Callable[[str], None]):
        self._stream: Any = stream  # the current transport; None while broken
        self._on_break = on_break
        self.outbox = Outbox()
        self.keeping = False  # set just before the LEASE is sent: from it on, bytes are kept
        self._lock = threading.Lock()  # a frame's bytes, and a replay, go whole onto one transport
        self._transports = 0  # how many times the stream was resumed: a late failure of an older one is no news

    def writelines(self, chunks: list[Any]) -> None:
        broken = ""
        with self._lock:
            self.outbox.append(chunks)
            if not self.keeping:
                self.outbox.ack(self.outbox.sent)  # no lease: nothing can be sent again, keep nothing
            stream, transport = self._stream, self._transports
            if stream is None:
                return
            try:
                stream.writelines(chunks)
                stream.flush()
            except (OSError, ValueError) as exc:
                if not self.keeping:
                    raise
                self._stream, broken = None, str(exc) or type(exc).__name__
        if broken and transport == self._transports:
            self._on_break(f"a write to the node failed: {broken}")

    def write(self, chunk: Any) -> None:
        self.writelines([chunk])

    def flush(self) -> None:
        """Each write is flushed as it goes (under the lock that keeps a frame whole)."""

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def detach(self) -> None:
        """The transport broke: write nothing more to it (a writer stuck on it lets go when its
        transport is closed); what is written meanwhile is kept for the next one."""
        self._stream = None

    def resume(self, stream: Any, agent_got: int) -> None:
        """Carry on over `stream`: what the agent did not read (from `agent_got` on) first."""
        with self._lock:
            self.outbox.ack(agent_got)  # ValueError: it claims bytes never sent
            stream.writelines(self.outbox.since(agent_got))
            stream.flush()
            self._stream = stream
            self._transports += 1


class _TimedReader:
    """Reads a new transport's descriptor with a deadline, never past what a frame asks for: the
    bytes after the handshake are the resumed stream, read by the reactor."""

    def __init__(self, stream: Any, deadline: float):
        self._fd, self._deadline = stream.fileno(), deadline

    def readinto(self, buffer: Any) -> int:
        while True:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the agent's door did not answer in time")
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            if not poller.poll(min(left, 1.0) * 1000):
                continue
            try:
                return os.readv(self._fd, [buffer])
            except BlockingIOError:
                continue


class Reconnector:
    """One broken stream brought back, on a thread of its own: `provider.reattach` with backoff
    until `reattach_seconds` from the break, then the door's handshake, then the channel's swap."""

    def __init__(self, channel: BrokenChannel, lease: Lease, why: str, broke_at: float):
        self.channel, self.lease, self.why, self.broke_at = channel, lease, why, broke_at
        self.deadline = broke_at + lease.seconds

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name=f"skytasks-reattach{self.channel.link.node_id}").start()

    def _run(self) -> None:
        try:
            self._reach_again()
        except BaseException as exc:  # a bug here must not leave the node out of reach for ever
            self.channel.mark_lost(f"{self.why}; re-attaching failed: {type(exc).__name__}: {exc}")
            raise

    def _reach_again(self) -> None:
        channel, backoff, last = self.channel, BACKOFF_FIRST, ""
        try:
            channel.link.let_go_lost()  # the old transport: unblocks a writer stuck on it
        except Exception:  # noqa: BLE001 - it is being left behind either way
            pass
        if self.lease.seconds <= 0:  # a lease for keeping warm only (local): a break is a loss, as always
            channel.mark_lost(self.why)
            return
        while channel.alive:
            left = self.deadline - time.monotonic()
            if left <= 0:
                break
            try:
                link = self.lease.provider.reattach(channel.link.node_id, channel.door, min(ATTEMPT_SECONDS, left))
            except NodeGone as exc:
                setattr(channel, "gone_for_sure", True)  # the provider's word: a warm record drops its door
                channel.mark_lost(f"{self.why}; the node is gone: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - any other failure: try again until the deadline
                last = f"{type(exc).__name__}: {exc}"
            else:
                try:
                    agent_got = self._handshake(link)
                except _Refused as exc:
                    _let_go(link)
                    if exc.holder and exc.holder != self.lease.holder:
                        # Another process holds the pool now (a warm pool, taken over while we
                        # were away): this process must not mend the node, which is theirs.
                        setattr(channel, "evicted_by", exc.holder)
                        channel.mark_lost(f"{self.why}; the pool was taken over by {exc.holder}")
                        return
                    channel.mark_lost(f"{self.why}; {exc}")
                    return
                except Exception as exc:  # noqa: BLE001 - a door that did not answer: try again
                    _let_go(link)
                    last = f"{type(exc).__name__}: {exc}"
                else:
                    if channel.swap(link, agent_got, time.monotonic() - self.broke_at):
                        return
                    _let_go(link)  # retired meanwhile, or the replay failed: nothing to attach to
                    if not channel.alive:
                        return
                    last = "the resumed stream failed as it started"
            time.sleep(max(0.0, min(backoff, self.deadline - time.monotonic())))
            backoff = min(backoff * 2, BACKOFF_MOST)
        tried = f" (last try: {last})" if last else ""
        channel.mark_lost(f"{self.why}; not reached again within reattach_seconds={self.lease.seconds:g}{tried}")

    def _handshake(self, link: NodeLink) -> int:
        """The door's handshake in mode "resume": the agent's count of what it read from us
        (where our resend starts)."""
        deadline = min(self.deadline, time.monotonic() + HANDSHAKE_SECONDS)
        attached = door_handshake(link, self.lease.key, self.channel.instance, self.lease.holder, "resume",
                                  self.channel.got, f"controller pid {os.getpid()}", deadline)
        return attached["got"]


def door_handshake(link: NodeLink, key: bytes, instance: str, holder: str, mode: str, got: int, who: str,
                   deadline: float) -> dict[str, Any]:
    """CHALLENGE, ATTACH, ATTACHED on a new transport to an agent's door: both sides prove the
    pool's key (it never crosses). ATTACHED, once the agent proved it; `_Refused` (with the
    holder, when the agent names one) when the door answers but will not take us."""
    reader = _TimedReader(link.inbound, deadline)
    challenge = _expect(read_frame(reader), Op.CHALLENGE)
    if instance and challenge["instance"] != instance:
        raise _Refused("another agent answers at the node's door (its agent was restarted)", restarted=True)
    nonce = new_nonce()
    proof = controller_proof(key, challenge["nonce"], nonce, holder, mode, got)
    FrameWriter(link.outbound).send(message(Op.ATTACH, proof=proof, nonce=nonce, holder=holder, mode=mode, got=got,
                                            who=who))
    answer = read_frame(reader)
    if answer.get("op") == Op.REFUSED:
        check(answer)
        raise _Refused(f"the agent refused the {'re-attach' if mode == 'resume' else mode}: {answer['reason']}",
                       answer.get("holder", ""), answer.get("since"))
    attached = _expect(answer, Op.ATTACHED)
    if not proof_matches(agent_proof(key, nonce, challenge["nonce"], attached["got"]), attached["proof"]):
        raise _Refused("the agent at the node's door could not prove the pool's key")
    return attached


class _Refused(Exception):
    """The node's door answered, but not as the node's own agent for this pool, or it is held by
    another controller (`holder`, since `since`): no use trying again now."""

    def __init__(self, reason: str, holder: str = "", since: float | None = None, restarted: bool = False):
        super().__init__(reason)
        self.holder, self.since = holder, since
        self.restarted = restarted  # not the agent the record names: that one is gone for sure


Refused = _Refused  # what warm.py catches


def _expect(msg: dict[str, Any], op: Op) -> dict[str, Any]:
    check(msg)
    if msg["op"] != op:
        raise ChannelClosed(f"the agent's door said {msg['op']}, not {op}")
    return msg


def _let_go(link: NodeLink) -> None:
    try:
        link.let_go_lost()
    except Exception:  # noqa: BLE001 - a transport that failed to attach is left behind either way
        pass
