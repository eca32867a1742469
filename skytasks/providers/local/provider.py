"""provider="local": node agents as processes of this machine, reached over pipes: forked
from the controller's fork server (`forked_agents`), or started fresh where it cannot serve."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Any

from skytasks.devices import split_local_gpus, visible_gpus
from skytasks.pool_spec import PoolSpec
from skytasks.errors import NodeGone, PoolGone
from skytasks.providers import Capabilities, NodeLink, NodeProvider, agent_args
from skytasks.node.rank_template import SCRIPT_ENV, torch_import_env, torchrun_threads
from skytasks.node import scratch
from skytasks.node.ports import free_port
from skytasks.providers.local.forked_agents import AdoptedAgent, AgentProcess, agent_process, boot_id, started_at
from skytasks.providers.processes import LOST_WAIT_SECONDS, end_child
from skytasks.event_bus import PoolReporter
from skytasks.settings import settings
from skytasks.wire import widen_pipe

LOOPBACK = "127.0.0.1"


class LocalProvider(NodeProvider):
    # Processes on this machine: a call of another shape starts its own, a workdir is used in place.
    capabilities = Capabilities(reshape_is_cheap=True, runs_on_this_machine=True)

    def __init__(self, spec: PoolSpec, reporter: PoolReporter | None = None):
        self._spec = spec
        self._procs: dict[int, subprocess.Popen | AgentProcess | AdoptedAgent] = {}  # node id -> its agent
        self._next_id = spec.nodes  # the ids of nodes grown later
        self._preload: tuple[str, ...] = ()
        # A warm pool's agents outlive this process: their stderr is a file of the pool's (in a
        # private folder), never this process's terminal or a pipe someone waits to see closed.
        self._log_dir = ""
        self._links: list[NodeLink] = []  # streams opened through doors: let go at leave_running

    def preload(self, modules: tuple[str, ...]) -> None:
        """The session is for ranks that import these ("torch"; "torchrun": they run torchrun
        scripts, with its thread default): its agents are forked from a server that imported
        them already, so no node imports them again (see forked_agents)."""
        self._preload = modules

    def start(self) -> list[NodeLink]:
        self._setup()
        if self._spec.keep_warm_minutes > 0:
            self._log_dir = tempfile.mkdtemp(prefix=WARM_LOG_PREFIX)
        try:  # an elastic local pool gets its most: this machine has no capacity to run out of
            return [self._start_node(node_id) for node_id in range(self._spec.nodes)]
        except BaseException:
            self.stop()
            raise

    def _setup(self) -> None:
        self._gpus = visible_gpus()
        self._slices = split_local_gpus(self._gpus, self._spec.nodes, self._spec.procs_per_node)
        # The agent needs the controller's import path as much as its ranks do: skytasks may be
        # importable here only through sys.path (a checkout, run from another directory).
        user_path = self._spec.env.get("PYTHONPATH")
        self._path = os.pathsep.join(p for p in (user_path, _controller_path()) if p)

    def replace(self, node_id: int) -> NodeLink:
        """A new agent for a node that was lost (its agent died or fell silent)."""
        self.release(node_id)
        return self._start_node(node_id)

    def grow(self, count: int) -> list[NodeLink]:
        """This machine always has room for more processes."""
        links = []
        for _ in range(count):
            links.append(self._start_node(self._next_id))
            self._next_id += 1
        return links

    def release(self, node_id: int) -> None:
        old = self._procs.pop(node_id, None)
        if old is not None:
            _end(old)

    def _start_node(self, node_id: int) -> NodeLink:
        env = {**os.environ, "PYTHONPATH": self._path}
        if self._gpus:  # each node sees its own slice; LOCAL_RANK indexes into it, as torchrun's
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._slices[node_id % len(self._slices)])
        args = agent_args()
        proc: subprocess.Popen | AgentProcess | None = None
        stderr = self._agent_log(node_id)
        if stderr is not None:  # a warm pool's: its agent removes it if the pool ends by itself
            env[scratch.WARM_LOG_ENV] = self._agent_log_path(node_id)
        try:
            if settings().rank_start == "fork":  # "exec": every process a fresh interpreter
                # The ranks' torch variables are the agent's and the pool's own `env`, and for a
                # torchrun script's ranks torchrun's threads, as each rank's environment gets them.
                ranks_env = {**env, **self._spec.env}
                if "torchrun" in self._preload:
                    ranks_env |= torchrun_threads({**ranks_env, SCRIPT_ENV: "1",
                                                   "LOCAL_WORLD_SIZE": str(self._spec.procs_per_node)})
                torch_env = torch_import_env(ranks_env) if "torch" in self._preload else None
                proc = agent_process(args, env, torch_env, stderr=2 if stderr is None else stderr)
            if proc is None:
                proc = subprocess.Popen(
                    [sys.executable, *args],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    env=env,
                    # A session of its own: Ctrl-C at the terminal reaches the controller only,
                    # which then stops the ranks in order instead of everything dying at once.
                    start_new_session=True,
                )
        finally:
            if stderr is not None:
                os.close(stderr)
        self._procs[node_id] = proc
        widen_pipe(proc.stdin)
        widen_pipe(proc.stdout)
        return NodeLink(
            node_rank=node_id,
            address=LOOPBACK,
            inbound=proc.stdout,  # type: ignore[arg-type]
            outbound=proc.stdin,  # type: ignore[arg-type]
            env={"PYTHONPATH": self._path},
            machine="this machine",
            close=functools.partial(end_child, proc),
            close_lost=functools.partial(end_child, proc, wait=LOST_WAIT_SECONDS),  # a frozen agent: not 10 s
        )

    def _agent_log_path(self, node_id: int) -> str:
        return os.path.join(self._log_dir, f"node{node_id}.log")

    def _agent_log(self, node_id: int) -> int | None:
        if not self._log_dir:
            return None
        return os.open(self._agent_log_path(node_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    # -- warm pools: the agents are daemons of this machine, reached through their doors ----------

    def handle(self) -> dict[str, Any]:
        """Which processes the pool's agents are (pid and start time: a pid reused by another
        process is never taken for an agent), on which boot of this machine."""
        return {"machine": boot_id(), "log_dir": self._log_dir, "next_id": self._next_id,
                "nodes": {str(node_id): {"pid": proc.pid, "started": started_at(proc.pid)}
                          for node_id, proc in self._procs.items()}}

    def adopt(self, handle: dict[str, Any]) -> None:
        if handle.get("machine") != boot_id():
            raise PoolGone("the warm pool's agents ran on another boot of this machine")
        self._setup()
        self._log_dir = str(handle.get("log_dir") or self._log_dir)
        self._next_id = max(int(handle.get("next_id", 0)), self._next_id)
        for node_id, agent in handle.get("nodes", {}).items():
            self._procs[int(node_id)] = AdoptedAgent(int(agent["pid"]), agent.get("started"))
        if all(proc.poll() is not None for proc in self._procs.values()):
            raise PoolGone("none of the warm pool's agents runs any more")

    def reattach(self, node_id: int, door: str, timeout: float) -> NodeLink:
        """A stream to a running local agent: its door's socket, straight (no process between)."""
        proc = self._procs.get(node_id)
        if proc is None or proc.poll() is not None:
            raise NodeGone(f"its agent (pid {getattr(proc, 'pid', '?')}) has ended")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(door)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise NodeGone(f"nothing answers at its door: {exc}") from None
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        inbound = os.fdopen(os.dup(sock.fileno()), "rb", buffering=0)
        outbound = os.fdopen(os.dup(sock.fileno()), "wb")
        sock.close()
        link = NodeLink(node_rank=node_id, address=LOOPBACK, inbound=inbound, outbound=outbound,
                        env={"PYTHONPATH": self._path}, machine="this machine", node_id=node_id)
        link.close = functools.partial(_close_files, inbound, outbound)
        self._links.append(link)
        return link

    def leave_running(self) -> None:
        """The agents stay (their keep-warm clock ends them); this process only lets go of its
        ends of their streams."""
        procs, self._procs = self._procs, {}
        for proc in procs.values():
            _close_files(proc.stdin, proc.stdout)
        links, self._links = self._links, []
        for link in links:
            link.close()

    def abort(self) -> None:
        """Nothing to cut short: local agents start in milliseconds."""

    def free_port(self, head: int) -> int:
        # Chosen per rank group on loopback, never a fixed 29500: two pools (or a torchrun next
        # door) on one machine do not collide.
        return free_port(LOOPBACK)

    def prepare_workdir(self, request) -> tuple[str, str | None]:
        return str(request.root), None  # this machine has it: used in place

    def stop(self) -> None:
        procs, self._procs = self._procs, {}
        for p in procs.values():
            _end(p)
        links, self._links = self._links, []
        for link in links:
            link.close()
        if self._log_dir and is_own_log_dir(self._log_dir):
            shutil.rmtree(self._log_dir, ignore_errors=True)


WARM_LOG_PREFIX = scratch.WARM_LOG_DIR_PREFIX


def is_own_log_dir(path: str) -> bool:
    """Whether `path` is verifiably a warm pool's log folder as `start` made it (mkdtemp: in this
    machine's temporary folder, named so, a real folder, this user's, 0700). A warm pool's record
    names it and a record is no proof: nothing else is ever removed on its word."""
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        return False
    parent, name = os.path.split(os.path.normpath(path))
    return (os.path.realpath(parent) == os.path.realpath(tempfile.gettempdir()) and name.startswith(WARM_LOG_PREFIX)
            and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700)


def _end(proc: subprocess.Popen | AgentProcess | AdoptedAgent) -> None:
    proc.end() if isinstance(proc, AdoptedAgent) else end_child(proc)


def _close_files(*files: Any) -> None:
    for f in files:
        try:
            if f is not None:
                f.close()
        except OSError:
            pass


def _controller_path() -> str:
    """The controller's import path, so a function that imports the user's own modules (a
    sibling file of the flow) finds them on a local rank too."""
    parts = [os.path.abspath(p or ".") for p in sys.path]
    return os.pathsep.join(dict.fromkeys(p for p in parts if os.path.isdir(p)))
