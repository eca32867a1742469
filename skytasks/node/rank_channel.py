"""What a rank sends its agent, on its control channel: every frame stamped with the rank and its
group (so the agent passes it on to the controller as its bytes), its stdout and stderr as whole
lines, and its Python logging records with their levels."""

from __future__ import annotations

import io
import logging
import os
from typing import Any

from skytasks.protocol import Op, message
from skytasks.wire import ChannelClosed, FrameWriter


class RankWriter(FrameWriter):
    """The rank's channel to its agent. Every frame carries the rank and its group, so the agent
    passes it on to the controller as it is, without unpickling it (`rank_process`)."""

    def __init__(self, stream: Any, rank: int, group: int):
        super().__init__(stream)
        self._stamp = {"rank": rank, "group": group}

    def send(self, msg: dict[str, Any], flags: int = 0) -> None:
        super().send({**msg, **self._stamp}, flags)


class ShipLogRecords(logging.Handler):
    """Sends Python logging records to the controller with their level intact."""

    def __init__(self, out: FrameWriter):
        super().__init__(logging.NOTSET)
        self._out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._out.send(message(Op.LOG, level=record.levelno, logger=record.name, line=self.format(record)))
        except Exception:  # noqa: BLE001 - a logging handler must never raise into user code
            pass


class RankStream(io.TextIOBase):
    """sys.stdout/sys.stderr of a rank: whole lines go out as frames on the same channel as the
    result, so every line printed before `return` reaches the controller before the result.
    (Output written straight to fd 1/2 by C code still arrives, through the agent's pipes.)"""

    def __init__(self, out: FrameWriter, name: str):
        self._out, self._name, self._buf = out, name, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buf += text
        if "\n" in self._buf:
            *lines, self._buf = self._buf.split("\n")
            for line in lines:
                self._send(line)
        return len(text)

    def flush(self) -> None:
        if self._buf:
            line, self._buf = self._buf, ""
            self._send(line)

    def _send(self, line: str) -> None:
        try:
            self._out.send(message(Op.OUTPUT, stream=self._name, line=line))
        except ChannelClosed:
            os._exit(1)

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def isatty(self) -> bool:
        return False
