"""What each op's message carries: one TypedDict per op, its fields required or not.

`skytasks.protocol` maps each `Op` to its type here (`MESSAGES`) and checks every message against
it, both ways; the ops themselves, who sends each and why, are described there. Standard library
only: the node side imports this too.
"""

from typing import Any, NotRequired, TypedDict


# -- one message type per op -------------------------------------------------------------------
# `group` and `rank` on a rank's messages are stamped by the rank as it sends them; `channel` is
# added on the controller to everything a node sends (see controller/channel.py).

class Spawn(TypedDict):
    group: int
    ranks: list[dict[str, Any]]  # [{rank, env}]
    env: dict[str, str]


class Call(TypedDict):
    call: int
    head: Any
    refs: list[Any]
    blobs: dict[str, Any]
    attempt: int


class Stacks(TypedDict):
    group: int


class Stop(TypedDict):
    group: int | None
    grace: float
    stacks: bool  # dump each rank's stack as it is stopped, and send them back with STOPPED
    hung: NotRequired[bool]  # a hang: each rank's stack asked first, before any rank anywhere is stopped


class Close(TypedDict):
    group: NotRequired[int]  # the rank's copy carries none: it has one group
    grace: NotRequired[float]  # the agent's: how long ranks get to leave before they are killed


class Preemption(TypedDict):
    node_rank: int
    address: str
    reason: str
    deadline: float | None  # epoch seconds when the node goes, when the notice says
    at: float  # when the node's agent heard it


class Heartbeat(TypedDict):
    got: NotRequired[int]  # bytes of the other side's stream read so far (resume.py); none before a LEASE


class Peers(TypedDict):
    # The pool's own, handed over this authenticated channel only (never a file, command line,
    # environment or log): the HMAC key of the peer challenge (hex), and the certificate every
    # agent presents and trusts alone, with its key (PEM; both "" with SKYTASKS_PEER_TLS=0).
    secret: str
    address: str
    cert: str
    key: str


class Route(TypedDict):
    group: int  # the CALL is for this group's ranks: a node waits until it has spawned them
    children: list[dict[str, Any]]  # [{address, port, children}]


class Links(TypedDict):
    children: list[dict[str, Any]]  # [{address, port, children}], as ROUTE's


class PeerReady(TypedDict):
    port: int


class Hello(TypedDict):
    pid: int
    python: str
    gpus: list[str]
    door: NotRequired[str]  # the agent's attach socket (AF_UNIX path), for node/attach.py's CLIENT
    instance: NotRequired[str]  # random per agent process: a re-attach must reach this very agent


class Lease(TypedDict):
    key: str  # the pool's key (hex): only a controller that proves it may attach (resume.py)
    reattach_seconds: float  # how long the agent waits for a new stream after a break; 0: no waiting
    keep_warm_seconds: float  # phase 2 (warm pools); 0: none
    holder: str  # random per controller session: who holds the node
    who: NotRequired[str]  # the holder in words (a flow run, pid, host): what a REFUSED names to others


class End(TypedDict):
    pass


class Release(TypedDict):
    pass


class Challenge(TypedDict):
    nonce: str  # hex, fresh per handshake
    instance: str


class Attach(TypedDict):
    proof: str  # hex, resume.controller_proof
    nonce: str  # the controller's own, hex
    holder: str
    mode: str  # "resume" (phase 1) | "hold" | "probe" (phase 2)
    got: int  # bytes of the agent's stream the controller read so far
    who: str  # the holder in words, for whoever waits


class Attached(TypedDict):
    proof: str  # hex, resume.agent_proof
    got: int  # bytes of the controller's stream the agent read so far
    state: dict[str, Any]  # pid, python, gpus, peer_port, ...


class Refused(TypedDict):
    reason: str
    holder: NotRequired[str]  # who holds the node (only said to a controller that proved the key)
    since: NotRequired[float]


class Reconnecting(TypedDict):
    reason: str
    seconds: float


class Reconnected(TypedDict):
    down_seconds: float


class _Relayed(TypedDict):
    group: NotRequired[int | None]
    rank: NotRequired[int]


class Output(_Relayed):
    stream: str
    line: str


class Exited(_Relayed):
    returncode: int
    at: float


class Stack(_Relayed):
    stack: str


class Stopped(TypedDict):
    group: int | None
    stacks: dict[str, str]  # rank -> its stack as it was stopped (STOP's `stacks`)
    flight_recorder: NotRequired[dict[str, str]]  # rank -> JSON of the collectives it last entered (a hang's)


class AgentError(TypedDict):
    error: str


class Leaving(TypedDict):
    reason: str
    stacks: dict[str, str]  # rank (as text) -> its last stack
    group: int | None


class Notice(TypedDict):
    reason: str
    deadline: float | None
    at: float


class Resources(TypedDict):
    group: int | None
    samples: dict[str, dict[str, float]]  # rank (as text) -> rss, host_memory, cpu, gpu_memory, ...


class Joining(_Relayed):
    pass


class Ready(_Relayed):
    pid: int


class Log(_Relayed):
    level: int
    logger: str
    line: str


class Report(_Relayed):
    metrics: dict[str, Any]


class Result(_Relayed):
    call: int
    value: Any
    started: float
    ended: float
    # The rank's own figures for the call (getrusage): peak RSS bytes and CPU seconds, so a call
    # shorter than the agent's sampling interval still says what it used.
    used: NotRequired[dict[str, float]]


class Failed(_Relayed):
    call: int | None  # None: before any call (the process group did not form)
    type: str
    message: str
    traceback: str
    exception: bytes | None
    started: float
    ended: float
    used: NotRequired[dict[str, float]]


class Lost(TypedDict):
    reason: str


class Shared(TypedDict):
    token: int
