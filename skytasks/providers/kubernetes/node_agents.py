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
import time
from types import SimpleNamespace
from typing import Any

from skytasks import stream_seal
from skytasks.errors import PoolStartError
from skytasks.node import attach
from skytasks.node.ports import port_snippet
from skytasks.providers import NodeLink
from skytasks.providers.kubernetes import cluster, exec_stream
from skytasks.providers.kubernetes.pods import CONTAINER
from skytasks.providers.package_in import PACKAGE_IN, read_line
from skytasks.providers.ssh import python_check
from skytasks.providers.ssh.bridge import await_answer
from skytasks.providers.ssh.nodes import package_bundle

# argv: digest, bundle size, then the agent's own arguments (`-m skytasks.node.agent ...`).
BOOTSTRAP = python_check.CHECK + PACKAGE_IN + r"""
import os, sys
if not _python_ok():
    sys.exit(3)
base = next((d for d in ("/tmp", "/dev/shm") if os.access(d, os.W_OK)), None)
if base is None:
    sys.exit("skytasks: neither /tmp nor /dev/shm is writable in the pod")
_package_in(os.path.join(base, "skytasks", sys.argv[1]), int(sys.argv[2]))
os.environ.pop("SKYTASKS_STREAM_SEALED", None)  # the agent's stream is sealed; its ranks need not know
try:
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
os.execv(sys.executable, [sys.executable] + sys.argv[3:])
"""

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
        self._bundle: tuple[bytes, str] | None = None
        self._workdirs: dict[str, str] = {}

    def start(self, node_rank: int, pod: str, address: str, agent: list[str]) -> NodeLink:
        if self._bundle is None:
            self._bundle = package_bundle()
        bundle, digest = self._bundle
        where = f"node {node_rank} (pod {pod})"
        seal = stream_seal.identity() if self.sealed else None
        code = (stream_seal.node_prelude(seal.pin) if seal else "") + BOOTSTRAP
        try:
            stream = exec_stream.PodExec(self._cfg, self._namespace, pod, CONTAINER,
                                         [self._python, "-c", code, digest, str(len(bundle)), *agent])
        except Exception as exc:  # noqa: BLE001 - the API server's refusal, in its words
            raise cluster.refused(exc, f"exec into pod {pod} (pods/exec)", self._namespace) from exc
        self.streams[pod] = stream
        ends: Any = stream
        if seal is not None:
            try:
                ends = self._seal(stream, seal, self._timeout)
            except stream_seal.SealFailed:
                raise PoolStartError(python_check.did_not_start(where, self._python, stream.last_words() or
                                                                "the stream ended before its TLS handshake")) from None
        checked = python_check.parse(read_line(ends.inbound, self._timeout, stream.close))
        here = python_check.this_controller()
        # Another Python (or cloudpickle) in the image first, as it is what to fix; then a lack.
        # Before the package is sent and before any rank.
        if checked is not None and (python_check.why_not(checked, here) or checked.missing):
            stream.close()
            wrong = python_check.wrong_image(where, self._image(pod), self._python, checked, here)
            raise PoolStartError(wrong or python_check.cannot_import(where, self._python, checked))
        answer = read_line(ends.inbound, self._timeout, stream.close) if checked is not None else b""
        if answer == b"need\n":
            ends.outbound.write(bundle)
            ends.outbound.flush()
        elif answer != b"have\n":
            stream.close()
            raise PoolStartError(python_check.did_not_start(where, self._python, stream.last_words() or repr(answer)))
        return self._link(node_rank, pod, address, stream)

    def _seal(self, stream: exec_stream.PodExec, seal: stream_seal.Identity, timeout: float) -> stream_seal.SealedEnds:
        ends = stream_seal.seal_controller_end(stream.inbound, stream.outbound, seal, timeout, stream.close)
        self._plain[id(stream)] = ends
        return ends

    def _link(self, node_rank: int, pod: str, address: str, stream: exec_stream.PodExec) -> NodeLink:
        # Closing a link ends its own stream, never a newer one the pod was reached by since.
        ends: Any = self._plain.get(id(stream), stream)
        return NodeLink(node_rank=node_rank, address=address, inbound=ends.inbound, outbound=ends.outbound,
                        machine=pod, close=lambda: self._end_stream(pod, stream))

    def attach(self, node_rank: int, pod: str, address: str, door: str, timeout: float) -> NodeLink:
        """A new exec into the pod, `python -c attach.CLIENT DOOR`: a stream to its running agent
        (an exec'd process outlives its exec stream: an API server restart, a proxy's cut). It
        becomes the pod's stream once the door spoke; NodeGone when nothing is behind the door."""
        started = time.monotonic()
        seal = stream_seal.identity() if self.sealed else None
        client = stream_seal.attach_argv(self._python, seal.pin, door) if seal else attach.argv(self._python, door)
        stream = exec_stream.PodExec(self._cfg, self._namespace, pod, CONTAINER, client, timeout=timeout)
        try:
            await_answer(stream.inbound, timeout - (time.monotonic() - started),
                         lambda: stream.exit_code() if stream.ended.is_set() else None, stream.last_words,
                         f"node {node_rank} (pod {pod})")
            if seal is not None:  # a fresh agreement for each new stream
                self._seal(stream, seal, max(1.0, timeout - (time.monotonic() - started)))
        except BaseException:
            self._close(stream)
            raise
        self.streams[pod] = stream
        return self._link(node_rank, pod, address, stream)

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
        from skytasks.providers.ssh.workdir import sync_workdir
        from skytasks.workdir import describe_sync, read_workdir

        tree = request.tree or read_workdir(request.root)
        if tree.digest in self._workdirs:
            return self._workdirs[tree.digest], None

        async def every_pod() -> list:
            return list(await asyncio.gather(*(sync_workdir(_PodShell(self, pod), self._python, tree) for pod in pods)))

        results = asyncio.run(every_pod())
        self._workdirs[tree.digest] = results[0].path
        sent = [(f"node {i} (pod {pod})", r.files_sent, r.bytes_sent) for i, (pod, r) in enumerate(zip(pods, results))]
        return results[0].path, describe_sync(request.root, sent)

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
