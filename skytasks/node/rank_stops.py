"""Stopping a node's ranks, and where each one was: what the agent does with many `RankProcess`es
at once (a stop, a close, a stack request). Standard library only, as the agent is."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from skytasks.node.rank_process import RankProcess
from skytasks.flight_recorder import REQUEST_OP
from skytasks.wire import ChannelClosed, encode

FLIGHT_RECORD_WAIT = 2.0  # a rank whose notices thread cannot run (the GIL held in C) is not waited for longer


def stop_and_wait(ranks: list[RankProcess], grace: float, dump: bool = False) -> dict[int, str]:
    """SIGTERM to every rank (SIGKILL with no grace), then wait for them until the grace is up.
    With `dump`, where each rank was (rank -> stack): a rank's faulthandler writes every thread's
    stack as SIGTERM reaches it, so the stop itself says where it was, read once the rank is gone
    (one signal per rank, where asking first and stopping after would take two, and a wait on each dump)."""
    for rp in ranks:
        if dump:
            rp.dump_from_here()
        rp.stop() if grace > 0 else rp.kill()
    wait_until(ranks, time.monotonic() + grace)
    if not dump:
        return {}
    stacks = {rp.rank: rp.last_stack() for rp in ranks}
    # A rank still running with no dump took SIGTERM itself (Lightning's trainer does, and does
    # not stop at once): where it is, asked the usual way (SIGUSR1), before it is killed. (One
    # that dumped and is still exiting, on a loaded machine, has said where it was already.)
    stacks.update(ask_stacks([rp for rp in ranks if rp.proc.poll() is None and not stacks[rp.rank]]))
    return {rank: stack for rank, stack in sorted(stacks.items()) if stack}


def stop_for_good(ranks: list[RankProcess], grace: float, dump: bool = False) -> dict[int, str]:
    """`stop_and_wait`, then SIGKILL to each rank's whole session (stragglers and grandchildren
    included), waiting up to 5 s for each to be gone."""
    stacks = stop_and_wait(ranks, grace, dump)
    for rp in ranks:
        rp.kill()
        try:
            rp.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
    return stacks


def flight_records(ranks: list[RankProcess]) -> dict[str, str]:
    """Before ranks are stopped for a hang: each live rank's flight recorder summary (rank -> its
    JSON), asked on its control channel, which a thread of the rank reads even while its main
    thread waits in a collective. A rank that does not answer in time is left out."""
    asked = {}
    for rp in ranks:
        if rp.proc.poll() is not None:
            continue
        path = f"{rp.stack_file}.fr.json"
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        try:
            rp.notices.send_encoded(encode({"op": REQUEST_OP, "path": path}))
        except (ChannelClosed, OSError):
            continue
        asked[rp.rank] = path
    found: dict[str, str] = {}
    deadline = time.monotonic() + FLIGHT_RECORD_WAIT
    while len(found) < len(asked) and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank, path in asked.items():
            if str(rank) not in found and os.path.exists(path):
                with open(path) as f:
                    found[str(rank)] = f.read()
                os.unlink(path)
    return {rank: text for rank, text in found.items() if json.loads(text)}


def wait_until(ranks: list[RankProcess], deadline: float, kill: bool = False) -> None:
    """Wait for the ranks to end until `deadline`; with `kill`, SIGKILL those still running then."""
    for rp in ranks:
        try:
            rp.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if kill:
                rp.kill()


def ask_stacks(ranks: list[RankProcess]) -> dict[int, str]:
    """Each rank's stack, asked with SIGUSR1, all at once (each waits up to half a second for its dump)."""
    results: dict[int, str] = {}

    def one(rp: RankProcess) -> None:
        results[rp.rank] = rp.stack()

    threads = [threading.Thread(target=one, args=(rp,), daemon=True) for rp in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2.0)
    return results
