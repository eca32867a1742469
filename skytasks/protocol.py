"""Every message that crosses a stream, by op: who sends it, who reads it, what it carries.

Messages are dicts with an `op` key, framed by `skytasks.wire`. `Op` is a `StrEnum`, so a member
equals its wire string: the node side (kept free of the controller's imports) may compare plain
strings, and `wire.encode` writes plain strings.

Controller -> agent:
  SPAWN   group, ranks [{rank, env}], env      start a rank group's processes
  CALL    call, head, refs, blobs, attempt     relayed to every rank of the node as it arrives
  STACKS  group                                 answer with one STACK per rank (faulthandler)
  STOP    group, grace                          SIGTERM, then SIGKILL after grace; answer STOPPED
  CLOSE   group                                 ranks leave cleanly (destroy the process group)
  HEARTBEAT                                     both ways; never reaches the event queue
Agent -> controller:
  HELLO   pid, python, gpus                     once, first: the node is ready, with its GPUs
  OUTPUT  group, rank, stream, line             a line a rank printed (its stdout/stderr pipe)
  EXITED  group, rank, returncode, at           a rank process ended
  STACK   group, rank, stack                    one rank's stack, for STACKS
  STOPPED group                                 the ranks of STOP are gone
  AGENT_ERROR error                             the agent failed a request; its ranks are stopped
  LEAVING reason, stacks {rank: stack}, group   the node is going away (SIGTERM); its ranks are gone
Rank -> controller (relayed by the agent, which adds `group` and `rank`):
  JOINING                                       entering init_process_group
  READY   pid                                   rendezvous done (or skipped), waiting for calls
  LOG     level, logger, line                   a logging record
  REPORT  metrics                               skytasks.report(...)
  RESULT  call, value, started, ended           the call's return value (out-of-band buffers)
  FAILED  call, type, message, traceback, exception, started, ended
Controller -> rank (through the agent): CALL, CLOSE.
Made on the controller, never sent:
  LOST    reason                                a stream closed or fell silent
"""

from __future__ import annotations

from enum import StrEnum


class Op(StrEnum):
    SPAWN = "spawn"
    CALL = "call"
    STACKS = "stacks"
    STOP = "stop"
    CLOSE = "close"
    HEARTBEAT = "heartbeat"
    HELLO = "hello"
    OUTPUT = "output"
    EXITED = "exited"
    STACK = "stack"
    STOPPED = "stopped"
    AGENT_ERROR = "agent_error"
    LEAVING = "leaving"
    JOINING = "joining"
    READY = "ready"
    LOG = "log"
    REPORT = "report"
    RESULT = "result"
    FAILED = "failed"
    LOST = "lost"


# What shows a call is not hung (with hang_timeout_seconds): a rank starting, writing or finishing.
SIGNS_OF_PROGRESS = frozenset({Op.OUTPUT, Op.LOG, Op.REPORT, Op.RESULT, Op.READY, Op.JOINING})
# A node itself failed: the root cause, not the ranks it took with it.
NODE_FAILURES = frozenset({Op.LOST, Op.AGENT_ERROR, Op.LEAVING})
