"""Every event this process says, to whoever listens (`skytasks.events.listen`)."""

from __future__ import annotations

from skytasks.events.event import Event

_listeners: list[list[Event]] = []


class listen:
    """Every event this process says while the block runs, in order: pools' and calls' alike.

        with skytasks.events.listen() as heard:
            train()
        assert any(isinstance(e, NodePreempted) for e in heard)
    """

    def __enter__(self) -> list[Event]:
        self._heard: list[Event] = []
        _listeners.append(self._heard)
        return self._heard

    def __exit__(self, *exc: object) -> None:
        _listeners.remove(self._heard)


def announce(event: Event) -> None:
    """Called once per event where it is said (the console, the Prefect observer, a reporter)."""
    for heard in list(_listeners):
        heard.append(event)
