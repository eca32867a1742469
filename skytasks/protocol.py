"""Every message that crosses a stream, by op: who sends it, who reads it, what it carries.

Messages are dicts with an `op` key, framed by `skytasks.wire`. Each op has one message type
(a TypedDict in `skytasks.protocol_messages`: what it carries, required or not), and both sides build messages with `message(op,
**fields)`, which refuses a missing or unknown field; no op is spelled as a string anywhere else.
`Op` is a `StrEnum`, so a member equals its wire string. Standard library only: the node side
imports this and nothing of the controller.

Timeouts and grace periods travel in the messages (STOP, CLOSE), from the controller's settings:
the node side has no defaults of its own.

Controller -> agent:
  SPAWN   group, ranks [{rank, env}], env      start a rank group's processes
  CALL    call, head, refs, blobs, attempt     relayed to every rank of the node as it arrives
  STACKS  group                                 answer with one STACK per rank (faulthandler; the
                                                straggler warning: the ranks run on)
  STOP    group, grace, stacks                  SIGTERM, then SIGKILL after grace; answer STOPPED (with
                                                `stacks`, where each rank was when it was stopped)
  CLOSE   group, grace                          ranks leave cleanly (destroy the process group)
  PREEMPTION node_rank, address, reason, deadline, at
                                                a node of the pool will be taken away: relayed to
                                                every rank (rank_info().preempted)
  PEERS   secret, address, cert, key            open the node's relay listener on `address` (the node's
                                                own, as its peers see it), for peers that prove the
                                                pool's TLS key (`cert`, `key`: PEM) and `secret`
  ROUTE   group, children [{address, port, children}]
                                                the next CALL frame also goes down this relay tree
                                                (from the controller to the first node, or from a
                                                node to its children over their peer connections)
  LINKS   children [{address, port, children}]  open the relay links to these children now, and pass
                                                each its own part of the tree: the pool's tree is
                                                known (every node's PEER_READY), so the first large
                                                call waits for no TLS handshake (from the controller
                                                to the first node, then node to node)
  HEARTBEAT got?                                both ways; never reaches the event queue. `got`: the
                                                bytes of the other side's stream read so far (an ack:
                                                the sender may drop what it keeps for a re-attach)
  LEASE   key, reattach_seconds, keep_warm_seconds, holder
                                                the agent now outlives a break of this stream: it keeps
                                                its ranks and what they send, and admits a new stream
                                                through its door (HELLO `door`) from a controller that
                                                proves `key` (the pool's, hex) for `reattach_seconds`
  END                                           stop the ranks and exit (teardown: a break is no goodbye
                                                once a LEASE came)
  RELEASE                                       the holder lets go: its ranks end, the node stays up
                                                unheld for the LEASE's keep_warm_seconds (a warm pool)
Door handshake (on a new stream through the agent's door; not counted in the resumed byte streams):
  CHALLENGE nonce, instance        agent -> controller, first
  ATTACH  proof, nonce, holder, mode, got, who   controller -> agent: proves the pool's key (resume.py).
                                   mode "resume": the same holder's broken stream goes on; "hold": a new
                                   holder takes an unheld agent (oldest waiter first), on a fresh stream
                                   counted from 0 both ways (`got` 0); "probe": state only, never admitted
  ATTACHED proof, got, state       agent -> controller: proves it too; each side then resends what it
                                   sent from the other's `got` on, and the stream goes on. `state`: pid,
                                   python, gpus, instance, door, peer_port, up_since, calls, holding
                                   ("held" | "detached" | "unheld"), holder (who, "" unheld), held_since,
                                   unheld_since?, expires_at? (epoch seconds)
  REFUSED reason, holder?, since?  agent -> controller, then the door closes. `holder`: who holds the node
                                   (LEASE/ATTACH `who`), `since` when it took it; no holder: not usable
Agent -> controller:
  HELLO   pid, python, gpus, door?, instance?   once, first: the node is ready, with its GPUs; `door`:
                                                its attach socket, `instance`: random per agent process
  PEER_READY port                               the relay listener is open on this port (0: none);
                                                read by the channel, never reaches the event queue
  OUTPUT  group, rank, stream, line             a line a rank printed (its stdout/stderr pipe)
  EXITED  group, rank, returncode, at           a rank process ended
  STACK   group, rank, stack                    one rank's stack, for STACKS
  STOPPED group, stacks {rank: stack}           the ranks of STOP are gone (stacks: empty unless asked)
  AGENT_ERROR error                             the agent failed a request; its ranks are stopped
  LEAVING reason, stacks {rank: stack}, group   the node is going away (SIGTERM); its ranks are gone
  NOTICE  reason, deadline, at                  the node will be taken away (SIGUSR2 from a scheduler,
                                                a spot interruption): it still runs until then
  RESOURCES group, samples {rank: figures}      every few seconds while ranks run: CPU, RSS, GPU
Rank -> controller (each frame stamped with the rank's `group` and `rank`; its agent passes the
  frames on as their bytes, never unpickled there):
  JOINING                                       entering init_process_group
  READY   pid                                   rendezvous done (or skipped), waiting for calls
  LOG     level, logger, line                   a logging record
  REPORT  metrics                               skytasks.report(...)
  RESULT  call, value, started, ended           the call's return value (out-of-band buffers)
  FAILED  call, type, message, traceback, exception, started, ended
Rank -> agent (not relayed; the frame's TO_AGENT flag says so): NOTICE reason, deadline, at: SIGUSR2
  reached the rank itself; the agent makes it the node's NOTICE, so every rank of every node and
  the controller hear it.
Controller -> rank (through the agent): CALL, CLOSE, PREEMPTION.
Agent -> rank, on its control channel:
  SHARED  token                                 with one file descriptor beside it (SCM_RIGHTS): the
                                                memory file of a large buffer of the next CALL, which
                                                names it by `token` in the frame (wire.BY_REF)
Made on the controller, never sent:
  LOST    reason                                a stream closed or fell silent
  RECONNECTING reason, seconds                  a node's stream broke; re-attaching for up to `seconds`
  RECONNECTED down_seconds                      the node's stream was re-attached; nothing was lost
"""

import types
from enum import StrEnum
from typing import Any, Callable, NotRequired, Union, get_args, get_origin, get_type_hints

# Each op's message type (what it carries) lives in protocol_messages; named here too, as always.
from skytasks.protocol_messages import (AgentError, Attach, Attached, Call, Challenge, Close, End, Exited,
                                        Failed, Heartbeat, Hello, Joining, Lease, Leaving, Links, Log, Lost,
                                        Notice, Output, PeerReady, Peers, Preemption, Ready, Reconnected,
                                        Reconnecting, Refused, Release, Report, Resources, Result, Route, Shared,
                                        Spawn, Stack, Stacks, Stop, Stopped)


class Op(StrEnum):
    SPAWN = "spawn"
    CALL = "call"
    STACKS = "stacks"
    STOP = "stop"
    CLOSE = "close"
    PREEMPTION = "preemption"
    HEARTBEAT = "heartbeat"
    PEERS = "peers"
    ROUTE = "route"
    LINKS = "links"
    HELLO = "hello"
    PEER_READY = "peer_ready"
    OUTPUT = "output"
    EXITED = "exited"
    STACK = "stack"
    STOPPED = "stopped"
    AGENT_ERROR = "agent_error"
    LEAVING = "leaving"
    NOTICE = "notice"
    RESOURCES = "resources"
    JOINING = "joining"
    READY = "ready"
    LOG = "log"
    REPORT = "report"
    RESULT = "result"
    FAILED = "failed"
    LOST = "lost"
    SHARED = "shared"
    LEASE = "lease"
    END = "end"
    RELEASE = "release"
    CHALLENGE = "challenge"
    ATTACH = "attach"
    ATTACHED = "attached"
    REFUSED = "refused"
    RECONNECTING = "reconnecting"
    RECONNECTED = "reconnected"


# What shows a call is not hung (with hang_timeout_seconds): a rank starting, writing or finishing.
SIGNS_OF_PROGRESS = frozenset({Op.OUTPUT, Op.LOG, Op.REPORT, Op.RESULT, Op.READY, Op.JOINING})
# What a rank sends (through its agent), stamped with its rank: only a rank of that node may send them.
RANK_MESSAGES = frozenset({Op.OUTPUT, Op.EXITED, Op.STACK, Op.JOINING, Op.READY, Op.LOG, Op.REPORT, Op.RESULT,
                           Op.FAILED})
# A node itself failed: the root cause, not the ranks it took with it.
NODE_FAILURES = frozenset({Op.LOST, Op.AGENT_ERROR, Op.LEAVING})


MESSAGES: dict[Op, type] = {
    Op.SPAWN: Spawn, Op.CALL: Call, Op.STACKS: Stacks, Op.STOP: Stop, Op.CLOSE: Close, Op.HEARTBEAT: Heartbeat,
    Op.HELLO: Hello, Op.OUTPUT: Output, Op.EXITED: Exited, Op.STACK: Stack, Op.STOPPED: Stopped,
    Op.AGENT_ERROR: AgentError, Op.LEAVING: Leaving, Op.NOTICE: Notice, Op.PREEMPTION: Preemption,
    Op.RESOURCES: Resources, Op.JOINING: Joining, Op.READY: Ready, Op.LOG: Log,
    Op.REPORT: Report, Op.RESULT: Result, Op.FAILED: Failed, Op.LOST: Lost,
    Op.PEERS: Peers, Op.ROUTE: Route, Op.LINKS: Links, Op.PEER_READY: PeerReady, Op.SHARED: Shared,
    Op.LEASE: Lease, Op.END: End, Op.RELEASE: Release, Op.CHALLENGE: Challenge, Op.ATTACH: Attach,
    Op.ATTACHED: Attached, Op.REFUSED: Refused, Op.RECONNECTING: Reconnecting, Op.RECONNECTED: Reconnected,
}
_ADDED_ON_THE_WAY = frozenset({"channel"})
Fits = Callable[[Any], bool]
# op -> (required, allowed, each field's type check), made on first use
_FIELDS: dict[Op, tuple[frozenset[str], frozenset[str], dict[str, Fits]]] = {}
_BYTES = (bytes, bytearray, memoryview)  # a large payload arrives as the buffer it was read into


def _fits(kind: Any) -> Fits:
    """Whether a value is of `kind`, as the message types spell it (what a frame can carry: plain
    data). Numbers are exact: a bool is no int, and a float field takes an int."""
    if kind is Any:
        return lambda v: True
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        parts = [_fits(a) for a in args]
        return lambda v: any(p(v) for p in parts)
    if kind is type(None):
        return lambda v: v is None
    if kind is bool:
        return lambda v: type(v) is bool
    if kind is int:
        return lambda v: type(v) is int
    if kind is float:
        return lambda v: type(v) in (int, float)
    if kind is str:
        return lambda v: type(v) is str
    if kind is bytes:
        return lambda v: isinstance(v, _BYTES)
    if origin is list:
        item = _fits(args[0]) if args else _fits(Any)
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict:
        key, value = (_fits(args[0]), _fits(args[1])) if args else (_fits(Any), _fits(Any))
        return lambda v: type(v) is dict and all(key(k) and value(x) for k, x in v.items())
    raise TypeError(f"no check for {kind!r} in a message type")  # a new field's type: teach _fits


def _fields(op: Op) -> tuple[frozenset[str], frozenset[str], dict[str, Fits]]:
    if op not in _FIELDS:
        kind = MESSAGES[op]
        hints = get_type_hints(kind)
        fits = {name: _fits(_unwrapped(h)) for name, h in hints.items()}
        _FIELDS[op] = (frozenset(getattr(kind, "__required_keys__")), frozenset(hints), fits)  # a TypedDict's keys
    return _FIELDS[op]


def _unwrapped(hint: Any) -> Any:
    return get_args(hint)[0] if get_origin(hint) is NotRequired else hint


def message(op: Op, **fields: Any) -> dict[str, Any]:
    """The message for `op`, with exactly its fields (a missing or unknown one is a bug: raised)."""
    check({"op": op, **fields})
    return {"op": op, **fields}


def check(msg: dict[str, Any]) -> None:
    """Raise ValueError unless `msg` is a well-formed message of its op: a dict, a known op, its
    fields all there, none unknown, each of its type. What a node sends is read through this
    (controller/channel.py), so a malformed or hostile message is an error naming the node, never
    a KeyError or TypeError deep in the controller."""
    if type(msg) is not dict:
        raise ValueError(f"not a skytasks message: a {type(msg).__name__}")
    op_name = msg.get("op")
    try:
        op = Op(op_name) if type(op_name) is str or isinstance(op_name, Op) else None
    except ValueError:
        op = None
    if op is None:
        raise ValueError(f"not a skytasks message: op {op_name!r:.80}")
    required, allowed, fits = _fields(op)
    keys = set(msg) - {"op"} - _ADDED_ON_THE_WAY
    if missing := required - keys:
        raise ValueError(f"{op}: missing {sorted(missing)}")
    if unknown := keys - allowed:
        raise ValueError(f"{op}: unknown {sorted(map(repr, unknown))[:10]}")
    for name in keys:
        if not fits[name](msg[name]):
            raise ValueError(f"{op}: {name} is a {type(msg[name]).__name__}, not a {_hint_text(op, name)}")


def _hint_text(op: Op, name: str) -> str:
    hint = _unwrapped(get_type_hints(MESSAGES[op])[name])
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
