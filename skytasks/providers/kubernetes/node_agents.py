"""The node agent in a pod, started over an exec stream, and the short commands a call needs
there (a free port on the head, the workdir).

The stream starts with a few lines of the image's Python: the check that it is the controller's
major.minor with a compatible cloudpickle, and can import torch (`python_check`: a mismatch is a
PoolStartError naming k8s_image and both versions), then "have" or "need" for the controller's
skytasks (content-addressed under /tmp/skytasks in the pod, so a pod gets it once), which the
controller then sends on the same stream, and the agent in that process. Nothing of it is in the pod's spec or command line.
"""

from __future__ import annotations

import asyncio
import shlex
from types import SimpleNamespace
from typing import Any, Optional

from skytasks import stream_seal
from skytasks.errors import PoolStartError
from skytasks.node.ports import port_snippet
from skytasks.providers import NodeLink
from skytasks.providers.kubernetes import cluster, exec_stream
from skytasks.providers.kubernetes.pods import CONTAINER
from skytasks.providers.remote import python_check
from skytasks.providers.remote.agent_start import AgentStarter, NodePython, bootstrap
from skytasks.providers.remote.reattach import reach_agent
from skytasks.providers.remote.workdir import SentWorkdirs

# argv: digest, bundle size, then the agent's own arguments (`-m skytasks.node.agent ...`).
BOOTSTRAP = bootstrap("""base = next((d for d in ("/tmp", "/dev/shm") if os.access(d, os.W_OK)), None)
if base is None:
    sys.exit("skytasks: neither /tmp nor /dev/shm is writable in the pod")
home = os.path.join(base, "skytasks", sys.argv[1])
""", env=False, then="""try:
    os.chdir(os.path.expanduser("~"))  # where a workdir is synced, as on ssh and slurm nodes
except OSError:
    pass
if "--heartbeat-file" in sys.argv:  # the controller reached the pod: the keeper's idle clock starts now
    beat = sys.argv[sys.argv.index("--heartbeat-file") + 1]
    try:
        with open(beat, "a"):
            pass
        os.utime(beat, None)
    except OSError:
        pass
""")

# Runs a shell command whose stdin is exactly the next N bytes of the stream (argv[1]): the
# exec protocol has no end of stdin of its own.
FEED = r"""
import os, subprocess, sys
left, proc = int(sys.argv[1]), subprocess.Popen(["sh", "-c", sys.argv[2]], stdin=subprocess.PIPE)
while left > 0:
    chunk = os.read(0, min(left, 1 << 20))
    if not chunk:
        break
    proc.stdin.write(chunk)
    left -= len(chunk)
proc.stdin.close()
sys.exit(proc.wait())
"""


class PodAgents:
    """The agents of one pool's pods, and the commands run beside them."""

    def __init__(self, cfg: Any, namespace: str, python: str, timeout: float):
        self._cfg, self._namespace, self._python, self._timeout = cfg, namespace, python, timeout
        self.streams: dict[str, exec_stream.PodExec] = {}
        # A kubeconfig that skips TLS verification, or http: each stream sealed (stream_seal),
        # its plain ends kept here by the exec they run over.
        self.sealed = stream_seal.wanted(cluster.private_stream(cfg))
        self._plain: dict[int, stream_seal.SealedEnds] = {}
        self._starter = AgentStarter(BOOTSTRAP, timeout)
        self._workdirs = SentWorkdirs()

    def start(self, node_rank: int, pod: str, address: str, agent: list[str]) -> NodeLink:
        def open_exec(code: str, argv: list[str]) -> exec_stream.PodExec:
            try:
                stream = exec_stream.PodExec(self._cfg, self._namespace, pod, CONTAINER, [self._python, "-c", code, *argv])
            except Exception as exc:  # noqa: BLE001 - the API server's refusal, in its words
                raise cluster.refused(exc, f"exec into pod {pod} (pods/exec)", self._namespace) from exc
            self.streams[pod] = stream
            return stream

        where = f"node {node_rank} (pod {pod})"
        here = python_check.this_controller()

        def wrong_image(found: python_check.Found) -> Optional[str]:
            # The image is asked for only where the pod's Python or cloudpickle is wrong.
            return python_check.wrong_image(where, self._image(pod), self._python, found, here) \
                if python_check.why_not(found, here) else None

        stream, started = self._starter.start(open_exec, agent, NodePython(where, self._python, wrong=wrong_image),
                                              sealed=self.sealed)
        if started.sealed is not None:
            self._plain[id(stream)] = started.sealed
        return self._link(node_rank, pod, address, stream)

    def _link(self, node_rank: int, pod: str, address: str, stream: exec_stream.PodExec) -> NodeLink:
        # Closing a link ends its own stream, never a newer one the pod was reached by since.
        ends: Any = self._plain.get(id(stream), stream)
        return NodeLink(node_rank=node_rank, address=address, inbound=ends.inbound, outbound=ends.outbound,
                        machine=pod, close=lambda: self._end_stream(pod, stream))

    def attach(self, node_rank: int, pod: str, address: str, door: str, timeout: float) -> NodeLink:
        """A new exec into the pod, `python -c attach.CLIENT DOOR`: a stream to its running agent
        (an exec'd process outlives its exec stream: an API server restart, a proxy's cut). It
        becomes the pod's stream once the door spoke; NodeGone when nothing is behind the door."""
        def open_exec(client: list[str]) -> _AttachExec:
            return _AttachExec(exec_stream.PodExec(self._cfg, self._namespace, pod, CONTAINER, client, timeout=timeout))

        way, sealed = reach_agent(open_exec, self._python, door, timeout, f"node {node_rank} (pod {pod})",
                                  sealed=self.sealed)
        if sealed is not None:
            self._plain[id(way.stream)] = sealed
        self.streams[pod] = way.stream
        return self._link(node_rank, pod, address, way.stream)

    def _end_stream(self, pod: str, stream: exec_stream.PodExec) -> None:
        if self.streams.get(pod) is stream:
            del self.streams[pod]
        self._close(stream)

    def _close(self, stream: exec_stream.PodExec) -> None:
        ends = self._plain.pop(id(stream), None)
        if ends is not None:
            ends.close()
        stream.close()

    def _image(self, pod: str) -> str | None:
        """The image the pod runs, as the API server has it (k8s_image, or what the pod template
        made of it); None where it cannot be read. Asked only when the pod's Python is wrong."""
        from kubernetes import client

        from skytasks.providers.kubernetes import cluster

        try:
            with cluster.api_client(self._cfg) as api:
                spec = client.CoreV1Api(api).read_namespaced_pod(pod, self._namespace, _request_timeout=30).spec
            return next((c.image for c in spec.containers if c.name == CONTAINER), None) if spec else None
        except Exception:  # noqa: BLE001 - the error names k8s_image without its value then
            return None

    def end(self, pod: str) -> None:
        stream = self.streams.pop(pod, None)
        if stream is not None:
            self._close(stream)

    def end_all(self) -> None:
        for pod in list(self.streams):
            self.end(pod)

    def last_words(self, pod: str) -> str:
        stream = self.streams.get(pod)
        return stream.last_words() if stream else ""

    def free_port(self, pod: str) -> int:
        code, out, said = exec_stream.run(self._cfg, self._namespace, pod, CONTAINER,
                                          [self._python, "-c", port_snippet()])
        if code != 0:
            raise PoolStartError(f"pod {pod}: cannot find a free port: {said or out.decode(errors='replace')}")
        return int(out.strip())

    def prepare_workdir(self, request: Any, pods: list[str]) -> tuple[str, str | None]:
        """The workdir onto every pod in parallel, content-addressed as for ssh nodes."""
        shells = [(f"node {i} (pod {pod})", _PodShell(self, pod)) for i, pod in enumerate(pods)]
        return self._workdirs.send(request, self._python, shells)

    def run_with_input(self, pod: str, command: str, data: bytes) -> tuple[int, bytes, str]:
        stream = exec_stream.PodExec(self._cfg, self._namespace, pod, CONTAINER,
                                     [self._python, "-c", FEED, str(len(data)), command])
        try:
            stream.outbound.write(data)
            stream.outbound.flush()
            out = b"".join(iter(lambda: stream.inbound.read(1 << 16), b""))
            stream.ended.wait(self._timeout)
        finally:
            stream.close()
        code = stream.exit_code()
        return (1 if code is None else code), out, stream.last_words()


class _PodShell:
    """One pod as `sync_workdir` talks to an SSH connection: `run(command, input=...)`."""

    def __init__(self, agents: PodAgents, pod: str):
        self._agents, self._pod = agents, pod

    async def run(self, command: str, input: Any = None, encoding: str | None = "utf-8", check: bool = False) -> Any:
        data = input.encode() if isinstance(input, str) else (input or b"")
        code, out, said = await asyncio.to_thread(self._agents.run_with_input, self._pod, command, data)
        if check and code != 0:
            raise PoolStartError(f"pod {self._pod}: {shlex.split(command)[:3]} failed: {said[-500:]}")
        return SimpleNamespace(stdout=out.decode() if encoding else out, stderr=said, exit_status=code)


class _AttachExec:
    """An attach's exec as the re-attach drives it: its status only once the stream ended."""

    def __init__(self, stream: exec_stream.PodExec):
        self.stream = stream
        self.inbound, self.outbound = stream.inbound, stream.outbound

    def close(self) -> None:
        self.stream.close()

    def last_words(self) -> str:
        return self.stream.last_words()

    def exit_code(self) -> Optional[int]:
        return self.stream.exit_code() if self.stream.ended.is_set() else None
