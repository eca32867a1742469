"""provider="local": node agents as processes of this machine, reached over pipes: forked
from the controller's fork server (`forked_agents`), or started fresh where it cannot serve."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

from skytasks.devices import split_local_gpus, visible_gpus
from skytasks.pool_spec import PoolSpec
from skytasks.providers import NodeLink, NodeProvider, agent_args
from skytasks.node.rank_template import torch_import_env
from skytasks.node.ports import free_port
from skytasks.providers.local.forked_agents import AgentProcess, agent_process
from skytasks.providers.processes import LOST_WAIT_SECONDS, end_child
from skytasks.providers.reporting import PoolReporter
from skytasks.settings import settings
from skytasks.wire import widen_pipe

LOOPBACK = "127.0.0.1"


class LocalProvider(NodeProvider):
    reshape_is_cheap = True  # processes on this machine: a call of another shape starts its own
    runs_on_this_machine = True  # a workdir is used in place
    gpus_from_config = False

    def __init__(self, spec: PoolSpec, reporter: PoolReporter | None = None):
        self._spec = spec
        self._procs: dict[int, subprocess.Popen | AgentProcess] = {}  # node id -> its agent
        self._next_id = spec.nodes  # the ids of nodes grown later
        self._preload: tuple[str, ...] = ()

    def preload(self, modules: tuple[str, ...]) -> None:
        """The session is for ranks that import these ("torch"): its agents are forked from a
        server that imported them already, so no node imports them again (see forked_agents)."""
        self._preload = modules

    def start(self) -> list[NodeLink]:
        self._gpus = visible_gpus()
        self._slices = split_local_gpus(self._gpus, self._spec.nodes, self._spec.procs_per_node)
        # The agent needs the controller's import path as much as its ranks do: skytasks may be
        # importable here only through sys.path (a checkout, run from another directory).
        user_path = self._spec.env.get("PYTHONPATH")
        self._path = os.pathsep.join(p for p in (user_path, _controller_path()) if p)
        try:  # an elastic local pool gets its most: this machine has no capacity to run out of
            return [self._start_node(node_id) for node_id in range(self._spec.nodes)]
        except BaseException:
            self.stop()
            raise

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
            end_child(old)

    def _start_node(self, node_id: int) -> NodeLink:
        env = {**os.environ, "PYTHONPATH": self._path}
        if self._gpus:  # each node sees its own slice; LOCAL_RANK indexes into it, as torchrun's
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._slices[node_id % len(self._slices)])
        args = agent_args()
        proc: subprocess.Popen | AgentProcess | None = None
        if settings().rank_start == "fork":  # "exec": every process a fresh interpreter
            # The ranks' torch variables are the agent's and the pool's own `env`.
            torch_env = torch_import_env({**env, **self._spec.env}) if "torch" in self._preload else None
            proc = agent_process(args, env, torch_env)
        if proc is None:
            proc = subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                # A session of its own: Ctrl-C at the terminal reaches the controller only,
                # which then stops the ranks in order instead of everything dying at once.
                start_new_session=True,
            )
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
            end_child(p)


def _controller_path() -> str:
    """The controller's import path, so a function that imports the user's own modules (a
    sibling file of the flow) finds them on a local rank too."""
    parts = [os.path.abspath(p or ".") for p in sys.path]
    return os.pathsep.join(dict.fromkeys(p for p in parts if os.path.isdir(p)))
