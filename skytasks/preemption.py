"""A preemption notice as a rank sees it: a node of the pool will be taken away soon.

The notice starts at one node: SLURM's `--signal=USR2@...` (or `scancel --signal=USR2`, or a
preemption with `PreemptParameters=send_user_signal`), a spot interruption the node's watchdog read
from the instance metadata, or anyone's SIGUSR2 to the node agent. The agent tells the controller,
the controller tells every rank of every node at once (a node's peers must save too: the group
cannot go on without it), and here it becomes:

- `rank_info().preempted`: a flag the training loop polls (a read of a module global: free);
- `on_preemption(hook)`: called once, on a background thread, with the `PreemptionNotice`;
- `Checkpointer.save_if_preempted(state, step)`: the head saves, then ends the attempt with
  `Preempted`, so the retry starts at once on the nodes that are left (or a replacement).

A rank that gets SIGUSR2 itself (SLURM signals every process of the job's steps) takes it as the
same notice for its own node. Standard library only: the rank worker imports this before torch.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

NOTICE_SIGNAL = signal.SIGUSR2  # SIGUSR1 is faulthandler's (where every rank is); SIGTERM means "now"


@dataclass(frozen=True)
class PreemptionNotice:
    node_rank: int  # the node that is going
    address: str
    reason: str
    deadline: float | None  # epoch seconds when the node goes, when the notice says
    at: float  # epoch seconds when its agent heard it

    def describe(self) -> str:
        return f"node {self.node_rank} ({self.address}) is being preempted ({self.reason}{going_at(self.deadline)})"


def going_at(deadline: float | None) -> str:
    """", going at HH:MM:SS, in Ns" for a notice that says when its node goes; "" otherwise."""
    if deadline is None:
        return ""
    return f", going at {time.strftime('%H:%M:%S', time.localtime(deadline))}, in {max(0.0, deadline - time.time()):.0f}s"


class Preempted(Exception):
    """The attempt ended because a node of the pool is being preempted, after the head saved a
    checkpoint: the retry (on the nodes that are left, or a replacement) resumes from it."""


_notice: PreemptionNotice | None = None
_hooks: list[Callable[[PreemptionNotice], object]] = []
# Set by the rank worker: passes a notice this rank got itself (SIGUSR2) to its node agent, which
# makes it the node's notice for every rank of every node and for the controller.
tell_node: Callable[[str], None] | None = None
_lock = threading.Lock()


def preemption() -> PreemptionNotice | None:
    """The notice this rank got, or None."""
    return _notice


def on_preemption(hook: Callable[[PreemptionNotice], object]) -> Callable[[PreemptionNotice], object]:
    """Call `hook(notice)` once when a notice arrives (at once if one already has), on a
    background thread: set a flag, start an async save; never a collective from there."""
    with _lock:
        _hooks.append(hook)
        notice = _notice
    if notice is not None:
        _call_hooks([hook], notice)
    return hook


def receive(notice: PreemptionNotice) -> None:
    """The first notice is kept; the hooks run once."""
    global _notice
    with _lock:
        if _notice is not None:
            return
        _notice = notice
        hooks = list(_hooks)
    _call_hooks(hooks, notice)


def _call_hooks(hooks: list[Callable[[PreemptionNotice], object]], notice: PreemptionNotice) -> None:
    def run() -> None:
        for hook in hooks:
            try:
                hook(notice)
            except Exception:  # noqa: BLE001 - a failing hook is the user's to see, not a reason to die
                import traceback

                traceback.print_exc()

    if hooks:
        threading.Thread(target=run, daemon=True, name="skytasks-preemption-hooks").start()


def _heard_here(notice: PreemptionNotice) -> None:
    receive(notice)
    if tell_node is not None:
        try:
            tell_node(notice.reason)
        except Exception:  # noqa: BLE001 - the agent is gone: its own end is the news then
            pass


def take_signal() -> None:
    """SIGUSR2 straight from a scheduler: a notice for this rank's own node (main thread only)."""
    import json
    import os

    node_rank = int(os.environ.get("NODE_RANK", "0"))
    peers = json.loads(os.environ.get("SKYTASKS_PEERS", "[]"))
    address = peers[node_rank] if node_rank < len(peers) else ""

    def on_signal(signum: int, frame: object) -> None:
        # A thread: the hooks must not run inside the signal handler, on the training loop's stack.
        reason = f"{signal.Signals(signum).name} reached rank {os.environ.get('RANK', '?')}"
        notice = PreemptionNotice(node_rank, address, reason, None, time.time())
        threading.Thread(target=_heard_here, args=(notice,), daemon=True).start()

    signal.signal(NOTICE_SIGNAL, on_signal)


def wait_for_checkpoints_within_grace() -> None:
    """The attempt is ending on a notice: the save in flight is committed first, if it can be
    before the node goes (the notice's deadline; no deadline: until it is). One that cannot is
    given up: a resume gets the previous committed checkpoint, never a half-written one."""
    import sys

    writer = sys.modules.get("skytasks.checkpointing.async_writer")
    if writer is None:
        return
    notice = _notice
    try:
        writer.wait_for_saves(notice.deadline if notice is not None else None)
    except Exception as exc:  # noqa: BLE001 - the attempt ends on Preempted anyway: said, not raised
        print(f"skytasks: {exc}", file=sys.stderr)
