"""What happens to a pool and a call, as typed values.

The controller, the session and the providers say what happened with one of these, never with
prose: `observer.on_event(event)` during a call, `PoolReporter.event(event)` from a provider. Each
event renders itself (`text()`, at `LEVEL`) for the console and the run's log, and those with a
`PREFECT_EVENT` name become a Prefect event with `payload()` (`skytasks.prefect_records` does
that), so a Prefect Automation can act on them: "notify me when a node of pool X is preempted".
Tests assert on these values, not on their wording. Standard library only.

By family: `nodes`, `pool`, `call`, `provider`; a checkpoint's in skytasks.checkpointing, a
preflight's in skytasks.preflight. Every name is here too.
"""

from skytasks.events.call import AttemptRestarted, BackendChosen, LinesDropped, RanksStillRunning, WorkdirSynced
from skytasks.events.event import Event
from skytasks.events.listening import announce, listen
from skytasks.events.nodes import NodeLost, NodePreempted, NodeReconnected, NodeReconnecting, NodeReplaced
from skytasks.events.pool import (GrowFailed, PoolAttached, PoolDown, PoolExpired, PoolGrew, PoolReleased,
                                  PoolShrank, PoolUp)
from skytasks.events.provider import ProviderNote, ProviderProgress, TeardownFailed, level_of

__all__ = ["AttemptRestarted", "BackendChosen", "Event", "GrowFailed", "LinesDropped", "NodeLost", "NodePreempted",
           "NodeReconnected", "NodeReconnecting", "NodeReplaced", "PoolAttached", "PoolDown", "PoolExpired",
           "PoolGrew", "PoolReleased", "PoolShrank", "PoolUp", "ProviderNote", "ProviderProgress",
           "RanksStillRunning", "TeardownFailed", "WorkdirSynced", "announce", "level_of", "listen"]
