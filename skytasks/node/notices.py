"""This node's own preemption notice, as its agent hears it and says it, once, to the controller.

It comes from SIGUSR2 to the agent (SLURM's `--signal=USR2@<seconds>`, `scancel --signal=USR2`, a
preemption with `send_user_signal`), from the file a launched node's watchdog writes when the
instance metadata announces a spot interruption, or from a rank that got SIGUSR2 itself. The
controller then tells every rank of every node (`preemption`). Standard library only, as the agent is.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any, Callable

from skytasks.preemption import NOTICE_SIGNAL
from skytasks.protocol import Op, message


class NodeNotice:
    def __init__(self, emit: Callable[[dict[str, Any]], None], notice_file: str | None = None):
        self._emit = emit
        self._file = notice_file
        self._given = threading.Event()

    def give(self, reason: str, deadline: float | None = None) -> None:
        """This node will be taken away at `deadline`: the controller tells every rank, and the
        node keeps running until it goes (then LEAVING or a lost stream follows). Said once."""
        if self._given.is_set():
            return
        self._given.set()
        print(f"skytasks agent: preemption notice: {reason}", file=sys.stderr, flush=True)
        self._emit(message(Op.NOTICE, reason=reason, deadline=deadline, at=time.time()))

    def read_file(self) -> None:
        """The watchdog's word: a JSON object with `reason` and `deadline` (epoch seconds), written
        whole by a rename. Looked at every second by the agent's watch."""
        if not self._file or self._given.is_set():
            return
        try:
            with open(self._file) as f:
                notice = json.load(f)
        except (OSError, ValueError):
            return
        deadline = notice.get("deadline")
        self.give(str(notice.get("reason") or "a notice from the node's watchdog"),
                  float(deadline) if deadline is not None else None)

    def take_signal(self) -> None:
        """SIGUSR2 to the agent gives the notice."""
        def on_signal(signum: int, frame: object) -> None:
            # Given from a thread: never from inside a handler that may have interrupted a send.
            threading.Thread(target=self.give, args=(f"{signal.Signals(signum).name} reached the node agent",),
                             daemon=True).start()

        signal.signal(NOTICE_SIGNAL, on_signal)
