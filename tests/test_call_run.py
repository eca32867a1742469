"""The call state machine, driven by hand: no processes, no queue, no clock but the one we pass.

Each test feeds `CallRun` the messages the nodes would send (protocol.Op), lets the clocks run
with `tick(now)`, and checks what it sent to the nodes, what the observer heard and how the call
ends. This is where "stopped with no recorded cause" is shown impossible: every early end either
records a cause or raises.
"""

from __future__ import annotations

import time

import cloudpickle
import pytest

from skytasks.controller.call_run import CallRun, Phase
from skytasks.controller.outcome import RankState
from skytasks.controller.packing import PackedCall
from skytasks.controller.rank_group import GroupSpec, NodeShape, RankGroup
from skytasks.errors import DistributedTaskError, HangError, RankProcessDied
from skytasks.events import NodeLost
from skytasks.protocol import Op
from skytasks.serialization import dumps_out_of_band


class FakeBus:
    def __init__(self, nodes: int):
        self.sent: list[tuple[str, dict]] = []  # (to, msg): "all" or the node rank
        self.nodes_alive = set(range(nodes))
        self.replaced: set[int] = set()  # nodes whose old channel's news must be ignored

    def send(self, node_rank, msg):
        self.sent.append((node_rank, msg))

    def broadcast(self, msg, relay=False):
        self.sent.append(("all", msg))

    def send_call(self, msg, group):
        self.sent.append(("all", msg))

    def alive(self):
        return set(self.nodes_alive)

    def is_current(self, node_rank, msg):
        return not (node_rank in self.replaced and msg.get("channel") == "old")

    def ops(self) -> list[str]:
        return [str(m["op"]) for _, m in self.sent]


class Heard:
    def __init__(self):
        self.lines, self.done, self.events, self.stacks = [], {}, [], []

    def on_output(self, rank, stream, line):
        self.lines.append((rank, line))

    def on_log(self, rank, level, line):
        self.lines.append((rank, line))

    def on_rank_done(self, rank, outcome):
        self.done[rank] = outcome.status

    def on_report(self, rank, metrics):
        pass

    def on_event(self, event):
        self.events.append(event)

    @property
    def notices(self):
        return [e.text() for e in self.events]

    def on_stacks(self, stacks, why):
        self.stacks.append((dict(stacks), why))


def make_call(nodes=2, ppn=1, *, init_torch=False, deadline=None, hang=None, init_timeout=30.0, now=0.0):
    shapes = [NodeShape(n, f"10.0.0.{n}", f"m{n}") for n in range(nodes)]
    group = RankGroup(shapes, ppn, GroupSpec(None, init_torch, init_timeout), port=29400, pool_env={})
    bus, heard = FakeBus(nodes), Heard()
    group.start(bus)
    call = CallRun(group, bus, heard, label="t", attempt=1, deadline=deadline, hang_timeout=hang,
                   stop_confirm_seconds=10.0, stop_grace_seconds=1.0, now=now)
    call.start(PackedCall(cloudpickle.dumps((len, (), {})), []))
    return call, group, bus, heard


def result(call, rank, value):
    node = rank  # one rank per node in these tests
    return node, {"op": Op.RESULT, "group": call.group.id, "rank": rank, "call": call.id,
                  "value": dumps_out_of_band(value), "started": time.time(), "ended": time.time()}


def failed(call, rank, exc, call_id="this"):
    return rank, {"op": Op.FAILED, "group": call.group.id, "rank": rank, "call": call.id if call_id == "this" else call_id,
                  "type": type(exc).__name__, "message": str(exc), "traceback": "",
                  "exception": cloudpickle.dumps(exc), "started": time.time(), "ended": time.time()}


def test_building_a_group_sends_nothing_and_start_spawns_once_per_node():
    shapes = [NodeShape(0, "a", "m0"), NodeShape(1, "b", "m1")]
    group = RankGroup(shapes, 2, GroupSpec(None, True, 30.0), port=29400, pool_env={"X": "1"})
    bus = FakeBus(2)
    assert bus.sent == [] and group.world_size == 4 and group.backend == "gloo"
    group.start(bus)
    assert [(to, str(m["op"])) for to, m in bus.sent] == [(0, "spawn"), (1, "spawn")]
    ranks = [r["rank"] for r in bus.sent[1][1]["ranks"]]
    assert ranks == [2, 3] and bus.sent[1][1]["env"]["X"] == "1"
    assert bus.sent[0][1]["ranks"][1]["env"]["MASTER_ADDR"] == "a"


def test_every_rank_returning_ends_the_call_with_values_in_rank_order():
    call, _, bus, heard = make_call()
    assert bus.ops()[-1] == "call"
    call.handle(*result(call, 1, "one"), now=1.0)
    assert not call.done
    call.handle(*result(call, 0, "zero"), now=2.0)
    assert call.done and call.result() == ["zero", "one"]
    assert heard.done == {0: "completed", 1: "completed"} and "stop" not in bus.ops()


def test_a_long_silent_call_has_nothing_to_wake_for_and_still_returns():
    """The silent-None bug: a call with no clocks never ends on its own, however long."""
    call, *_ = make_call()
    assert call.wake_at() is None
    call.tick(now=10 * 3600.0)  # ten silent hours
    assert not call.done and call.phase is Phase.RUNNING
    call.handle(*result(call, 0, 0), now=10 * 3600.0)
    call.handle(*result(call, 1, 1), now=10 * 3600.0)
    assert call.result() == [0, 1]


def test_a_raising_rank_stops_the_rest_at_once_with_their_stacks_and_is_the_root_cause():
    call, _, bus, heard = make_call()
    call.handle(*failed(call, 1, ValueError("bad batch")), now=1.0)
    # One step, not a stack request and then a stop: each rank dumps its stack as SIGTERM reaches it
    assert call.phase is Phase.STOPPING and bus.sent[-1][1]["op"] == "stop" and bus.sent[-1][1]["stacks"] is True
    assert "hung" not in bus.sent[-1][1]  # a failure's stop: one signal a rank, its dump as it stops
    assert heard.done == {1: "failed"}  # the stopped ranks are told with their stacks, once they are in
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {"0": "File x, in barrier"}}, now=1.2)
    assert not call.done and heard.stacks == []
    call.handle(1, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=1.3)
    assert call.done
    assert heard.stacks == [({0: "File x, in barrier"}, "stopped because rank 1 failed")]
    assert heard.done == {1: "failed", 0: "stopped"}
    with pytest.raises(DistributedTaskError) as err:
        call.result()
    assert [type(e) for e in err.value.exceptions] == [ValueError] and "root cause on rank 1" in str(err.value)


def test_agents_that_never_confirm_do_not_hold_the_call_up_and_the_stopped_ranks_are_still_told():
    call, _, bus, heard = make_call()
    call.handle(*failed(call, 0, ValueError("x")), now=1.0)
    assert call.phase is Phase.STOPPING and bus.ops()[-1] == "stop"
    assert call.wake_at() == pytest.approx(11.0)
    call.tick(now=11.0)  # the agents never confirm: the call ends anyway, with its cause
    assert call.done and heard.done == {0: "failed", 1: "stopped"} and heard.stacks == [({}, "stopped because rank 0 failed")]
    with pytest.raises(DistributedTaskError):
        call.result()


def test_a_lost_node_fails_its_own_ranks_as_the_root_cause():
    call, _, _, heard = make_call()
    call.handle(1, {"op": Op.LOST, "reason": "stream closed"}, now=1.0)
    assert heard.done[1] == "failed"
    call.tick(now=5.0)  # no stacks arrive
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=5.1)
    call.bus.nodes_alive.discard(1)
    call.handle(1, {"op": Op.LOST, "reason": "stream closed"}, now=5.2)
    assert call.done
    with pytest.raises(DistributedTaskError) as err:
        call.result()
    assert isinstance(err.value.exceptions[0], ConnectionError) and "node 1" in str(err.value.exceptions[0])


# Whatever words the loss comes in: a write to the dead agent fails "[Errno 32] Broken pipe", the
# very words a peer's echo uses (a clean-clone run's local agent, SIGKILLed mid-call).
@pytest.mark.parametrize("reason", ["the stream closed", "[Errno 32] Broken pipe", "Connection reset by peer"])
def test_a_peers_connection_error_that_beats_the_lost_nodes_news_leaves_the_lost_node_the_root_cause(reason):
    call, _, _, heard = make_call()
    call.handle(*failed(call, 0, RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4")),
                now=1.0)
    assert call.phase is Phase.STOPPING  # rank 1 stopped: its node's loss is not known yet
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=1.1)
    call.handle(1, {"op": Op.LOST, "reason": reason}, now=1.2)
    assert call.done and heard.done == {0: "failed", 1: "failed"}
    outcome = call.outcome()
    assert outcome.reason == "node lost"  # a node recovery, not a retry
    assert isinstance(outcome.cause, ConnectionError) and "lost the agent of node 1" in str(outcome.cause)


def test_a_stop_waits_for_the_loss_of_a_node_whose_channel_died_before_its_news_was_read():
    """The channel marks its node dead before its LOST reaches the queue: a stop that begins in
    between must still read that LOST, which names the root cause."""
    call, _, _, heard = make_call()
    call.bus.nodes_alive.discard(1)  # node 1's channel is dead; its LOST is still on its way
    call.handle(*failed(call, 0, RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4")),
                now=1.0)
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=1.1)
    assert not call.done  # the live node confirmed; the dead one's news is still awaited
    call.handle(1, {"op": Op.LOST, "reason": "the stream closed"}, now=1.2)
    assert call.done and heard.done == {0: "failed", 1: "failed"}
    assert call.outcome().reason == "node lost" and [e.node for e in heard.events if isinstance(e, NodeLost)] == [1]


def test_a_node_dead_before_the_call_began_is_waited_for_too():
    """Its channel died between the session's look at the pool and the call's start."""
    shapes = [NodeShape(n, f"10.0.0.{n}", f"m{n}") for n in range(2)]
    group = RankGroup(shapes, 1, GroupSpec(None, False, 30.0), port=29400, pool_env={})
    bus, heard = FakeBus(2), Heard()
    group.start(bus)
    bus.nodes_alive.discard(1)
    call = CallRun(group, bus, heard, label="t", attempt=1, deadline=None, hang_timeout=None,
                   stop_confirm_seconds=10.0, stop_grace_seconds=1.0, now=0.0)
    call.start(PackedCall(cloudpickle.dumps((len, (), {})), []))
    call.handle(*failed(call, 0, RuntimeError("Connection closed by peer")), now=1.0)
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=1.1)
    assert not call.done
    call.handle(1, {"op": Op.LOST, "reason": "the stream closed"}, now=1.2)
    assert call.done and call.outcome().reason == "node lost"


def test_a_rank_killed_as_its_node_vanished_is_the_nodes_loss():
    """A deleted pod: its rank's process is killed (EXITED by SIGKILL) just before the agent's
    stream ends. The node's loss is the cause, and the attempt a node recovery."""
    call, _, _, heard = make_call()
    call.handle(1, {"op": Op.EXITED, "group": call.group.id, "rank": 1, "returncode": -9, "at": time.time()}, now=1.0)
    assert call.phase is Phase.STOPPING
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=1.1)
    call.handle(1, {"op": Op.LOST, "reason": "the pod was deleted"}, now=1.2)
    assert call.done and call.outcome().reason == "node lost"
    assert isinstance(call.outcome().cause, RankProcessDied)  # what the user reads: how its process ended
    assert [e.node for e in heard.events if isinstance(e, NodeLost)] == [1]


def test_ranks_killed_on_two_vanishing_nodes_are_their_nodes_loss():
    """Two pods deleted at once: each node's rank is killed before its stream ends."""
    call, _, _, heard = make_call(nodes=3)
    for node in (1, 2):
        call.handle(node, {"op": Op.EXITED, "group": call.group.id, "rank": node, "returncode": -15, "at": time.time()},
                    now=1.0)
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=1.1)
    call.handle(1, {"op": Op.LOST, "reason": "the pod was deleted"}, now=1.2)
    assert not call.done
    call.handle(2, {"op": Op.LOST, "reason": "the pod was deleted"}, now=1.3)
    assert call.done and call.outcome().reason == "node lost"
    assert [e.node for e in heard.events if isinstance(e, NodeLost)] == [1, 2]


@pytest.mark.parametrize("returncode", [3, -11])  # an exit of its own, a crash (SIGSEGV): the code's
def test_a_rank_that_exits_on_its_own_stays_the_cause_when_its_node_is_lost_after(returncode):
    call, _, _, heard = make_call()
    call.handle(1, {"op": Op.EXITED, "group": call.group.id, "rank": 1, "returncode": returncode, "at": time.time()},
                now=1.0)
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=1.1)
    call.handle(1, {"op": Op.LOST, "reason": "the stream closed"}, now=1.2)
    assert call.done and call.outcome().reason == "rank failed"
    assert [e.node for e in heard.events if isinstance(e, NodeLost)] == [1]  # said by the call, once


def test_a_node_lost_after_a_real_failure_stays_collateral():
    call, _, _, heard = make_call()
    call.handle(*failed(call, 0, ValueError("bad batch")), now=1.0)
    call.handle(0, {"op": Op.STOPPED, "group": call.group.id, "stacks": {}}, now=1.1)
    call.handle(1, {"op": Op.LOST, "reason": "the stream closed"}, now=1.2)
    assert call.done and heard.done[1] == "stopped"
    assert call.outcome().reason == "rank failed" and isinstance(call.outcome().cause, ValueError)


def test_a_timeout_names_the_ranks_still_running_and_stops_them():
    call, _, bus, heard = make_call(deadline=30.0)
    call.handle(*result(call, 0, 0), now=1.0)
    assert call.wake_at() == 30.0
    call.tick(now=30.0)
    assert call.phase is Phase.STOPPING and bus.ops()[-1] == "stop" and heard.done[1] == "stopped"
    call.tick(now=41.0)
    with pytest.raises(DistributedTaskError) as err:
        call.result()
    assert "timed out" in str(err.value) and "ranks [1] were still running" in str(err.value)
    assert "rank -1" not in str(err.value)


def test_a_hang_stops_every_rank_and_fails_each_with_where_it_was():
    call, _, bus, heard = make_call(hang=5.0)
    call.handle(0, {"op": Op.OUTPUT, "group": call.group.id, "rank": 0, "stream": "stdout", "line": "epoch 1"}, now=3.0)
    assert call.wake_at() == 8.0  # output is progress: the hang clock restarted
    call.tick(now=8.0)
    # One step: the stop brings back where each rank was (its SIGTERM dump)
    assert call.phase is Phase.STOPPING and bus.sent[-1][1]["op"] == "stop" and bus.sent[-1][1]["stacks"] is True
    assert bus.sent[-1][1]["hung"] is True  # each agent asks its ranks' stacks before stopping any
    for r in (0, 1):
        call.handle(r, {"op": Op.STOPPED, "group": call.group.id, "stacks": {str(r): STACK_IN_TRAIN}}, now=8.1)
    assert call.done and heard.done == {0: "failed", 1: "failed"}
    assert heard.stacks == [({0: STACK_IN_TRAIN, 1: STACK_IN_TRAIN}, "no rank wrote output, reported or finished for 5s")]
    with pytest.raises(DistributedTaskError) as err:
        call.result()
    assert all(isinstance(e, HangError) for e in err.value.exceptions) and "hung" in str(err.value)
    assert "in `all_reduce`" in str(err.value.exceptions[0]) and "train.py:42" in str(err.value.exceptions[0])


def test_the_hang_clock_starts_when_the_group_is_up_not_while_torch_is_still_importing():
    call, *_ = make_call(init_torch=True, init_timeout=10.0, hang=3.0)
    assert call.wake_at() == 30.0  # only the init clock runs while no rank has joined
    call.tick(now=29.0)  # a slow start, far past the hang timeout: no hang
    assert call.phase is Phase.RUNNING
    for r in (0, 1):
        call.handle(r, {"op": Op.JOINING, "group": call.group.id, "rank": r}, now=29.5)
        call.handle(r, {"op": Op.READY, "group": call.group.id, "rank": r, "pid": 100 + r}, now=30.0)
    assert call.wake_at() == 33.0  # every rank ready: now silence counts
    call.tick(now=33.0)
    assert call.phase is Phase.STOPPING


def test_init_timeout_names_who_never_joined():
    call, *_ = make_call(init_torch=True, init_timeout=10.0)
    assert call.wake_at() == 30.0  # three times the timeout until anyone joins
    call.handle(0, {"op": Op.JOINING, "group": call.group.id, "rank": 0}, now=2.0)
    assert call.wake_at() == 12.0
    call.tick(now=12.0)
    call.tick(now=23.0)
    with pytest.raises(DistributedTaskError) as err:
        call.result()
    assert "ranks [1] never joined; ranks [0] were waiting" in str(err.value)


def test_late_news_from_an_old_group_or_a_replaced_channel_is_ignored():
    call, _, bus, heard = make_call()
    old_group = call.group.id - 1
    call.handle(0, {"op": Op.FAILED, "group": old_group, "rank": 0, "call": 1, "type": "X", "message": "old"}, now=1.0)
    bus.replaced.add(1)
    call.handle(1, {"op": Op.LOST, "reason": "old channel", "channel": "old"}, now=1.0)
    assert call.phase is Phase.RUNNING and heard.done == {}
    call.handle(*result(call, 0, 0), now=2.0)
    call.handle(*result(call, 1, 1), now=2.0)
    assert call.result() == [0, 1]


def test_a_failure_that_races_the_stop_is_kept_but_our_own_stop_is_not_a_failure():
    call, _, _, heard = make_call()
    call.handle(*failed(call, 0, ValueError("first")), now=1.0)  # the stop goes at once; rank 1 is "stopped"
    call.handle(1, {"op": Op.EXITED, "group": call.group.id, "rank": 1, "returncode": -15, "at": time.time()}, now=1.1)
    assert call.outcomes[1].status is RankState.STOPPED  # SIGTERM is our own stop
    call.handle(*failed(call, 1, RuntimeError("raced")), now=1.2)
    assert heard.done[1] == "failed"
    call.tick(now=13.0)
    assert heard.done[1] == "failed"  # never told "stopped" after all
    with pytest.raises(DistributedTaskError) as err:
        call.result()
    assert [type(e) for e in err.value.exceptions] == [ValueError]  # the root cause; the race came later
    assert {(f.rank, type(f.exception)) for f in err.value.failures} == {(0, ValueError), (1, RuntimeError)}


def test_a_rank_process_that_dies_fails_the_call():
    call, *_ = make_call()
    call.handle(0, {"op": Op.EXITED, "group": call.group.id, "rank": 0, "returncode": -9, "at": time.time()}, now=1.0)
    call.tick(now=3.0)
    call.tick(now=14.0)
    with pytest.raises(DistributedTaskError) as err:
        call.result()
    assert isinstance(err.value.exceptions[0], RankProcessDied)


def test_an_interrupt_stops_every_rank_and_ends_the_call():
    call, _, bus, heard = make_call()
    call.interrupt(now=1.0)
    assert call.done and bus.ops()[-1] == "stop" and heard.done == {0: "stopped", 1: "stopped"}
    assert call.group.broken


def test_a_result_from_another_call_on_the_same_group_is_not_this_calls():
    call, *_ = make_call()
    node, stale = result(call, 0, "stale")
    stale["call"] = call.id - 1
    call.handle(node, stale, now=1.0)
    assert not call.done and call.outcomes[0].status == "pending"


def stack(rank, call, text):
    return rank, {"op": Op.STACK, "group": call.group.id, "rank": rank, "stack": text}


STACK_IN_TRAIN = ('Current thread 0x1 (most recent call first):\n'
                  '  File "/usr/lib/python3/site-packages/torch/distributed/c10d.py", line 9 in all_reduce\n'
                  '  File "/home/me/train.py", line 42 in train_loop\n'
                  '  File "/x/skytasks/node/worker.py", line 1 in _run_call\n')


def make_straggling_call(after):
    call, group, bus, heard = make_call()
    call.stragglers.after = after
    return call, bus, heard


def test_ranks_still_running_after_another_returned_get_one_warning_naming_where_they_are():
    call, bus, heard = make_straggling_call(after=60.0)
    call.handle(*result(call, 0, "done"), now=10.0)
    assert call.wake_at() == 70.0 and heard.notices == []
    call.tick(70.0)  # the running rank's stack is read, the rank is not stopped
    assert bus.ops()[-1] == "stacks" and call.phase is Phase.RUNNING
    call.handle(*stack(1, call, STACK_IN_TRAIN), now=70.1)
    [warning] = heard.notices
    assert "rank 1 in train.py:42 in train_loop" in warning and "after rank 0 returned" in warning
    assert "hang_timeout_seconds" in warning
    assert call.wake_at() is None  # once per call
    call.handle(*result(call, 1, "late"), now=500.0)
    assert call.done and call.result() == ["done", "late"]  # a warning, never a failure


def test_a_straggler_whose_stack_never_comes_is_still_named_when_the_probe_ends():
    call, bus, heard = make_straggling_call(after=5.0)
    call.handle(*result(call, 1, "done"), now=1.0)
    call.tick(6.0)
    call.tick(8.5)
    [warning] = heard.notices
    assert "rank 0 in somewhere unreadable" in warning


@pytest.mark.parametrize("after", [None, 0.0])
def test_no_straggler_warning_when_it_is_turned_off(after):
    call, bus, heard = make_straggling_call(after=after)
    call.handle(*result(call, 0, "done"), now=1.0)
    assert call.wake_at() is None


def test_no_straggler_warning_when_every_rank_returns_in_time():
    call, bus, heard = make_straggling_call(after=60.0)
    call.handle(*result(call, 0, "a"), now=1.0)
    call.handle(*result(call, 1, "b"), now=30.0)
    assert call.done and heard.notices == [] and "stacks" not in bus.ops()


def test_hung_ranks_in_one_place_are_one_member_naming_them_all():
    call, _, bus, heard = make_call(nodes=4, hang=5.0)
    call.tick(now=5.0)
    for r in range(4):
        frames = STACK_IN_TRAIN if r != 2 else STACK_IN_TRAIN.replace("all_reduce", "barrier")
        call.handle(r, {"op": Op.STOPPED, "group": call.group.id, "stacks": {str(r): frames}}, now=5.1)
    assert call.done
    with pytest.raises(DistributedTaskError) as err:
        call.result()
    crowded, alone = err.value.exceptions
    assert isinstance(crowded, HangError) and crowded.ranks == (0, 1, 3) and alone.ranks == (2,)
    assert str(crowded).startswith("3 ranks (0-1, 3) hung") and "they were in `all_reduce`" in str(crowded)
    assert "ranks 0-3 made no progress" in str(err.value)
    assert {f.rank for f in err.value.failures} == {0, 1, 2, 3}  # every rank's failure is still there
