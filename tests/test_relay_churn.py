"""A churn of new connections to a relay listener does not shed the pool's members' handshakes
(issue 58): each address holds few pending handshakes until a peer proves itself from it, and a
newcomer from an address a peer proved itself from goes before strangers.

Strangers connect from other loopback addresses (127.0.0.2, ...) than the members (127.0.0.1), as
other machines on the peers' network would, faster than the listener's slots age into stalls.
"""

from __future__ import annotations

import socket
import threading
import time

from skytasks.node.peer_links import PENDING_HANDSHAKES, PENDING_PER_ADDRESS, PeerListener, connect
from skytasks.protocol import Op, message
from skytasks.wire import ChannelClosed, read_frame

SECRET = b"k" * 32


class Churn:
    """New connections from `addresses`, round robin, as fast as they go; each left open (sending
    nothing) for a few seconds unless the listener closes it first."""

    def __init__(self, port: int, addresses: list[str]):
        self.port, self.addresses, self.opened = port, addresses, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Churn:
        self._thread.start()
        deadline = time.monotonic() + 10
        while self.opened < 3 * PENDING_HANDSHAKES and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        held: list[tuple[float, socket.socket]] = []
        i = 0
        while not self._stop.is_set():
            s = socket.socket()
            try:
                s.bind((self.addresses[i % len(self.addresses)], 0))
                s.settimeout(2)
                s.connect(("127.0.0.1", self.port))
                held.append((time.monotonic(), s))
                self.opened += 1
            except OSError:
                s.close()
            i += 1
            while held and time.monotonic() - held[0][0] > 3:
                held.pop(0)[1].close()
            time.sleep(0.002)
        for _, s in held:
            s.close()


def _member_gets_through(listener_port: int, heard: list) -> bool:
    before = len(heard)
    try:
        writer = connect("127.0.0.1", listener_port, SECRET, timeout=5)
    except ChannelClosed:
        return False
    writer.send(message(Op.HEARTBEAT))
    writer.close()
    deadline = time.monotonic() + 5
    while len(heard) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(heard) > before


def _listener() -> tuple[PeerListener, list]:
    heard: list = []
    return PeerListener("127.0.0.1", SECRET, lambda stream: heard.append(read_frame(stream))), heard


def test_a_churn_from_one_address_never_sheds_a_members_first_handshake():
    listener, heard = _listener()
    try:
        with Churn(listener.port, ["127.0.0.2"]) as churn:
            got_in = [_member_gets_through(listener.port, heard) for _ in range(10)]
            assert churn.opened >= 3 * PENDING_HANDSHAKES  # the churn ran all along
            shed_by_churn = listener.shed
        assert all(got_in), got_in
        assert shed_by_churn > 0  # the stranger's own connections were the ones closed
    finally:
        listener.close()


def test_a_churn_from_many_addresses_never_sheds_a_known_member():
    strangers = [f"127.0.0.{i}" for i in range(2, 2 + 2 * PENDING_HANDSHAKES // PENDING_PER_ADDRESS)]
    listener, heard = _listener()
    try:
        assert _member_gets_through(listener.port, heard)  # the member proves itself once: known
        with Churn(listener.port, strangers) as churn:
            got_in = [_member_gets_through(listener.port, heard) for _ in range(10)]
            assert churn.opened >= 3 * PENDING_HANDSHAKES
        assert all(got_in), got_in
    finally:
        listener.close()
