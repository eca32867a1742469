"""A new stream to a node's running agent, through its door, over a remote provider's way in:
`python -c attach.CLIENT DOOR` (sealed where the stream is not private: the sealed client, and a
fresh agreement for each new stream). The provider only opens the way in (`OpenAttach`)."""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol, TypeVar

from skytasks import stream_seal
from skytasks.node import attach
from skytasks.providers.remote.agent_start import AgentWay
from skytasks.providers.remote.bridge import await_answer


class AttachWay(AgentWay, Protocol):
    def exit_code(self) -> Optional[int]:
        """The attach's status once it ended, else None (3: no agent behind the door)."""


Way = TypeVar("Way", bound=AttachWay)
OpenAttach = Callable[[list[str]], Way]  # opens the way in running the attach's argv


def reach_agent(open_attach: OpenAttach[Way], python: str, door: str, timeout: float, where: str,
                *, sealed: bool) -> tuple[Way, Optional[stream_seal.SealedEnds]]:
    """The way in to the agent once its door spoke, and the seal's plain ends where sealed.
    NodeGone when nothing is behind the door (the agent ended); TimeoutError or ConnectionError
    otherwise (tried again later). On an error the way in is closed."""
    started = time.monotonic()
    seal = stream_seal.identity() if sealed else None
    way = open_attach(stream_seal.attach_argv(python, seal.pin, door) if seal else attach.argv(python, door))
    try:
        await_answer(way.inbound, timeout - (time.monotonic() - started), way.exit_code, way.last_words, where)
        if seal is None:
            return way, None
        return way, stream_seal.seal_controller_end(way.inbound, way.outbound, seal,
                                                    max(1.0, timeout - (time.monotonic() - started)), way.close)
    except BaseException:
        way.close()
        raise
