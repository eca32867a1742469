"""The job steps of a SLURM pool: one `srun --overlap` step per node running its agent, and short
steps for what a call needs on a node (a free port on the head, the workdir).

An agent's step starts with a few lines of Python that first read the pool's `env` from the
stream (one length-prefixed JSON line, `env_in`, written as the step starts): never on srun's
command line, which `ps` shows to every user of the login node and the compute node, and which
SLURM may record with the step. Only PATH (where `remote_python` is looked up) and PYTHONPATH
stay there. Then they check the node's Python can run ranks (the controller's major.minor, torch
and a compatible cloudpickle, `python_check`: one line on the stream, read before anything else),
then make sure the controller's skytasks is on the node: it answers "have" or "need" on the
stream, the controller then sends the package (a tar.gz) only when needed, and the bootstrap
unpacks it under ~/.cache/skytasks/<hash> and execs the agent. One step per node, no second round trip, and
nothing to copy on a shared home.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, BinaryIO, Callable, Optional

from skytasks import stream_seal
from skytasks.errors import PoolStartError
from skytasks.node.ports import port_snippet
from skytasks.pool_spec import PoolSpec
from skytasks.providers import NodeLink
from skytasks.providers.remote.agent_start import AgentStarter, NodePython, bootstrap
from skytasks.providers.remote.reattach import reach_agent
from skytasks.providers.remote.workdir import SentWorkdirs
from skytasks.event_bus import PoolReporter
from skytasks.providers.slurm.shell import SlurmShell, Step
from skytasks.providers.slurm.spec import SlurmSettings

# The heartbeat's folder on this node (`job.heartbeat_folders`): this user's 0700 folder of the
# job if there is one, else a new one (mkdtemp: a random name, 0700); a folder of that name that
# is a link, another user's or open to others is passed over. The agent is told the file in it.
HEARTBEAT_FOLDER = r"""
def _heartbeat_in_its_folder(argv):
    import glob, os, stat, tempfile
    if "--heartbeat-file" not in argv:
        return
    at = argv.index("--heartbeat-file") + 1
    prefix = argv[at]
    for folder in sorted(glob.glob(glob.escape(prefix) + "*")):
        st = os.lstat(folder)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700:
            break
    else:
        folder = tempfile.mkdtemp(prefix=os.path.basename(prefix), dir=os.path.dirname(prefix))
    argv[at] = os.path.join(folder, "beat")
"""

# argv: digest, bundle size, then the agent's own arguments. The env comes first on the stream,
# then the package if the answer is "need" (remote.agent_start).
BOOTSTRAP = bootstrap(HEARTBEAT_FOLDER + """os.chdir(os.path.expanduser("~"))
home = os.path.join(".cache", "skytasks", sys.argv[1])
""", env=True, then="_heartbeat_in_its_folder(sys.argv)\n")


def srun(job_id: str, node: str) -> list[str]:
    """A step of one task on one node of the job, beside the steps already running there. It gets
    the GPUs SLURM gave the job on that node (CUDA_VISIBLE_DEVICES as SLURM sets it). Unbuffered:
    the stream carries binary frames, not lines."""
    return ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            "--unbuffered", "--quiet"]


class NodeSteps:
    def __init__(self, shell: SlurmShell, spec: PoolSpec, reporter: PoolReporter):
        self._shell, self._spec, self._reporter = shell, spec, reporter
        self._python = spec.own(SlurmSettings).remote_python or "python3"
        self._python_default = None if spec.own(SlurmSettings).remote_python else "the default: python3 on the nodes' PATH"
        self._steps: dict[str, Step] = {}  # node name -> the step its stream runs in now
        # node name -> the step its agent runs in: the same as _steps' until the agent is reached
        # again by an attach step; never signalled while the agent lives (see Step.let_go).
        self._agents: dict[str, Step] = {}
        self._workdirs = SentWorkdirs()
        self._starter = AgentStarter(BOOTSTRAP, spec.own(SlurmSettings).ready_timeout_seconds, env=spec.env)

    def start_agent(self, node_rank: int, name: str, address: str, job_id: str, args: list[str]) -> NodeLink:
        def open_step(code: str, argv: list[str]) -> _StepWay:
            step = self._shell.open([*srun(job_id, name), *self._paths(), self._python, "-c", code, *argv],
                                    f"node {node_rank} {name}")
            self._steps[name] = self._agents[name] = step
            return _StepWay(step, lambda: self._said_at_the_end(name))

        python = NodePython(f"node {node_rank} ({name}, job {job_id})", self._python, self._python_default, "srun: ")
        # munge authenticates srun's I/O, nothing encrypts it: sealed (skytasks.stream_seal)
        # before the env, the pool's key or a call crosses the cluster's network.
        way, started = self._starter.start(open_step, args, python, sealed=stream_seal.wanted(private=False))
        step = way.step
        if started.sealed is not None:
            step = self._steps[name] = self._agents[name] = _over_seal(step, started.sealed)
        return self._link(node_rank, name, address, step)

    def _paths(self) -> list[str]:
        """On the command line only where the Python and its modules are found (PATH, PYTHONPATH:
        no secret); the rest of the env goes on the step's stdin, at once (env_in)."""
        paths = [f"{k}={self._spec.env[k]}" for k in ("PATH", "PYTHONPATH") if self._spec.env.get(k)]
        return ["env", *paths] if paths else []

    def _link(self, node_rank: int, name: str, address: str, step: Step) -> NodeLink:
        # A stream found broken is let go at once, before the agent is reached again: for the
        # agent's own step that closes this end only (its srun signalled would have its step
        # cancelled by srun's shepherd, agent and ranks with it). A lost node's srun is ended
        # when the node is let go (`end(name, lost=True)`). An attach step's srun is ended outright.
        lost = step.let_go if step is self._agents.get(name) else step.close_lost
        return NodeLink(node_rank=node_rank, address=address, inbound=step.inbound, outbound=step.outbound,
                        machine=name, close=step.close, close_lost=lost)

    def attach(self, node_rank: int, name: str, address: str, job_id: str, door: str, timeout: float) -> NodeLink:
        """A new stream to the node's running agent: a step beside it in the same allocation
        (`srun --overlap`) running `python -c attach.CLIENT DOOR`. Ending this step never touches
        the agent's own. NodeGone when nothing is behind the door (the agent ended)."""
        def open_step(client: list[str]) -> _StepWay:
            step = self._shell.open([*srun(job_id, name), *self._paths(), *client], f"node {node_rank} {name} attach")
            return _StepWay(step, lambda: " / ".join(step.stderr_tail))

        way, sealed = reach_agent(open_step, self._python, door, timeout, f"node {node_rank} ({name}, job {job_id})",
                                  sealed=stream_seal.wanted(private=False))
        step = self._steps[name] = way.step if sealed is None else _over_seal(way.step, sealed)
        return self._link(node_rank, name, address, step)

    def _said_at_the_end(self, name: str, wait: float = 2.0) -> str:
        """The last words of a step that ended: its stderr reaches us on a thread of its own."""
        deadline = time.monotonic() + wait
        while not (said := self.last_words(name)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return said

    def last_words(self, name: str) -> str:
        step = self._agents.get(name)
        return " / ".join(step.stderr_tail)[-500:] if step else ""

    def free_port(self, name: str, job_id: str) -> int:
        done = self._shell.run([*srun(job_id, name), self._python, "-c", port_snippet()])
        if done.returncode != 0:
            raise PoolStartError(f"node {name} (job {job_id}): cannot find a free port: {done.stderr.strip()[-500:]}")
        return int(done.stdout.strip())

    def prepare_workdir(self, request, nodes: list[tuple[str, str]]) -> tuple[str, str | None]:
        """The workdir onto every node in parallel, content-addressed as for ssh nodes."""
        shells = [(f"node {i} ({name})", _StepShell(self._shell, job, name)) for i, (name, job) in enumerate(nodes)]
        return self._workdirs.send(request, self._python, shells)

    def end(self, name: str, lost: bool = False) -> None:
        """The node's stream ends, and its agent's step with it: `lost`, at once (a node found
        lost, whose srun may wait for SLURM to declare it down), else as they end by themselves."""
        step, agent = self._steps.pop(name, None), self._agents.pop(name, None)
        for s in (step, agent) if agent is not step else (step,):
            if s is not None:
                (s.close_lost if lost else s.close)()

    def end_all(self) -> None:
        for name in list(self._steps) + list(self._agents):
            self.end(name)


@dataclass
class _StepWay:
    """A step as the agent starter and the re-attach drive it (remote.agent_start.AgentWay)."""

    step: Step
    said: Callable[[], str]

    @property
    def inbound(self) -> BinaryIO:
        return self.step.inbound

    @property
    def outbound(self) -> BinaryIO:
        return self.step.outbound

    def close(self) -> None:
        self.step.close()

    def last_words(self) -> str:
        return self.said()

    def exit_code(self) -> Optional[int]:
        return self.step.exit_code()


def _over_seal(step: Step, ends: stream_seal.SealedEnds) -> Step:
    """The step with its stream sealed: the same step to its users, plain bytes on its ends."""

    def closing(end: Callable[[], None]) -> Callable[[], None]:
        def both() -> None:
            ends.close()  # the pump ends the stream (srun's stdin) after the last sealed bytes
            end()
        return both

    return Step(ends.inbound, ends.outbound, closing(step.close), closing(step.close_lost), step.stderr_tail,
                step.exit_code, also_let_go=closing(step.let_go))


class _StepShell:
    """One node as `sync_workdir` talks to an SSH connection: `run(command, input=...)`."""

    def __init__(self, shell: SlurmShell, job_id: str, name: str):
        self._shell, self._job_id, self._name = shell, job_id, name

    async def run(self, command: str, input: Any = None, encoding: str | None = "utf-8", check: bool = False) -> Any:
        data = input.encode() if isinstance(input, str) else input
        done = await asyncio.to_thread(self._shell.run, [*srun(self._job_id, self._name), "bash", "-c", command], data)
        if check and done.returncode != 0:
            raise PoolStartError(f"node {self._name} (job {self._job_id}): {shlex.split(command)[:3]} failed: "
                                 f"{done.stderr.strip()[-500:]}")
        return SimpleNamespace(stdout=done.stdout, stderr=done.stderr, exit_status=done.returncode)
