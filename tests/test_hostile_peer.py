"""A hostile or broken node cannot crash or stall the controller (issue #47): whatever bytes it
sends, the frame parser and the message check end in that node being lost with a clear reason,
never an unhandled exception, a hang, memory taken on a lying length, or a class looked up
while unpickling a frame. Hypothesis, bounded: fast."""

from __future__ import annotations

import io
import os
import pickle
import queue
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from skytasks.controller.backlog import NodeEvents
from skytasks.controller.channel import NodeChannel
from skytasks.protocol import MESSAGES, Op, check, message
from skytasks.providers import NodeLink
from skytasks.wire import HEADER, LENGTH, MAX_BUFFERS, MAX_META, ChannelClosed, FrameParser, encode, read_frame

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def frame(msg: dict, flags: int = 0) -> bytes:
    return b"".join(bytes(c) for c in encode(msg, flags))


GOOD = [
    message(Op.HELLO, pid=1, python="/usr/bin/python3", gpus=["0"]),
    message(Op.OUTPUT, group=1, rank=0, stream="stdout", line="hi"),
    message(Op.RESULT, group=1, rank=0, call=3, value=b"v" * 100_000, started=1.0, ended=2.0),
    message(Op.PEER_READY, port=4242),
    message(Op.HEARTBEAT),
]
STREAM = b"".join(frame(m) for m in GOOD)


def parse_all(data: bytes, cuts: list[int]) -> list[dict]:
    """`data` fed to a parser in the pieces `cuts` make: the frames, or ChannelClosed."""
    parser, out, last = FrameParser(), [], 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        out += parser.feed(data[last:cut])
        last = cut
    return out


@FAST
@given(st.binary(max_size=2048), st.lists(st.integers(0, 4096), max_size=8))
def test_any_bytes_are_frames_or_a_corrupt_stream_never_another_error(data, cuts):
    try:
        for msg in parse_all(data, cuts):
            assert type(msg) is dict
    except ChannelClosed:
        pass
    try:
        read_frame(io.BytesIO(data))
    except ChannelClosed:
        pass


@FAST
@given(st.integers(0, len(STREAM) - 1), st.integers(0, 255), st.lists(st.integers(0, len(STREAM)), max_size=6))
def test_a_changed_byte_in_good_frames_is_caught_or_harmless(at, value, cuts):
    data = bytearray(STREAM)
    data[at] = value
    try:
        for msg in parse_all(bytes(data), cuts):
            try:
                check(msg)
            except ValueError:
                pass
    except ChannelClosed:
        pass


@FAST
@given(st.integers(0, len(STREAM) - 1))
def test_a_truncated_stream_is_incomplete_not_an_error(cut):
    frames = parse_all(STREAM[:cut], [])
    assert frames == GOOD[:len(frames)]
    with pytest.raises(ChannelClosed):  # the stream ends mid-frame: closed, said so
        stream = io.BytesIO(STREAM[:cut])
        for _ in GOOD:
            read_frame(stream)


@pytest.mark.parametrize("meta_len,count,size", [(4 << 30, 0, 0), (10, 1, 4 << 30), (10, 1, 1 << 62),
                                                 (MAX_META + 1, 0, 0), (10, MAX_BUFFERS + 1, 0)],
                         ids=["4 GB pickle", "4 GB buffer", "a buffer past the cap", "a pickle past the cap",
                              "too many buffers"])
def test_a_lying_length_takes_no_memory_before_its_bytes_arrive(meta_len, count, size):
    head = HEADER.pack(meta_len, count, 0)
    body = b"\x80" * 10 + (LENGTH.pack(size) if count == 1 else b"") + b"x" * 1000  # then the stream ends
    tracemalloc.start()
    try:
        with pytest.raises(ChannelClosed, match="corrupt|stream closed"):
            read_frame(io.BytesIO(head + body))
        parser = FrameParser()
        try:
            assert parser.feed(head + body) == []  # waiting for bytes that never come: held, not allocated
        except ChannelClosed as exc:
            assert "corrupt" in str(exc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 80 << 20, peak


def test_a_frame_cannot_make_the_controller_look_up_a_class_or_call_anything(tmp_path):
    witness = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    meta = pickle.dumps({"op": "hello", "pid": Evil(), "python": "x", "gpus": []}, protocol=5)
    data = HEADER.pack(len(meta), 0, 0) + meta
    with pytest.raises(ChannelClosed, match="plain data only"):
        read_frame(io.BytesIO(data))
    with pytest.raises(ChannelClosed, match="plain data only"):
        FrameParser().feed(data)
    assert not witness.exists()


plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ops = st.sampled_from([str(op) for op in MESSAGES]) | st.text(max_size=10) | plain


@FAST
@given(ops, st.dictionaries(st.text(max_size=12) | st.sampled_from(["group", "rank", "call", "port", "pid", "line",
                                                                     "reason", "stacks", "samples", "value"]),
                            plain, max_size=6))
def test_the_message_check_refuses_with_a_valueerror_or_passes_only_what_fits(op, fields):
    msg = {"op": op, **fields}
    try:
        check(msg)
    except ValueError as exc:
        assert str(exc)
        return
    known = Op(op)
    hints = MESSAGES[known].__annotations__
    assert set(fields) - {"channel"} <= set(hints)


@FAST
@given(st.sampled_from(sorted(MESSAGES, key=str)), plain)
def test_each_field_of_the_wrong_type_is_refused(op, value):
    hints = list(MESSAGES[op].__annotations__)
    for name in hints:
        good = _a_good(op)
        if name not in good:
            continue
        bad = {**good, name: value}
        try:
            check(bad)
        except ValueError as exc:
            assert str(op) in str(exc)


def _a_good(op: Op) -> dict:
    samples = {
        "group": 1, "rank": 0, "call": 1, "port": 1, "pid": 1, "returncode": 0, "level": 20, "token": 1,
        "node_rank": 0, "attempt": 1, "grace": 1.0, "at": 1.0, "started": 1.0, "ended": 2.0, "deadline": None,
        "stacks": {}, "samples": {}, "metrics": {}, "ranks": [], "children": [], "env": {}, "refs": [], "blobs": {},
        "gpus": [], "value": b"", "exception": None, "head": b"", "used": {},
    }
    hints = MESSAGES[op].__annotations__
    return {"op": str(op), **{k: samples.get(k, "text") for k in hints if k in samples or "str" in str(hints[k])}}


# -- end to end: the controller's own reader, on a real pipe -------------------------------------

def channel_on_pipe() -> tuple[NodeChannel, NodeEvents, int]:
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    link = NodeLink(node_rank=7, address="10.9.9.9", inbound=os.fdopen(r, "rb"), outbound=os.fdopen(out_w, "wb"))
    events = NodeEvents(1000)
    channel = NodeChannel(link, events).start()
    os.close(out_r)
    return channel, events, w


def lost_reason(events: NodeEvents, seconds: float = 10.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            _, msg = events.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if msg["op"] == Op.LOST:
            return msg["reason"]
    raise AssertionError("the node was never reported lost")


HOSTILE = {
    "garbage": b"\x00\x01garbage" * 50,
    "a pickle of a class": HEADER.pack(40, 0, 0) + pickle.dumps({"op": "hello", "x": OSError()}, protocol=5)[:40],
    "a list, not a message": frame({"op": "x"})[:0] + (lambda m: HEADER.pack(len(m), 0, 0) + m)(pickle.dumps([1, 2])),
    "an unknown op": frame({"op": "format_disk"}),
    "a field of the wrong type": frame({"op": "peer_ready", "port": "22"}),
    "a 4 GB length, then silence closed": HEADER.pack(10, 1, 0) + b"\x80" * 10 + LENGTH.pack(4 << 30) + b"x" * 100,
    "a length past the cap": HEADER.pack(1 << 50, 0, 0),
    "a truncated frame": frame(GOOD[2])[:5000],
}


@pytest.mark.parametrize("data", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_stream_is_a_lost_node_with_a_reason(data):
    channel, events, w = channel_on_pipe()
    os.write(w, frame(GOOD[0]))  # a good hello first: the node was a member
    os.write(w, data)
    os.close(w)  # and then it goes (a silent one is lost by the heartbeat watch, tested elsewhere)
    reason = lost_reason(events)
    assert not channel.alive and reason
    if "truncated" not in str(data[:0]) and data is not HOSTILE["a truncated frame"] and \
            data is not HOSTILE["a 4 GB length, then silence closed"]:
        assert "node 7" in reason or "corrupt" in reason or "not a message" in reason, reason


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=512))
def test_random_bytes_from_a_node_end_in_a_lost_node_not_a_crash(data):
    channel, events, w = channel_on_pipe()
    os.write(w, data)
    os.close(w)
    assert lost_reason(events)
    assert not channel.alive


def test_messages_out_of_order_or_for_another_nodes_ranks_fail_that_node_not_the_controller():
    from tests.test_call_run import make_call, result

    call, _, _, heard = make_call(nodes=2)
    node, msg = result(call, 1, "one")
    call.handle(0, msg, now=1.0)  # node 0 speaks for rank 1, which is node 1's
    call.handle(0, {**msg, "rank": 99}, now=1.1)  # a rank that is in no node
    call.handle(1, {"op": Op.STOPPED, "group": call.group.id, "stacks": {"5": "x"}}, now=1.2)  # a stop never asked
    assert any("not one of its ranks" in e.text() for e in heard.events), [e.text() for e in heard.events]
    assert call.outcomes[0].status.value in ("failed", "stopped")


# -- a peer WITH the pool's key, against a real agent's relay parser (issue 53) ---------------------

def _pids_and_digest(a):
    import hashlib

    from skytasks import rank_info

    return rank_info().rank, os.getpid(), hashlib.sha256(a.tobytes()).hexdigest()


def _bad_tree(children) -> bool:
    from skytasks.node.peers import check_tree

    try:
        check_tree(children)
    except ValueError:
        return True
    return False  # a well-formed tree would send the agent connecting: not generated


_CALL = message(Op.CALL, call=1, head=b"x", refs=[], blobs={}, attempt=1)
_ROUTE = frame(message(Op.ROUTE, group=1, children=[]))
_PEER_HOSTILE = {
    "a RELAY with no ROUTE": frame(_CALL, flags=1),
    "a large RELAY with no ROUTE": frame({**_CALL, "blobs": {"b": os.urandom(2 << 20)}}, flags=1),
    "a ROUTE, then a relayed HEARTBEAT": _ROUTE + frame(message(Op.HEARTBEAT), flags=1),
    "a ROUTE, then a relayed SPAWN": _ROUTE + frame({"op": "spawn", "group": 1, "ranks": [], "env": {}}, flags=1),
    "a pickle past the cap": HEADER.pack(MAX_META + 1, 0, 0) + b"\x80" * 64,
    "a relayed pickle past the cap": _ROUTE + HEADER.pack(MAX_META + 1, 0, 1) + b"\x80" * 64,
    "too many buffers": HEADER.pack(10, MAX_BUFFERS + 1, 1) + b"\x80" * 64,
    "a buffer past the cap": (lambda m: HEADER.pack(len(m), 1, 0) + m + LENGTH.pack(1 << 62))(
        pickle.dumps({"op": "links", "children": []}, protocol=5)),
    "a handed-file length from a peer": (lambda m: HEADER.pack(len(m), 1, 1) + m + LENGTH.pack((1 << 63) | 5))(
        pickle.dumps({"op": "call"}, protocol=5)),
    "a tree of shared branches": (lambda: (lambda node: frame(message(Op.LINKS, children=[node, node])))(
        {"address": "127.0.0.1", "port": 1, "children": []}))(),
    "a CALL where a ROUTE was due": frame(_CALL),
}
_peer_frames = st.one_of(
    st.tuples(st.sampled_from(["links", "route"]), plain.filter(_bad_tree), st.integers(-5, 5)).map(
        lambda t: frame({"op": t[0], "children": t[1], **({"group": t[2]} if t[0] == "route" else {})})),
    st.tuples(ops.filter(lambda op: op != "call"), st.dictionaries(st.text(max_size=8), plain, max_size=3)).map(
        lambda t: _ROUTE + frame({"op": t[0], **t[1]}, flags=1)),
    st.tuples(ops, st.dictionaries(st.text(max_size=8), plain, max_size=3)).map(
        lambda t: frame({"op": t[0], **t[1]}, flags=1)),  # relayed, no ROUTE
    st.tuples(st.integers(MAX_META + 1, 1 << 62), st.integers(0, 255)).map(
        lambda t: HEADER.pack(t[0], 0, t[1] & 1) + b"\x00" * 32),
)


def test_a_peer_with_the_key_is_cut_off_for_any_malformed_frame_and_the_agent_serves_on():
    import socket as sockets
    import ssl

    import numpy as np
    import psutil

    from skytasks import GPUPool, distributed_task
    from skytasks.node.peer_links import connect
    from skytasks.node.tls_link import PeerTLS

    with GPUPool(nodes=3) as pool:
        task = distributed_task(_pids_and_digest, pool=pool, init_torch=False)
        ranks_before = {r: pid for r, pid, _ in task(np.zeros(1, dtype=np.uint8))}
        session = pool.runtime().session
        node = session.nodes[1]
        keys = session.relay.peers_message(node.link.address)
        secret, tls = bytes.fromhex(keys["secret"]), PeerTLS(keys["cert"], keys["key"])
        agent = psutil.Process(node.pid)
        rss_before, threads_before = agent.memory_info().rss, agent.num_threads()
        started = time.monotonic()

        def cut_off(data: bytes) -> bool:
            """Whether the agent ends the link after `data` (within 10 s), admitted first."""
            writer = connect(node.link.address, node.peer_port, secret, tls=tls)
            sock = writer._stream._sock  # the TLS socket under the frame writer
            try:
                sock.settimeout(10)
                try:
                    sock.sendall(data)
                except OSError:
                    return True  # cut off while it was still sending
                try:
                    return sock.recv(1) == b""
                except (ssl.SSLError, ConnectionError):
                    return True
                except sockets.timeout:
                    return False
            finally:
                sock.close()

        for name, data in _PEER_HOSTILE.items():
            assert cut_off(data), name

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(_peer_frames)
        def fuzz(data):
            assert cut_off(data)

        fuzz()
        assert time.monotonic() - started < 120
        # it served on: the same ranks (none stopped), a large argument down the relay tree through it
        arg = np.random.default_rng(5).integers(0, 255, size=4 << 20, dtype=np.uint8)
        out = task(arg)
        import hashlib

        assert [h for *_, h in out] == [hashlib.sha256(arg.tobytes()).hexdigest()] * 3
        assert {r: pid for r, pid, _ in out} == ranks_before
        assert node.alive and agent.is_running()
        assert agent.memory_info().rss - rss_before < 64 << 20
        deadline = time.monotonic() + 10
        while agent.num_threads() > threads_before + 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent.num_threads() <= threads_before + 4, (threads_before, agent.num_threads())
