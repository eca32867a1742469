"""The one agent starter every remote provider drives: a node's bootstrap, from its stream's seal
to the agent running, over whatever way in the provider has (an SSH channel, an srun step, a pod
exec): the provider only opens it (`OpenAgent`) and hands over its ends (`AgentWay`).

The bootstrap (`bootstrap`, standard library only, run as `python -c CODE DIGEST SIZE AGENT...`)
is, in this order: the seal (stream_seal, where the stream is not private), the pool's `env` from
the stream (env_in, where the provider sends it that way, never on a command line), the check of
the node's Python (python_check: one line), the controller's skytasks "have" or "need"
(package_in), then the agent. `AgentStarter.start` is the controller's side of the same order: it
reads the check's line and turns it into the verdict (PoolStartError naming the field to fix, and
before any package or rank), and sends the package only on "need".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Callable, Mapping, Optional, Protocol, TypeVar

from skytasks import stream_seal
from skytasks.errors import PoolStartError
from skytasks.providers.remote import env_in, python_check
from skytasks.providers.remote.package_in import PACKAGE_IN, package_bundle, read_line

# The agent in a process of its own, as `python -m` runs it: sys.argv[3:] is `-m skytasks.node.agent ...`.
EXEC_AGENT = "os.execv(sys.executable, [sys.executable] + sys.argv[3:])\n"


def bootstrap(place: str, *, env: bool, then: str = "", launch: str = EXEC_AGENT) -> str:
    """A node's first code after its seal. `place` sets `home`, the folder the package goes in;
    `then` runs once it is there; `launch` starts the agent. `env`: the pool's env comes first on
    the stream (env_in: a startup variable such as LD_LIBRARY_PATH restarts this Python with it,
    before the check)."""
    return ((env_in.ENV_IN + "\n_env_in()\n") if env else "") + python_check.CHECK + PACKAGE_IN + r"""
import os, sys
if not _python_ok():
    sys.exit(3)
""" + place + "_package_in(home, int(sys.argv[2]))\n" + then + (
        'os.environ.pop("SKYTASKS_STREAM_SEALED", None)  # the agent\'s stream is sealed; its ranks need not know\n'
    ) + launch


class AgentWay(Protocol):
    """One node's stream as its provider opened it, the bootstrap (or an attach) at its other end."""

    @property
    def inbound(self) -> BinaryIO: ...

    @property
    def outbound(self) -> BinaryIO: ...

    def close(self) -> None:
        """End the stream (and what runs it, where this end owns it)."""

    def last_words(self) -> str:
        """What the way in said as it ended, for an error ("" where it said nothing)."""


Way = TypeVar("Way", bound=AgentWay)
# Opens a node's way in running `python -c CODE ARGS...` (the provider's transport).
OpenAgent = Callable[[str, list[str]], Way]


@dataclass(frozen=True)
class NodePython:
    """The node's Python as a start's error names it: where, the command, and why it is that
    command where the user left remote_python unset."""

    where: str  # "node 0 (host)"
    command: str  # remote_python, or its default
    default_because: Optional[str] = None
    said_as: str = ""  # how the way in's own words are introduced ("srun: ")
    # The verdict on another Python or cloudpickle (the field the user fixes); remote_python's if None.
    wrong: Optional[Callable[[python_check.Found], Optional[str]]] = None

    def verdict(self, found: python_check.Found) -> Optional[str]:
        if self.wrong is not None:
            return self.wrong(found)
        return python_check.wrong_python(self.where, self.command, found, self.default_because)

    def did_not_start(self, said: str) -> str:
        return python_check.did_not_start(self.where, self.command, self.said_as + said, self.default_because)

    def cannot_import(self, found: python_check.Found) -> str:
        return python_check.cannot_import(self.where, self.command, found, self.default_because)


@dataclass
class Started:
    """A started agent's stream: the plain ends (the seal's, where sealed) and its seal."""

    inbound: BinaryIO
    outbound: BinaryIO
    sealed: Optional[stream_seal.SealedEnds]


class AgentStarter:
    """Starts node agents with one bootstrap: the controller's skytasks (tarred once per process:
    `package_bundle`) is sent only to the nodes that lack it."""

    def __init__(self, code: str, timeout: float, env: Optional[Mapping[str, str]] = None):
        self._code, self._timeout = code, timeout
        self._env = None if env is None else dict(env)
        self._bundle: tuple[bytes, str] | None = None

    def bundle(self) -> tuple[bytes, str]:
        if self._bundle is None:
            self._bundle = package_bundle()
        return self._bundle

    def start(self, open_agent: OpenAgent[Way], agent: list[str], python: NodePython,
              *, sealed: bool) -> tuple[Way, Started]:
        """The agent on one node: its way in (to end it), and its stream's plain ends (`sealed`:
        a TLS seal's, stream_seal); or PoolStartError naming what to fix, its way in closed."""
        data, digest = self.bundle()
        seal = stream_seal.identity() if sealed else None
        code = (stream_seal.node_prelude(seal.pin) if seal else "") + self._code
        way = open_agent(code, [digest, str(len(data)), *agent])
        inbound, outbound, plain = way.inbound, way.outbound, None
        if seal is not None:
            try:
                plain = stream_seal.seal_controller_end(inbound, outbound, seal, self._timeout, way.close)
            except stream_seal.SealFailed as exc:  # the node's Python did not start, most likely
                raise PoolStartError(python.did_not_start(way.last_words() or str(exc))) from None
            inbound, outbound = plain.inbound, plain.outbound
        if self._env is not None:
            try:
                outbound.write(env_in.frame(self._env))  # at once: no round trip of its own
                outbound.flush()
            except (OSError, ValueError):  # the stream ended already: its own words come below
                pass
        first = read_line(inbound, self._timeout, way.close)
        found = python_check.parse(first)
        if found is None:  # it never got to the check: the way in's own words, or what came instead
            said = way.last_words() or first.decode(errors="replace")
            way.close()
            raise PoolStartError(python.did_not_start(said))
        # Another Python (or cloudpickle) first, as it is what to fix (torch and cloudpickle go
        # into the right one); then a lack. Before the package is sent and before any rank.
        wrong = python.verdict(found)
        if wrong or found.missing:
            way.close()
            raise PoolStartError(wrong or python.cannot_import(found))
        answer = read_line(inbound, self._timeout, way.close)
        if answer == b"need\n":
            outbound.write(data)
            outbound.flush()
        elif answer != b"have\n":
            said = way.last_words() or repr(answer)
            way.close()
            raise PoolStartError(python.did_not_start(said))
        return way, Started(inbound, outbound, plain)
