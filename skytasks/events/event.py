"""What every event is: a frozen value that says itself (`text()`, at `LEVEL`), and, when it has a
`PREFECT_EVENT` name, becomes a Prefect event with `payload()`."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Event:
    """An event names how it is said on its class line, `class NodeLost(Event, level=logging.WARNING,
    prefect="skytasks.node.lost")`, and its sentence in TEXT, with its fields by name."""

    LEVEL: ClassVar[int] = logging.INFO
    PREFECT_EVENT: ClassVar[str | None] = None  # e.g. "skytasks.node.lost"; None: a log line only
    PAYLOAD: ClassVar[tuple[str, ...] | None] = None  # the fields the Prefect event carries; None: all
    # The sentence, written once with the event's fields by name ("node {node} was lost: {reason}");
    # an event whose sentence needs more than its fields writes `text()` itself.
    TEXT: ClassVar[str] = ""

    def __init_subclass__(cls, *, level: int | None = None, prefect: str | None = None,
                          payload: tuple[str, ...] | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if level is not None:
            cls.LEVEL = level
        if prefect is not None:
            cls.PREFECT_EVENT = prefect
        if payload is not None:
            cls.PAYLOAD = payload

    def text(self) -> str:
        if not self.TEXT:
            raise NotImplementedError(f"{type(self).__name__} says nothing: give it a TEXT or a text()")
        return self.TEXT.format_map(_Named(self))

    def payload(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        return fields if self.PAYLOAD is None else {k: fields[k] for k in self.PAYLOAD}


class _Named:
    """An event's fields (and properties) by name, for its TEXT."""

    def __init__(self, event: Event):
        self.event = event

    def __getitem__(self, name: str) -> Any:
        return getattr(self.event, name)


@dataclass(frozen=True)
class Said(Event):
    """An event that is its sentence, already written where it happened."""

    message: str

    def text(self) -> str:
        return self.message


def counted(count: int, thing: str) -> str:
    """'1 node', '2 nodes'."""
    return f"{count} {thing}{'s' * (count != 1)}"
