"""The controller reads every node stream on one thread (`skytasks.reactor`): frames come out whole
and in order however their bytes are cut, nothing a buffered reader already held is lost, and a
stream's end is said once, with its reason."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from skytasks.reactor import StreamReactor
from skytasks.silence import HeardStream
from skytasks.wire import TO_AGENT, ChannelClosed, FrameParser, decode, encode


def _bytes(msg: dict) -> bytes:
    return b"".join(bytes(c) for c in encode(msg))


MESSAGES = [
    {"op": "ready", "rank": 0},
    {"op": "output", "rank": 1, "line": "x" * 5000},
    {"op": "result", "rank": 2, "value": b"\x01" * (300 * 1024)},  # out of band: a buffer of its own
    {"op": "result", "rank": 3, "value": [b"a" * 70_000, b"b" * 70_000]},  # two buffers
]


@pytest.mark.parametrize("cut", [1, 7, 4096, 1 << 20], ids=["byte by byte", "7 bytes", "4 KiB", "all at once"])
def test_frames_come_out_whole_and_in_order_however_the_bytes_are_cut(cut):
    stream = b"".join(_bytes(m) for m in MESSAGES)
    parser = FrameParser()
    got = []
    for i in range(0, len(stream), cut):
        got += parser.feed(stream[i:i + cut])
    assert got == MESSAGES


@pytest.mark.parametrize("cut", [1, 4096, 1 << 20], ids=["byte by byte", "4 KiB", "all at once"])
def test_an_agent_passes_its_ranks_frames_on_as_their_bytes_and_keeps_the_ones_for_itself(cut):
    """A node agent does not unpickle what its ranks send: it splits the stream into whole frames,
    passes each on as the same bytes, and decodes only the frames flagged for itself."""
    sent = [b"".join(bytes(c) for c in encode(m, flags=TO_AGENT if m["op"] == "notice" else 0))
            for m in [*MESSAGES, {"op": "notice", "reason": "SIGUSR2"}]]
    stream = b"".join(sent)
    parser = FrameParser()
    got = []
    for i in range(0, len(stream), cut):
        got += parser.feed_raw(stream[i:i + cut])
    assert [bytes(frame) for _, frame in got] == sent
    assert [flags for flags, _ in got] == [0, 0, 0, 0, TO_AGENT]
    assert [decode(frame) for _, frame in got] == [*MESSAGES, {"op": "notice", "reason": "SIGUSR2"}]
    # What the controller's parser makes of the passed-on bytes is what the rank sent.
    assert FrameParser().feed(b"".join(bytes(frame) for _, frame in got[:-1])) == MESSAGES


def test_a_corrupt_stream_is_an_error_not_an_allocation():
    with pytest.raises(ChannelClosed, match="corrupt"):
        FrameParser().feed(b"\xff" * 64)


def reactor_threads() -> int:
    """The live reactors' threads: other tests' threads may come and go meanwhile."""
    return sum(t.name == "skytasks-reactor" for t in threading.enumerate())


def test_one_thread_reads_many_pipes_and_says_each_end_once():
    reactor = StreamReactor()
    pipes = [os.pipe() for _ in range(20)]
    got: dict[int, list] = {i: [] for i in range(20)}
    ended: dict[int, list[str]] = {i: [] for i in range(20)}
    all_ended = threading.Event()
    threads_before = reactor_threads()
    for i, (r, _) in enumerate(pipes):
        parser = FrameParser()
        reactor.add(os.fdopen(r, "rb"), lambda data, i=i, p=parser: got[i].extend(p.feed(data)),
                    lambda why, i=i: (ended[i].append(why), len([e for e in ended.values() if e]) == 20
                                      and all_ended.set()))
    assert reactor_threads() == threads_before + 1  # one reader, not twenty
    blob = np.arange(200_000, dtype=np.int64).tobytes()  # larger than a pipe: written in parts
    writers = []
    for i, (_, w) in enumerate(pipes):
        def write(i=i, w=w):
            with os.fdopen(w, "wb") as f:
                for m in ({"op": "hello", "node": i}, {"op": "result", "value": blob}):
                    f.writelines(encode(m))
        writers.append(threading.Thread(target=write))
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    assert all_ended.wait(10)
    for i in range(20):
        assert [m["op"] for m in got[i]] == ["hello", "result"]
        assert got[i][0]["node"] == i and bytes(got[i][1]["value"]) == blob
        assert ended[i] == ["the stream closed"]


def test_what_a_buffered_reader_already_held_is_read_first():
    """A provider may have read from the stream before the channel took it (SLURM reads the
    bootstrap's first line): the bytes its reader buffered are not in the pipe any more."""
    r, w = os.pipe()
    os.write(w, _bytes({"op": "a"}) + _bytes({"op": "b"}))
    buffered = os.fdopen(r, "rb")
    assert len(buffered.peek(1)) == len(_bytes({"op": "a"})) * 2  # both frames now sit in its buffer
    parser, got, done = FrameParser(), [], threading.Event()
    StreamReactor().add(buffered, lambda data: got.extend(parser.feed(data)), lambda why: done.set())
    os.write(w, _bytes({"op": "c"}))
    os.close(w)
    assert done.wait(5)
    assert [m["op"] for m in got] == ["a", "b", "c"]


def test_a_callback_that_raises_ends_that_stream_with_the_reason():
    r, w = os.pipe()
    ended: list[str] = []
    done = threading.Event()

    def on_data(data: bytes) -> None:
        raise ValueError("node 3 sent a malformed message")

    StreamReactor().add(os.fdopen(r, "rb"), on_data, lambda why: (ended.append(why), done.set()))
    os.write(w, b"x")
    assert done.wait(5)
    assert ended == ["ValueError: node 3 sent a malformed message"]
    os.close(w)


def test_a_forked_child_reads_its_own_streams():
    """The reader is a thread, and a forked child has none: it gets a reactor of its own."""
    from skytasks.reactor import shared_reactor

    idle_r, idle_w = os.pipe()
    shared_reactor().add(os.fdopen(idle_r, "rb"), lambda data: None, lambda why: None)  # its thread runs here
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its own stream is read
        code = 1
        try:
            r, w = os.pipe()
            got = threading.Event()
            shared_reactor().add(os.fdopen(r, "rb"), lambda data: got.set(), lambda why: None)
            os.write(w, b"x")
            code = 0 if got.wait(5) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    os.close(idle_w)
    assert os.waitstatus_to_exitcode(status) == 0


def test_bytes_that_wait_unread_count_as_heard_so_a_reader_behind_is_not_a_silent_node():
    """On a loaded machine the reader's thread may be starved of CPU for a while: the far end
    is silent only when nothing arrived, not when what arrived is still unread."""
    r, w = os.pipe()
    stream = HeardStream(os.fdopen(r, "rb", buffering=0))
    try:
        stream.last_heard -= 100  # nothing for 100 s
        assert stream.silent_for() > 99
        os.write(w, b"x")  # a byte arrives; the reader has not read it yet
        assert stream.silent_for() == 0.0
        assert stream.readinto(bytearray(1)) == 1
        stream.last_heard -= 100
        assert stream.silent_for() > 99  # read, and nothing since: silent again
    finally:
        stream.close()
        os.close(w)


def test_a_stream_closed_by_its_owner_never_reads_the_next_stream_given_its_number():
    """A lost node is let go while the reactor may hold a wake-up for its stream; its number, free
    again, becomes the replacement's pipe. The replacement's hello must reach the replacement's
    callback, never the old node's (it was lost that way once: "the node agent did not answer")."""
    reactor = StreamReactor()
    hold_first, hold_second, holding = threading.Event(), threading.Event(), threading.Event()
    old_got: list[bytes] = []
    new_got, new_heard = [], threading.Event()

    def holds(until: threading.Event):
        def on_data(data: bytes) -> None:
            holding.set()
            until.wait(10)
        return on_data

    first_r, first_w = os.pipe()
    second_r, second_w = os.pipe()
    old_r, old_w = os.pipe()
    reactor.add(os.fdopen(first_r, "rb"), holds(hold_first), lambda why: None)
    reactor.add(os.fdopen(second_r, "rb"), holds(hold_second), lambda why: None)
    old = os.fdopen(old_r, "rb")
    reactor.add(old, old_got.append, lambda why: None)
    os.write(first_w, b"x")  # the reader is held in the first stream's callback...
    assert holding.wait(5)
    holding.clear()
    os.write(second_w, b"x")  # ...while the second stream and the old one's end become ready:
    os.close(old_w)  # the next wake-up holds both
    hold_first.set()
    assert holding.wait(5)  # now held in the second, with the old stream's wake-up still to read
    number = old.fileno()
    old.close()  # the owner lets it go; its number is free
    new_r, new_w = os.pipe()
    if new_r != number:  # the next pipe takes the lowest free number: make sure it is that one
        os.dup2(new_r, number)
        os.close(new_r)
    reactor.add(os.fdopen(number, "rb"), lambda data: (new_got.append(data), new_heard.set()), lambda why: None)
    os.write(new_w, b"hello")  # the new agent says hello...
    hold_second.set()  # ...before the reader goes on to the old stream's wake-up
    assert new_heard.wait(5), f"the new stream's bytes went to the old stream's callback: {old_got}"
    assert new_got == [b"hello"] and old_got == []
    for fd in (first_w, second_w, new_w):
        os.close(fd)


def one() -> int:
    return 1


def test_pools_that_come_and_go_leave_no_descriptor_open_in_the_controller():
    """The reader closes its duplicate of a node's stream once the stream ends: a flow that brings
    pools up and down for hours does not run out of descriptors."""
    from skytasks import GPUPool, distributed_task

    def open_fds() -> int:  # pipes: what node streams are here (the Prefect client's sockets come and go)
        pipes = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                pipes += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
            except OSError:
                pass  # the listing's own descriptor, gone
        return pipes

    task = distributed_task(one, init_torch=False)
    task.with_options(pool=GPUPool(nodes=2))()  # the reader's own thread and pipe, made once
    before = open_fds()
    for _ in range(3):
        pool = GPUPool(nodes=2)
        with pool:
            assert task.with_options(pool=pool)() == [1, 1]
    deadline = time.monotonic() + 5  # the last streams' ends reach the reader just after the pool is down
    while open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    # None more than before (one fewer is the first call's last pipe, closed since it was counted).
    assert open_fds() <= before


def test_the_reader_hears_a_process_end_and_runs_timers_without_a_thread_of_either():
    """An agent hears each rank's end on its one reader thread (a pidfd), not on a thread per
    rank blocked in waitpid; what must wait a bounded time (a rank's exit report until its
    streams drain) is a timer on the same thread. The process is left for its owner to reap."""
    import subprocess
    import sys

    from skytasks.reactor import ENDED

    reactor = StreamReactor()
    reactor.call_later(0.0, lambda: None)  # the reader's one thread, started
    threads_before = reactor_threads()
    ended: list[tuple[str, int | None, str]] = []
    heard = threading.Event()
    procs = [subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({0.3 + 0.2 * i})"]) for i in range(3)]
    for p in procs:
        assert reactor.watch_exit(p.pid, lambda why, p=p: (ended.append((why, p.returncode, threading.current_thread().name)),
                                                              len(ended) == 3 and heard.set()))
    fired: list[float] = []
    started = time.monotonic()
    for delay in (0.4, 0.1, 0.25):
        reactor.call_later(delay, lambda: fired.append(round(time.monotonic() - started, 1)))
    assert reactor_threads() == threads_before  # no thread for any of them
    assert heard.wait(10)
    assert [why for why, _, _ in ended] == [ENDED] * 3
    assert {name for _, _, name in ended} == {"skytasks-reactor"}
    assert all(code is None for _, code, _ in ended)  # not reaped by the reader: its owner does
    assert [p.wait(5) for p in procs] == [0, 0, 0]
    deadline = time.monotonic() + 5
    while len(fired) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(fired) == 3 and fired == sorted(fired) and fired[0] >= 0.1, fired  # each when due, in order


def test_a_process_reaped_already_cannot_be_watched_and_says_so():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert StreamReactor().watch_exit(p.pid, lambda why: None) is False  # the caller waits the old way


def test_without_pidfds_a_ranks_end_is_still_reported_after_its_last_words(monkeypatch):
    """Where Python or the kernel has no pidfd, the agent waits for a rank's end in a thread, as
    before; the report still comes once, after everything the rank said."""
    import socket
    import subprocess
    import sys

    from skytasks.node.rank_process import RankProcess
    from skytasks.protocol import Op

    monkeypatch.delattr(os, "pidfd_open")
    said: list[dict] = []
    reported = threading.Event()

    class Agent:
        scratch, leaving_known, starter = "/tmp", threading.Event(), None

        def emit(self, msg: dict) -> None:
            said.append(msg)
            if msg["op"] == Op.EXITED:
                reported.set()

        def emit_encoded(self, chunks: list) -> None:
            pass

        def give_notice(self, reason: str, deadline: float | None = None) -> None:
            pass

    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2); print('last words')"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    theirs.close()  # the rank's end of its channel: this rank never had it, so it reads as closed
    RankProcess(Agent(), 7, 0, {}, proc, ours.detach(), "/tmp/unused-stack-file")
    assert reported.wait(10)
    time.sleep(0.3)  # nothing more comes: one report
    assert [(m["op"], m.get("line")) for m in said] == [(Op.OUTPUT, "last words"), (Op.EXITED, None)]
    assert said[-1]["returncode"] == 0 and said[-1]["group"] == 7
