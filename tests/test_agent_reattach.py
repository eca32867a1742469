"""A node's agent outlives a break of its stream once its controller sent a LEASE (issue 52): its
ranks run on, what they send is kept, and a controller that proves the pool's key takes the stream
up again through the agent's door (`python -c attach.CLIENT DOOR`), byte for byte: a call cut in
half on its way in completes, a result cut in half on its way out arrives once, and no line is
lost or doubled. A wrong key is refused without touching the holder's stream; a window that passes
ends the ranks and the agent; an agent that never got a LEASE ends with its stream, as always.

Real processes: the agent is started as a provider starts it (a subprocess on pipes), the test
plays the controller with `skytasks.wire` and `skytasks.protocol`."""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import cloudpickle
import psutil
import pytest

from skytasks import resume
from skytasks.node.attach import CLIENT
from skytasks.protocol import Op, message
from skytasks.rank import rank_environment
from skytasks.serialization import loads_out_of_band
from skytasks.node.door import PENDING_HANDSHAKES
from skytasks.wire import RELAY, ChannelClosed, FrameParser, encode, read_frame

ROOT = Path(__file__).resolve().parent.parent
KEY = os.urandom(32)
HOLDER = "holder-of-test"
BIG = 2 << 20  # a call's argument and a result: frames of about 2 MB each


def _echo_reversed(data: bytes, lines: int) -> bytes:
    import time as _time

    for i in range(lines):
        print(f"line {i}", flush=True)
        if i % 10 == 0:
            _time.sleep(0.01)
    return bytes(reversed(data))


def _print_much(lines: int) -> int:
    for i in range(lines):
        print(f"{i:08d} " + "x" * 90)
    return lines


def _sleep_long() -> None:
    import time as _time

    _time.sleep(120)


def _frame(msg: dict[str, Any], flags: int = 0) -> bytes:
    return b"".join(bytes(c) for c in encode(msg, flags))


class Controller:
    """The test's controller: what it sent (all of it, for a resend from the agent's count),
    what it read (counted), and the agent's frames in order."""

    def __init__(self, window: float = 30.0, heartbeat_timeout: float = 30.0, env: dict[str, str] | None = None,
                 heartbeat_file: str | None = None):
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "skytasks.node.agent", "--heartbeat-seconds", "0.5", "--heartbeat-timeout",
             str(heartbeat_timeout), "--sample-seconds", "600",
             *(["--heartbeat-file", heartbeat_file] if heartbeat_file else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, bufsize=0,
            env={**os.environ, **(env or {})})
        self.window = window
        self.to_agent: Any = self.agent.stdin
        self.from_agent: Any = self.agent.stdout
        self.sent = bytearray()  # every byte of our stream, whether it crossed yet or not
        self.got = 0
        self.acked: int | None = None
        self.clients: list[subprocess.Popen] = []
        self.parser = FrameParser()
        self.frames: list[dict[str, Any]] = []
        self.hello = self.wait_for(lambda f: f["op"] == Op.HELLO)

    def send(self, msg: dict[str, Any], flags: int = 0, cut_at: int | None = None) -> None:
        data = _frame(msg, flags)
        self.sent += data
        self.to_agent.write(data if cut_at is None else data[:cut_at])
        self.to_agent.flush()

    def read_some(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.from_agent], [], [], timeout)
        if not ready:
            return True
        data = os.read(self.from_agent.fileno(), 1 << 16)
        if not data:
            return False
        self.got += len(data)
        for f in self.parser.feed(data):
            if f["op"] != Op.HEARTBEAT:
                self.frames.append(f)
            elif "got" in f:
                self.acked = f["got"]  # the agent acknowledges our bytes: it has a LEASE
        return True

    def wait_for(self, seen: Callable[[dict[str, Any]], bool], count: int = 1, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [f for f in self.frames if seen(f)]
            if len(found) >= count:
                return found[-1]
            assert self.read_some(0.2), "the agent's stream ended"
        raise AssertionError(f"not seen in {timeout}s; frames: {[f['op'] for f in self.frames]}")

    def lease(self, keep_warm: float = 0.0, holder: str = HOLDER, **who: str) -> None:
        self.send(message(Op.LEASE, key=KEY.hex(), reattach_seconds=self.window, keep_warm_seconds=keep_warm,
                          holder=holder, **who))
        self.acked = None
        deadline = time.monotonic() + 10
        while (self.acked is None or self.acked < len(self.sent)) and time.monotonic() < deadline:
            assert self.read_some(0.2)  # its heartbeats acknowledge the LEASE: it took it
        assert self.acked == len(self.sent)

    def spawn(self, ranks: int = 2) -> None:
        envs = [{"rank": r, "env": rank_environment(rank=r, world_size=ranks, local_rank=r, local_world_size=ranks,
                                                    node_rank=0, peers=("127.0.0.1",), head_port=29999,
                                                    accelerators=0)} for r in range(ranks)]
        self.send(message(Op.SPAWN, group=1, ranks=envs, env={"SKYTASKS_INIT_TORCH": "0",
                                                               "SKYTASKS_INIT_TIMEOUT_SECONDS": "30"}))
        self.wait_for(lambda f: f["op"] == Op.READY, count=ranks)

    def break_stream(self) -> None:
        """The stream ends under both sides (an SSH connection reset): our pipe ends close."""
        for end in (self.to_agent, self.from_agent):
            end.close()

    def attach(self, key: bytes = KEY, holder: str = HOLDER, mode: str = "resume", who: str = "the test") -> dict[str, Any]:
        """A new stream through the door; on ATTACHED, our stream resent from the agent's count
        (mode "resume"), or a fresh stream from byte 0 ("hold"); "probe": the answer alone."""
        client = subprocess.Popen([sys.executable, "-c", CLIENT, self.hello["door"]], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, bufsize=0)
        challenge = read_frame(client.stdout)
        assert challenge["op"] == Op.CHALLENGE and challenge["instance"] == self.hello["instance"]
        nonce = resume.new_nonce()
        got = 0 if mode == "hold" else self.got
        proof = resume.controller_proof(key, challenge["nonce"], nonce, holder, mode, got)
        client.stdin.write(_frame(message(Op.ATTACH, proof=proof, nonce=nonce, holder=holder, mode=mode,
                                          got=got, who=who)))
        answer = read_frame(client.stdout)
        if answer["op"] == Op.ATTACHED and mode == "hold":  # a fresh stream: counted from 0 both ways
            assert answer["got"] == 0
            assert resume.proof_matches(resume.agent_proof(KEY, nonce, challenge["nonce"], 0), answer["proof"])
            self.client, self.to_agent, self.from_agent = client, client.stdin, client.stdout
            self.clients.append(client)
            self.sent, self.got, self.parser, self.acked = bytearray(), 0, FrameParser(), None
        elif answer["op"] == Op.ATTACHED and mode == "resume":
            assert resume.proof_matches(resume.agent_proof(KEY, nonce, challenge["nonce"], answer["got"]),
                                        answer["proof"])
            self.client, self.to_agent, self.from_agent = client, client.stdin, client.stdout
            self.clients.append(client)
            self.to_agent.write(bytes(self.sent[answer["got"]:]))
        else:
            client.stdin.close()
            assert client.wait(10) == 0  # the door closed: the client ends
        return answer

    def ranks(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.agent.pid).children(recursive=True)
                if "rank_template" not in " ".join(p.cmdline())]

    def close(self) -> None:
        if self.agent.poll() is None:
            self.agent.kill()  # its ranks follow it (they die with their parent)
            self.agent.wait()
            shutil.rmtree(os.path.dirname(self.hello["door"]), ignore_errors=True)
        for client in self.clients:  # each ends with the agent's end of its socket
            client.wait(10)


@pytest.fixture
def controllers():
    made: list[Controller] = []

    def make(**kw: Any) -> Controller:
        made.append(Controller(**kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _call(data: bytes, lines: int) -> dict[str, Any]:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    head = cloudpickle.dumps((_echo_reversed, (data, lines), {}))
    return message(Op.CALL, call=7, head=head, refs=[], blobs={}, attempt=1)


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return
        time.sleep(0.1)
    raise AssertionError(f"still running after {timeout}s: {pids}")


def test_a_call_cut_both_ways_completes_through_the_door_with_nothing_lost_or_doubled(controllers):
    c = controllers()
    assert c.hello["door"].endswith("door.sock") and c.hello["instance"]
    c.lease()
    c.spawn(ranks=2)
    pids = [p.pid for p in c.ranks()]
    data = os.urandom(BIG)
    call = _call(data, lines=300)
    c.send(call, flags=RELAY, cut_at=BIG // 2)  # half the call reaches the ranks' pipes
    time.sleep(0.3)
    c.break_stream()
    time.sleep(0.5)
    assert c.agent.poll() is None and all(psutil.pid_exists(p) for p in pids)
    assert c.attach()["op"] == Op.ATTACHED  # the rest of the call follows from the agent's count
    # Now cut the way out, inside a result: the agent resends from our count.
    result_start = c.got
    c.wait_for(lambda f: f["op"] == Op.OUTPUT, count=50)
    while c.got < result_start + BIG // 2:
        assert c.read_some(1.0)
    c.client.kill()  # the second stream dies mid-result (a proxy's cut)
    c.client.wait()
    time.sleep(0.5)
    assert c.agent.poll() is None
    assert c.attach()["op"] == Op.ATTACHED
    c.wait_for(lambda f: f["op"] == Op.RESULT, count=2)
    c.send(message(Op.HEARTBEAT, got=c.got))  # an ack: the agent may drop what it kept
    time.sleep(1.5)  # anything doubled would arrive by now
    while c.read_some(0.2) and select.select([c.from_agent], [], [], 0)[0]:
        pass
    results = [f for f in c.frames if f["op"] == Op.RESULT]
    assert sorted(f["rank"] for f in results) == [0, 1]
    for f in results:
        assert f["call"] == 7 and loads_out_of_band(f["value"], copy=True) == bytes(reversed(data))
    for rank in (0, 1):
        lines = [f["line"] for f in c.frames if f["op"] == Op.OUTPUT and f["rank"] == rank]
        assert lines == [f"line {i}\n" for i in range(300)] or lines == [f"line {i}" for i in range(300)]
    assert [f["op"] for f in c.frames].count(Op.HELLO) == 1
    assert c.agent.poll() is None and all(psutil.pid_exists(p) for p in pids)
    with open(os.path.join(os.path.dirname(c.hello["door"]), "agent.log")) as log:  # its stderr since the LEASE
        said = log.read()
    assert said.count("re-attached") == 2 and "the controller's stream ended" in said
    c.send(message(Op.END))  # teardown: the ranks and the agent end
    assert c.agent.wait(30) == 0
    _wait_gone(pids, 10)


def test_a_wrong_key_or_another_holder_is_refused_and_the_holders_stream_goes_on(controllers):
    c = controllers()
    c.lease()
    refused = c.attach(key=os.urandom(32))
    assert refused["op"] == Op.REFUSED and "key" in refused["reason"] and "holder" not in refused
    other = c.attach(holder="someone else")
    assert other["op"] == Op.REFUSED and other["holder"] == "another controller"  # no `who`: never its id (issue 58)
    assert HOLDER not in repr(other)
    c.spawn(ranks=1)  # the holder's own stream, untouched
    data = os.urandom(BIG)
    c.send(_call(data, lines=3), flags=RELAY)
    result = c.wait_for(lambda f: f["op"] == Op.RESULT)
    assert loads_out_of_band(result["value"], copy=True) == bytes(reversed(data))


def test_the_newest_proven_stream_wins_over_one_that_still_looks_alive(controllers):
    """The agent may not have noticed its stream died (a runtime that keeps a dead pipe open): a
    proven re-attach takes over at once, and the old stream is closed under its far end."""
    c = controllers()
    c.lease()
    c.spawn(ranks=1)
    old_in, old_out = c.to_agent, c.from_agent
    assert c.attach()["op"] == Op.ATTACHED
    os.set_blocking(old_out.fileno(), False)
    deadline = time.monotonic() + 10
    while True:  # its end: what was in it, then EOF
        try:
            if not os.read(old_out.fileno(), 1 << 16):
                break
        except BlockingIOError:
            assert time.monotonic() < deadline, "the old stream was left open"
            time.sleep(0.1)
    while True:  # and its other end closed too (a moment after, under load): writing it breaks
        try:
            old_in.write(b"x" * 100)
            old_in.flush()
        except BrokenPipeError:
            break
        assert time.monotonic() < deadline, "the old stream's way in was left open"
        time.sleep(0.1)
    data = os.urandom(1000)
    c.send(_call(data, lines=1), flags=RELAY)
    assert loads_out_of_band(c.wait_for(lambda f: f["op"] == Op.RESULT)["value"], copy=True) == bytes(reversed(data))


def test_while_broken_the_kept_bytes_are_bounded_and_the_ranks_wait_with_nothing_dropped(controllers):
    c = controllers(env={"SKYTASKS_REATTACH_BUFFER_MB": "1"})
    c.lease()
    c.spawn(ranks=1)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    lines = 30_000  # 3 MB of output, three times what the agent may keep while its stream is broken
    c.break_stream()
    c.to_agent = open(os.devnull, "wb")  # what we send while broken: kept by us, resent at the attach
    c.send(message(Op.CALL, call=3, head=cloudpickle.dumps((_print_much, (lines,), {})), refs=[], blobs={},
                   attempt=1), flags=RELAY)
    time.sleep(0.5)
    assert c.attach()["op"] == Op.ATTACHED  # the call reaches the rank now
    c.wait_for(lambda f: f["op"] == Op.OUTPUT)
    c.client.kill()  # and the stream breaks again: the rank's output has nowhere to go
    c.client.wait()
    time.sleep(3.0)
    rank = c.ranks()[0]
    assert rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE  # it waits on its full pipe
    assert c.attach()["op"] == Op.ATTACHED
    result = c.wait_for(lambda f: f["op"] == Op.RESULT, timeout=60)
    assert loads_out_of_band(result["value"], copy=True) == lines
    got = [f["line"].strip() for f in c.frames if f["op"] == Op.OUTPUT]
    assert got == [f"{i:08d} " + "x" * 90 for i in range(lines)]


def test_a_window_that_passes_ends_the_ranks_and_the_agent(controllers):
    c = controllers(window=1.0)
    c.lease()
    c.spawn(ranks=2)
    pids = [p.pid for p in c.ranks()]
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    c.send(message(Op.CALL, call=1, head=cloudpickle.dumps((_sleep_long, (), {})), refs=[], blobs={}, attempt=1),
           flags=RELAY)
    time.sleep(0.5)
    began = time.monotonic()
    c.break_stream()
    time.sleep(0.5)
    assert c.agent.poll() is None and all(psutil.pid_exists(p) for p in pids)  # within the window: alive
    c.agent.wait(15)
    assert 1.0 + resume_margin() - 0.5 < time.monotonic() - began < 10
    _wait_gone(pids, 10)
    assert not os.path.exists(c.hello["door"])  # the scratch folder went with it


def test_silence_after_a_lease_is_a_break_not_the_end(controllers):
    c = controllers(window=30.0, heartbeat_timeout=2.0)
    c.lease()
    c.spawn(ranks=1)
    pid = c.ranks()[0].pid
    time.sleep(4.0)  # we say nothing: past the heartbeat timeout, the agent gives up this stream
    assert c.agent.poll() is None and psutil.pid_exists(pid)
    assert c.attach()["op"] == Op.ATTACHED
    c.send(_call(b"abc" * 100, lines=2), flags=RELAY)
    assert loads_out_of_band(c.wait_for(lambda f: f["op"] == Op.RESULT)["value"], copy=True) == b"cba" * 100


def test_a_stream_that_neither_drains_nor_ends_is_given_up_for_its_silence_and_taken_up_again(controllers):
    """As a Kubernetes exec's stdout after an API server restart: nobody reads it, nobody closes
    it. The agent's write of a 2 MB result waits on it, and must let go when the break is found."""
    c = controllers(window=30.0, heartbeat_timeout=2.0)
    c.lease()
    c.spawn(ranks=1)
    data = os.urandom(BIG)
    c.send(_call(data, lines=5), flags=RELAY)
    time.sleep(4.5)  # we neither read nor speak: its pipe fills, then it gives the stream up
    assert c.agent.poll() is None
    old = (c.to_agent, c.from_agent)
    assert c.attach()["op"] == Op.ATTACHED
    result = c.wait_for(lambda f: f["op"] == Op.RESULT)
    assert loads_out_of_band(result["value"], copy=True) == bytes(reversed(data))
    time.sleep(1.0)
    while select.select([c.from_agent], [], [], 0)[0] and c.read_some(0):
        pass
    assert [f["op"] for f in c.frames].count(Op.RESULT) == 1
    assert [f["line"] for f in c.frames if f["op"] == Op.OUTPUT] in ([f"line {i}" for i in range(5)],
                                                                       [f"line {i}\n" for i in range(5)])
    os.set_blocking(old[1].fileno(), False)  # the agent closed the old stream: what was in it, then its end
    while os.read(old[1].fileno(), 1 << 16):  # BlockingIOError if the agent still held it open
        pass
    old[0].close()


def test_without_a_lease_the_end_of_the_stream_ends_the_agent_as_always(controllers):
    c = controllers()
    c.spawn(ranks=2)
    pids = [p.pid for p in c.ranks()]
    refused_client = subprocess.run([sys.executable, "-c", CLIENT, c.hello["door"]], input=b"",
                                    capture_output=True, timeout=10)  # the door admits no one before a LEASE
    assert refused_client.returncode == 0 and refused_client.stdout == b""
    c.to_agent.close()
    assert c.agent.wait(30) == 0
    _wait_gone(pids, 10)


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root to run a client as another user")
def test_a_process_of_another_user_is_turned_away_at_the_door_even_where_it_can_reach_it(controllers):
    c = controllers()
    c.lease()
    os.chmod(os.path.dirname(c.hello["door"]), 0o711)  # opened up on purpose: the 0700 folder is the first wall
    os.chmod(c.hello["door"], 0o777)
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    as_nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", CLIENT,
                                c.hello["door"]], input=b"", capture_output=True, timeout=20)
    assert as_nobody.returncode == 0 and as_nobody.stdout == b""  # reached, closed at once: no CHALLENGE
    as_us = subprocess.run([python, "-c", CLIENT, c.hello["door"]], input=b"", capture_output=True, timeout=20)
    assert [f["op"] for f in FrameParser().feed(as_us.stdout)] == [Op.CHALLENGE]  # we are let in to the handshake


def resume_margin() -> float:
    from skytasks.node.door import REATTACH_MARGIN_SECONDS

    return REATTACH_MARGIN_SECONDS


def test_clients_that_never_speak_hold_the_doors_few_slots_not_the_door(controllers):
    """Pending handshakes are bounded: past them a client is closed at once; once they go, the
    door answers again (it never stopped accepting)."""
    c = controllers()
    c.lease()
    silent = [subprocess.Popen([sys.executable, "-c", CLIENT, c.hello["door"]], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE) for _ in range(PENDING_HANDSHAKES)]
    time.sleep(1.0)
    began = time.monotonic()
    with pytest.raises(ChannelClosed):
        c.attach(holder="someone else")
    assert time.monotonic() - began < 5
    for p in silent:
        p.send_signal(signal.SIGKILL)
        p.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert c.attach(holder="someone else")["op"] == Op.REFUSED
            break
        except ChannelClosed:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_clients_that_trickle_bytes_lose_their_slots_when_the_whole_handshake_s_time_is_up(controllers):
    """A client sending a byte every 2 s never lets one step time out, but the handshake as a whole
    does: after HANDSHAKE_SECONDS the door is free for the holder again."""
    from skytasks.node.door import HANDSHAKE_SECONDS

    c = controllers()
    c.lease()
    script = ("import os, socket, sys, time\n"
              "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.recv(4096)\n"
              "try:\n"
              "    for _ in range(60):\n"
              "        s.sendall(b'x'); time.sleep(2)\n"
              "except OSError:\n"
              "    os._exit(7)\n")
    tricklers = [subprocess.Popen([sys.executable, "-c", script, c.hello["door"]]) for _ in range(PENDING_HANDSHAKES)]
    try:
        time.sleep(1.0)
        with pytest.raises(ChannelClosed):  # every slot held
            c.attach(holder="someone else")
        began = time.monotonic()
        for p in tricklers:  # each cut off once its handshake's time is up, though it never paused 10 s
            assert p.wait(HANDSHAKE_SECONDS + 10) == 7
        assert time.monotonic() - began < HANDSHAKE_SECONDS + 5
        assert c.attach(holder="someone else")["op"] == Op.REFUSED  # the door answers again
    finally:
        for p in tricklers:
            p.kill()
            p.wait()


# -- the parts without processes: what is kept, and the proofs ---------------------------------

def test_the_outbox_keeps_what_was_not_acknowledged_and_resends_from_any_count():
    box = resume.Outbox(start=100)  # the first 100 bytes of the stream were never kept
    box.append([b"abc", memoryview(b"defgh"), bytearray(b"ij")])
    assert (box.sent, box.size) == (110, 10)
    assert b"".join(box.since(104)) == b"efghij" and b"".join(box.since(110)) == b""
    box.ack(105)
    box.ack(101)  # a stale ack (it crossed a newer one) changes nothing
    assert box.size == 5 and b"".join(box.since(105)) == b"fghij"
    with pytest.raises(ValueError):
        box.since(99)  # never kept
    with pytest.raises(ValueError):
        box.since(111)  # never sent
    with pytest.raises(ValueError):
        box.ack(111)
    assert not box.wait_room(2, deadline=time.monotonic() + 0.1)
    threading.Timer(0.2, box.ack, args=(110,)).start()
    assert box.wait_room(2, deadline=time.monotonic() + 10) and box.size == 0


def test_each_proof_holds_only_for_its_own_key_nonces_holder_mode_and_count():
    a, c = resume.new_nonce(), resume.new_nonce()
    good = resume.controller_proof(KEY, a, c, "h", "resume", 5)
    assert resume.proof_matches(good, resume.controller_proof(KEY, a, c, "h", "resume", 5))
    for other in (resume.controller_proof(os.urandom(32), a, c, "h", "resume", 5),
                  resume.controller_proof(KEY, c, a, "h", "resume", 5),
                  resume.controller_proof(KEY, a, c, "h2", "resume", 5),
                  resume.controller_proof(KEY, a, c, "h", "hold", 5),
                  resume.controller_proof(KEY, a, c, "h", "resume", 6),
                  resume.agent_proof(KEY, a, c, 5)):  # an agent's proof is never a controller's
        assert not resume.proof_matches(good, other)
    assert not resume.proof_matches(good, None) and KEY.hex() not in good


# -- warm pools (issue 52, part 3): holders come and go, the agent stays --------------------------

def _drained(c: Controller, timeout: float = 10.0) -> None:
    """Read the old stream to its end: the agent closes it when it lets its holder go."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not c.read_some(0.2):
            return
    raise AssertionError("the released stream was not closed by the agent")


def test_a_released_agent_is_held_by_the_next_process_on_a_fresh_stream(controllers):
    c = controllers()
    c.lease(keep_warm=60.0, who="flow run 'first'")
    c.spawn(ranks=1)
    pids = [p.pid for p in c.ranks()]
    data = os.urandom(BIG)
    c.send(_call(data, lines=3), flags=RELAY)
    c.wait_for(lambda f: f["op"] == Op.RESULT)
    held = c.attach(holder="second", mode="hold", who="flow run 'second'")
    assert held["op"] == Op.REFUSED and held["holder"] == "flow run 'first'" and held["since"] <= time.time()
    c.send(message(Op.RELEASE))
    _drained(c)
    _wait_gone(pids, 10)  # the holder's ranks end with its hold
    probe = c.attach(holder="probe", mode="probe", who="skytasks pools")
    state = probe["state"]
    assert probe["op"] == Op.ATTACHED and state["holding"] == "unheld" and state["holder"] == ""
    assert state["pid"] == c.agent.pid and state["calls"] == 1 and state["door"] == c.hello["door"]
    assert time.time() + 50 < state["expires_at"] <= time.time() + 60 and state["up_since"] < state["unheld_since"]
    # the second process: its hold is admitted, the stream counts from 0, and it leases and calls anew
    attached = c.attach(holder="second", mode="hold", who="flow run 'second'")
    assert attached["op"] == Op.ATTACHED and attached["state"]["pid"] == c.agent.pid
    assert attached["state"]["instance"] == c.hello["instance"]
    c.lease(keep_warm=60.0, holder="second")
    assert c.acked == len(c.sent)  # its count restarted with the fresh stream
    c.spawn(ranks=1)
    c.send(_call(data, lines=3), flags=RELAY)
    result = c.wait_for(lambda f: f["op"] == Op.RESULT and f["call"] == 7, count=2)
    assert loads_out_of_band(result["value"], copy=True) == bytes(reversed(data))
    third = c.attach(holder="third", mode="hold", who="flow run 'third'")
    assert third["op"] == Op.REFUSED and third["holder"] == "flow run 'second'"
    old = c.attach(holder=HOLDER, mode="resume")  # the first holder, back late: the node is not its own
    assert old["op"] == Op.REFUSED and old["holder"] == "flow run 'second'"
    c.send(message(Op.END))
    assert c.agent.wait(30) == 0


def test_a_dead_holder_frees_the_node_after_its_window_and_waiters_are_served_in_order(controllers):
    c = controllers(window=1.0)
    c.lease(keep_warm=60.0, who="flow run 'dead'")
    c.spawn(ranks=1)
    pids = [p.pid for p in c.ranks()]
    c.break_stream()  # its process died: its stream ends
    first = c.attach(holder="b", mode="hold", who="b")
    assert first["op"] == Op.REFUSED and first["holder"] == "flow run 'dead'"  # within its window
    _wait_gone(pids, 1.0 + 2.0 + 5.0)  # the window (+ margin) ends: the ranks go, the agent stays
    assert c.agent.poll() is None
    later = c.attach(holder="c", mode="hold", who="c")
    assert later["op"] == Op.REFUSED and later["holder"].startswith("b ")  # b asked first
    assert c.attach(holder="b", mode="hold", who="b")["op"] == Op.ATTACHED
    c.send(message(Op.END))
    assert c.agent.wait(30) == 0


def test_a_warm_lease_without_a_window_lets_a_broken_holder_go_at_once(controllers):
    """Local warm pools: a dead holder's agents are free at once, never ended with it."""
    c = controllers(window=0.0)
    c.lease(keep_warm=60.0)
    c.spawn(ranks=1)
    pids = [p.pid for p in c.ranks()]
    c.break_stream()
    _wait_gone(pids, 5)
    assert c.agent.poll() is None
    assert c.attach(holder="b", mode="hold", who="b")["op"] == Op.ATTACHED
    c.send(message(Op.END))
    assert c.agent.wait(30) == 0


def test_an_unheld_agent_ends_after_keep_warm_and_tells_its_watchdog(controllers, tmp_path):
    beat = tmp_path / "heartbeat"
    c = controllers(heartbeat_file=str(beat))
    c.lease(keep_warm=2.0)
    c.send(message(Op.RELEASE))
    _drained(c)
    appeared = time.monotonic() + 1.5  # the agent's watcher touches it at its next tick (0.5 s here)
    while not beat.exists():
        assert time.monotonic() < appeared, "an unheld agent's heartbeat file was never touched"
        time.sleep(0.05)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and c.agent.poll() is None:
        assert beat.stat().st_mtime > time.time() - 3  # unheld, it is still wanted: touched
        time.sleep(0.2)
    assert c.agent.wait(10) == 0
    assert beat.stat().st_mtime == 1  # mtime 1: the watchdog ends the machine now
    assert not os.path.exists(c.hello["door"])


def test_a_killed_agents_scratch_folder_is_swept_by_the_next_agent_and_a_live_ones_kept(controllers):
    live, killed = controllers(), controllers()
    killed_folder = os.path.dirname(killed.hello["door"])
    killed.agent.kill()  # SIGKILL: it cannot remove its own folder
    killed.agent.wait()
    assert os.path.isdir(killed_folder)
    a_while_ago = time.time() - 120  # past the minute a folder is left to settle
    os.utime(killed_folder, (a_while_ago, a_while_ago))
    following = controllers()
    assert not os.path.exists(killed_folder)
    assert os.path.exists(live.hello["door"]) and os.path.exists(following.hello["door"])
    assert live.agent.poll() is None


@pytest.fixture
def short_tmp():
    """A temp folder with a short path: a door's path must fit AF_UNIX's 107 bytes, which
    pytest's own (under popen-gwN and the test's name) does not leave room for."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="sw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_sweep_removes_only_folders_whose_agent_is_gone_twice_over(short_tmp):
    """Gone: no process of its pid here, and no listener at its door (the temp folder may be
    shared with agents in another PID namespace, whose pids mean nothing here)."""
    from skytasks.node import scratch

    dead = subprocess.Popen(["true"])
    dead.wait()

    def folder(name: str, door: str = "", age_days: float = 0.0) -> tuple[Path, socket.socket | None]:
        path = short_tmp / f"{scratch.PREFIX}{name}"
        path.mkdir()
        sock = None
        if door:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path / "door.sock"))
            if door == "listening":
                sock.listen(1)
            else:  # bound, then closed: the socket file an agent killed outright leaves
                sock.close()
        then = time.time() - (age_days * 86400 or 120)  # settled, unless asked otherwise
        os.utime(path, (then, then))
        return path, sock

    gone, _ = folder(f"{dead.pid}-abcd1234", door="dead")
    huge, _ = folder("99999999999-a", door="dead")  # no pid of any system: by its door
    old_style_gone, _ = folder("zw9g1utr", door="dead")  # named before the pid was in the name
    other_namespace, listener = folder(f"{dead.pid}-efgh5678", door="listening")  # its pid is not ours to judge
    alive, _ = folder(f"{os.getpid()}-ijkl9012", door="dead")  # its agent is between bind and listen
    doorless_young, _ = folder(f"{dead.pid}-mnop3456")
    doorless_old, _ = folder(f"{dead.pid}-qrst7890", age_days=2)
    doorless_old_style, _ = folder("uvwx1234", age_days=2)
    unsettled, _ = folder(f"{dead.pid}-cdef9012", door="dead")
    os.utime(unsettled)  # changed just now: maybe an agent of another PID namespace between bind and listen
    not_an_agents = short_tmp / "skytasks-agentless"
    not_an_agents.mkdir()
    others, _ = folder(f"{dead.pid}-yzab5678", door="dead")
    if os.getuid() == 0:
        os.chown(others, 65534, 65534)  # another user's: never ours to remove
    else:  # a folder we cannot chown away: the sweep still keeps those of other users, untested here
        shutil.rmtree(others)
        others = unsettled
    try:
        removed = scratch.sweep(str(short_tmp))
    finally:
        assert listener is not None
        listener.close()
    assert sorted(removed) == sorted(str(p) for p in (gone, huge, old_style_gone, doorless_old))
    for kept in (other_namespace, alive, doorless_young, doorless_old_style, not_an_agents, unsettled, others):
        assert kept.exists(), kept
