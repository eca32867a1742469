"""The node agent: one per node, it starts that node's rank processes and relays for them.

It plays the part of torchrun's elastic agent, with the controller in place of the rendezvous
backend. It speaks `wire` frames on its stdin/stdout, which are pipes from the controller for a
local node and an SSH channel for a remote one. It imports only the standard library and
skytasks' own stdlib-only modules (`wire`, `reactor`, `protocol`, `preemption`, `devices`, `rank`,
`node.slurm_env`): no torch, no prefect, no cloudpickle, so it starts in tens of milliseconds and
a payload passes through it untouched.

Why it kills everything when its stream closes, or when the controller falls silent past the
heartbeat timeout (a dropped network closes nothing): the controller (the flow process) is the only
one who knows whether a call is still wanted. If it vanishes, by crash, SIGKILL or a dropped
network, ranks that keep running would hang in a collective or bill for a GPU forever.

Once the controller sent a LEASE with a re-attach window, a break of the stream is not yet the
controller gone: the ranks run on, what they send is kept (node/agent_stream.py), and a controller
that proves the pool's key may take the stream up again through the agent's door (node/door.py)
within the window; only then, or on END, does the agent end its ranks.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

from skytasks.devices import visible_gpus
from skytasks.node.resources import Sampler, physical_gpu
from skytasks.protocol import Op, message
from skytasks.silence import HeardStream
from skytasks.wire import RELAY, ChannelClosed, FrameWriter, encode, read_body, read_header

from skytasks.node import heartbeat_file, scratch
from skytasks.node.holding import END, EXPIRE, UNHOLD
from skytasks.node.reattach import Reattach, StreamRestarted, WarmStream
from skytasks.node.notices import NodeNotice
from skytasks.node.peers import RelayNode
from skytasks.node.tls_link import PeerTLS
from skytasks.node.rank_process import TERM_GRACE_SECONDS, RankProcess, start_ranks
from skytasks.node.rank_starter import RankStarter
from skytasks.node.rank_stops import ask_stacks, flight_records, stop_and_wait, stop_for_good, wait_until


class NodeAgent:
    def __init__(self, read_fd: int, write_fd: int, heartbeat_seconds: float, heartbeat_timeout: float,
                 sample_seconds: float, heartbeat_file: str | None = None, notice_file: str | None = None,
                 starter: RankStarter | None = None):
        self.starter = starter or RankStarter()  # a warm template forks the ranks (see rank_template)
        self.stream = WarmStream(read_fd, write_fd, gone=self._controller_gone)  # outlives a break after LEASE
        self._inbound = HeardStream(self.stream)
        self._out = FrameWriter(self.stream)  # type: ignore[arg-type]  # writelines, flush, close: as a file
        self._ranks: dict[int, RankProcess] = {}
        self._lock = threading.Lock()
        self._interval, self._timeout, self._heartbeat_file = heartbeat_seconds, heartbeat_timeout, heartbeat_file
        self._sample_seconds = sample_seconds
        self.notice = NodeNotice(self.emit, notice_file)
        self.scratch = scratch.make()  # rank stack files, the door; see _end_ranks
        self.reattach = Reattach(self.stream, self._inbound, self.scratch, self._state)
        # PREEMPTION (a node of the pool is going, maybe this one) goes on to every rank at once.
        self._handlers = {Op.SPAWN: self._spawn, Op.CALL: self._forward, Op.STACKS: self._stacks_in_background,
                          Op.STOP: self._stop, Op.CLOSE: self._close_group, Op.PREEMPTION: self._forward_notice,
                          Op.HEARTBEAT: self.reattach.acked, Op.PEERS: self._open_to_peers,
                          Op.LINKS: self._open_links, Op.LEASE: self.reattach.lease, Op.RELEASE: self._release}
        self.up_since, self.calls, self._peer_port = time.time(), 0, 0  # what a warm pool's next holder is told
        self._spawned = threading.Condition(self._lock)  # a group's ranks were started
        # this node's part in the relay tree of large calls
        self._relay = RelayNode(self._ranks_of, self._relay_broke)
        self.leaving_known = threading.Event()  # this node is going away (SIGTERM): see leave()

    def emit(self, msg: dict[str, Any]) -> None:
        self.emit_encoded(encode(msg))

    def emit_encoded(self, chunks: list[Any]) -> None:
        """Frames already encoded: a rank's own, passed on as its bytes."""
        try:
            self._out.send_encoded(chunks)
        except ChannelClosed:
            self._controller_gone("the stream to the controller closed")

    def _controller_gone(self, why: str) -> None:
        # Nobody wants these ranks any more.
        print(f"skytasks agent: {why}; stopping this node's ranks", file=sys.stderr, flush=True)
        self._end_ranks(grace=0.0)
        os._exit(0)

    def _release(self, msg: dict[str, Any]) -> None:
        """RELEASE (warm pools): the holder is done; its ranks go (CLOSE came first), the agent stays."""
        self.stop_ranks(grace=0.0)
        self.reattach.release()

    def _expire(self) -> None:
        """Nobody held this warm node for keep_warm_seconds: it ends, and its watchdog (launched
        nodes) reads the heartbeat file's mtime of 1 as "end the machine now", not idle_minutes later."""
        print("skytasks agent: nobody held this node for its keep-warm time; ending it", file=sys.stderr, flush=True)
        if self._heartbeat_file:
            heartbeat_file.touch(self._heartbeat_file, mtime=1)
        self._end_ranks(grace=0.0)
        scratch.remove_warm_log()  # a local warm pool's: nobody else is left to
        os._exit(0)

    def _send_heartbeats(self) -> None:
        """After a LEASE each heartbeat acknowledges what arrived (`got`), at once when much did."""
        while True:
            early = self.reattach.ack_due.wait(self._interval)
            self.reattach.ack_due.clear()
            if self.stream.detached:
                continue
            try:
                (self._out.send if early else self._out.send_if_idle)(self.reattach.heartbeat())
            except ChannelClosed:
                self._controller_gone("the stream to the controller closed")

    def _state(self) -> dict[str, Any]:
        """What the agent says of itself to a controller that attaches (ATTACHED)."""
        return {"pid": os.getpid(), "python": sys.executable, "gpus": visible_gpus(), "peer_port": self._peer_port,
                "up_since": self.up_since, "calls": self.calls}

    def _watch_controller(self) -> None:
        """A separate thread from the sender: a send stuck on a dead link must not stop the check.
        The heartbeat file tells the node's own watchdog (launched nodes) that a controller lives."""
        touched, touched_at = None, 0.0
        while True:
            time.sleep(min(1.0, self._interval))
            verdict = self.reattach.tick()  # a LEASE's clocks (node/holding.py)
            if verdict == END:
                self._controller_gone(f"not re-attached within {self.stream.window:g}s of the break")
            elif verdict == UNHOLD:
                print("skytasks agent: its holder did not come back; stopping the ranks, up for the next holder",
                      file=sys.stderr, flush=True)
                self.stop_ranks(grace=0.0)
            elif verdict == EXPIRE:
                self._expire()
            elif not self.stream.detached and (silent := self._inbound.silent_for()) > self._timeout:
                self.stream.broke(f"no word from the controller for {silent:.0f}s")  # no LEASE: gone
            self.notice.read_file()
            self.starter.reap_orphans()  # the agent is a subreaper (see rank_template)
            unheld_due = self.reattach.unheld and time.monotonic() - touched_at >= self._interval  # wanted, unheld
            if self._heartbeat_file and (unheld_due or self._inbound.last_heard != touched and not self.stream.detached):
                touched, touched_at = self._inbound.last_heard, time.monotonic()
                heartbeat_file.touch(self._heartbeat_file, f"{time.time():.0f}\n")  # no link followed

    def give_notice(self, reason: str, deadline: float | None = None) -> None:
        """This node will be taken away (a rank got SIGUSR2 itself): see `NodeNotice`."""
        self.notice.give(reason, deadline)

    def serve(self) -> None:
        # What this node has, for the controller's device placement and backend choice.
        self.emit(message(Op.HELLO, pid=os.getpid(), python=sys.executable, gpus=visible_gpus(),
                          **self.reattach.hello_fields()))
        for target in (self._send_heartbeats, self._watch_controller, self._sample_ranks):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        route: dict[str, Any] | None = None  # the relay tree the next CALL frame also goes down
        try:
            while True:
                try:
                    header = read_header(self._inbound)
                    if header[2] & RELAY:  # a call: streamed to the ranks, never held whole here
                        self.calls += 1
                        self._relay.relay_call(self._inbound, header, route)
                        route = None
                        continue
                    msg = read_body(self._inbound, *header)
                except StreamRestarted:  # a new holder's stream (warm pools): from its first frame
                    route = None
                    continue
                op = msg["op"]
                self.calls += op == Op.CALL
                if op == Op.ROUTE:
                    route = msg
                    continue
                if op == Op.END:  # teardown: once a LEASE came, the end of the stream is no goodbye
                    break
                try:
                    self._dispatch(op, msg)
                except Exception:  # noqa: BLE001 - reported, then this node's ranks are stopped
                    self.emit(message(Op.AGENT_ERROR, error=traceback.format_exc()))
                    self.stop_ranks(grace=0.0)
        except ChannelClosed:
            pass
        except NodeLeaving as exc:
            self.leave(str(exc))
        finally:
            self._end_ranks(grace=TERM_GRACE_SECONDS)

    def leave(self, reason: str) -> None:
        """The node is being taken away (SIGTERM from outside: a scheduler's preemption, cancel or
        time limit, a spot reclaim). Tell the controller first, with where each rank was: the
        ranks got the same signal and dump their stacks as they go."""
        self.leaving_known.set()
        with self._lock:
            ranks = list(self._ranks.values())
        stop_and_wait(ranks, TERM_GRACE_SECONDS)
        stacks = {str(rp.rank): rp.last_stack() for rp in ranks}
        self.emit(message(Op.LEAVING, reason=reason, stacks=stacks, group=_group_of(ranks)))

    def _sample_ranks(self) -> None:
        """What each running rank uses, every few seconds, to the controller (skytasks.node.resources)."""
        sampler = Sampler()
        visible = visible_gpus()
        while True:
            time.sleep(self._sample_seconds)
            with self._lock:
                ranks = [rp for rp in self._ranks.values() if rp.proc.poll() is None]
            if not ranks:
                continue
            targets = {rp.rank: (rp.proc.pid, physical_gpu(rp.device, visible)) for rp in ranks}
            try:
                samples = sampler.sample(targets)
            except Exception:  # noqa: BLE001 - figures are never worth a rank
                continue
            if samples:
                self.emit(message(Op.RESOURCES, group=_group_of(ranks), samples={str(r): f for r, f in samples.items()}))

    def _end_ranks(self, grace: float) -> None:
        """The agent is leaving: its ranks go, and so does its scratch folder (its door with it)."""
        self.reattach.close()
        self.stop_ranks(grace=grace)
        self.starter.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _open_to_peers(self, msg: dict[str, Any]) -> None:
        try:
            tls = PeerTLS(msg["cert"], msg["key"]) if msg["cert"] else None  # none: SKYTASKS_PEER_TLS=0
            port = self._peer_port = self._relay.open(bytes.fromhex(msg["secret"]), msg["address"], tls)
        except OSError as exc:  # not an address of this machine (NAT): calls come straight, as before
            print(f"skytasks agent: no relay listener on {msg['address']}: {exc}", file=sys.stderr, flush=True)
            port = 0
        self.emit(message(Op.PEER_READY, port=port))

    def _open_links(self, msg: dict[str, Any]) -> None:
        self._relay.open_links(msg["children"])

    def _relay_broke(self, reason: str) -> None:
        """A peer link broke in the middle of a call: this node's ranks hold part of its frame, so
        they are stopped and the call fails here as a lost node, with the reason."""
        print(f"skytasks agent: {reason}", file=sys.stderr, flush=True)
        self.emit(message(Op.AGENT_ERROR, error=reason))
        self.stop_ranks(grace=0.0)

    def _ranks_of(self, group: int | None, wait: float = 0.0) -> list[RankProcess]:
        """The ranks of `group` (None: every rank here), waiting up to `wait` for its SPAWN: a
        CALL from a peer may overtake the controller's SPAWN."""
        with self._spawned:
            self._spawned.wait_for(lambda: group is None or any(rp.group == group for rp in self._ranks.values()),
                                   timeout=wait)
            return [rp for rp in self._ranks.values() if group is None or rp.group == group]

    def _dispatch(self, op: str, msg: dict[str, Any]) -> None:
        self._handlers[Op(op)](msg)

    def _stacks_in_background(self, msg: dict[str, Any]) -> None:
        threading.Thread(target=self._send_stacks, args=(msg,), daemon=True).start()

    def _stop(self, msg: dict[str, Any]) -> None:
        # A hang's stacks are asked before anything here or on another node is stopped: a rank
        # stopped elsewhere first would end this one's collective, and its stack would then show
        # it reporting that, not where it hung.
        before = ask_stacks(list(self._ranks.values())) if msg.get("hung") else {}
        # the collectives each rank last entered, kept before the stop ends them (a hang's evidence)
        records = flight_records(list(self._ranks.values())) if msg["stacks"] else {}
        stacks = {**self.stop_ranks(grace=msg["grace"], dump=msg["stacks"]), **{r: s for r, s in before.items() if s}}
        self.emit(message(Op.STOPPED, group=msg["group"], stacks={str(r): s for r, s in stacks.items()},
                          **({"flight_recorder": records} if records else {})))

    def _spawn(self, msg: dict[str, Any]) -> None:
        # Start every rank before waiting on any: torch import dominates and runs in parallel.
        group = msg["group"]
        with self._lock:
            for rp in start_ranks(self, group, [(spec["rank"], {**msg["env"], **spec["env"]}) for spec in msg["ranks"]]):
                self._ranks[rp.rank] = rp
            self._spawned.notify_all()

    def _send_stacks(self, msg: dict[str, Any]) -> None:
        ranks = [rp for rp in list(self._ranks.values()) if rp.group == msg.get("group")]
        for rank, text in sorted(ask_stacks(ranks).items()):
            self.emit(message(Op.STACK, group=msg["group"], rank=rank, stack=text))

    def _forward(self, msg: dict[str, Any]) -> None:
        # Encode once, write the same bytes to every local rank: the payload crosses the
        # network once per node, not once per rank.
        _to_each([rp.to_rank for rp in list(self._ranks.values())], encode(msg))

    def _forward_notice(self, msg: dict[str, Any]) -> None:
        """A preemption notice on each rank's control channel, which the rank reads even during a
        call (its stdin it reads only between calls)."""
        _to_each([rp.notices for rp in list(self._ranks.values())], encode(msg))

    def _close_group(self, msg: dict[str, Any]) -> None:
        """Ask ranks to leave cleanly (destroy the process group), then make sure they did."""
        ranks = list(self._ranks.values())
        _to_each([rp.to_rank for rp in ranks], encode(message(Op.CLOSE)))
        wait_until(ranks, time.monotonic() + msg["grace"], kill=True)
        with self._lock:
            self._ranks.clear()

    def stop_ranks(self, grace: float, dump: bool = False) -> dict[int, str]:
        """Stop every rank; with `dump`, say where each was when it was stopped (rank -> stack)."""
        with self._lock:
            ranks = list(self._ranks.values())
            self._ranks.clear()
        return stop_for_good(ranks, grace, dump)


def _to_each(writers: list[FrameWriter], frame: list[Any]) -> None:
    """One encoded frame to every rank: each writer is a rank's stdin or its control channel."""
    for writer in writers:
        try:
            writer.send_encoded(frame)
        except ChannelClosed:
            pass  # its exit is reported by its own watcher


def _group_of(ranks: list[RankProcess]) -> int | None:
    """The rank group these ranks belong to, or None when they are not of one group."""
    groups = {rp.group for rp in ranks}
    return groups.pop() if len(groups) == 1 else None


class NodeLeaving(Exception):
    """SIGTERM reached the agent: the node is going away."""


def _end_on_sigterm(signum: int, frame: object) -> None:
    # Unwinds serve() through leave() and its finally, which stop the ranks.
    raise NodeLeaving("the node got SIGTERM (a scheduler's preemption, cancel or time limit, or a shutdown)")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m skytasks.node.agent")
    # Required: the controller's settings (skytasks.settings) decide, never a default repeated here.
    parser.add_argument("--heartbeat-seconds", type=float, required=True)
    parser.add_argument("--heartbeat-timeout", type=float, required=True)
    parser.add_argument("--sample-seconds", type=float, required=True)
    parser.add_argument("--heartbeat-file", default=None)
    parser.add_argument("--notice-file", default=None, help="where the node's watchdog writes a preemption notice")
    parser.add_argument("--rank-start", choices=("fork", "exec"), default="fork",
                        help="fork ranks from a warm template, or start each as a fresh interpreter")
    args = parser.parse_args(argv)
    # First, while this process has no thread: fork is safe only then.
    starter = RankStarter.fork_template() if args.rank_start == "fork" else RankStarter()
    # Frames own the real stdout; anything else printed here (a warning, a stray print) goes to
    # stderr so it cannot corrupt the stream.
    outbound = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inbound = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    # The agent never dies of SIGINT meant for the controller's terminal: the controller
    # decides when ranks stop. It does end on SIGTERM, taking its ranks with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _end_on_sigterm)
    # A stack request (SIGUSR1) can reach a rank that is still starting, before its faulthandler
    # is set up: SIGUSR1's default action would kill it, and a rank that never failed would be
    # reported as "killed by signal SIGUSR1". Ignored here, the rank inherits SIG_IGN until the
    # worker registers faulthandler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    agent = NodeAgent(inbound, outbound, args.heartbeat_seconds, args.heartbeat_timeout, args.sample_seconds,
                      args.heartbeat_file, args.notice_file, starter)
    agent.notice.take_signal()
    agent.serve()


if __name__ == "__main__":
    main()
