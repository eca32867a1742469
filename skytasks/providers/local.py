"""provider="local": node agents as child processes of this machine, reached over pipes."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

from skytasks.providers import NodeLink, agent_args

LOOPBACK = "127.0.0.1"


def _visible_gpus() -> list[str]:
    """GPU ids on this machine, without initialising CUDA in the controller."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        ids = [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        return [d.strip() for d in ids]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def split_gpus(gpus: list[str], nodes: int, procs_per_node: int) -> list[list[str]]:
    """Each local node gets its own GPUs, one per process where there are enough; with fewer
    GPUs than processes they are shared round-robin (a smoke run of 2 ranks on 1 GPU)."""
    if not gpus:
        return [[] for _ in range(nodes)]
    per_node = []
    for n in range(nodes):
        mine = [gpus[(n * procs_per_node + p) % len(gpus)] for p in range(procs_per_node)]
        per_node.append(list(dict.fromkeys(mine)))
    return per_node


class LocalProvider:
    def __init__(self, pool):
        self._pool = pool
        self._procs: list[subprocess.Popen] = []

    def start(self) -> list[NodeLink]:
        gpus = _visible_gpus()
        slices = split_gpus(gpus, self._pool.nodes, self._pool.procs_per_node)
        links = []
        try:
            for node_rank in range(self._pool.nodes):
                proc = subprocess.Popen(
                    [sys.executable, *agent_args()],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    # A session of its own: Ctrl-C at the terminal reaches the controller only,
                    # which then stops the ranks in order instead of everything dying at once.
                    start_new_session=True,
                )
                self._procs.append(proc)
                user_path = self._pool.env.get("PYTHONPATH")
                env = {"PYTHONPATH": os.pathsep.join(p for p in (user_path, _controller_path()) if p)}
                if gpus:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(slices[node_rank])
                links.append(
                    NodeLink(
                        node_rank=node_rank,
                        address=LOOPBACK,
                        inbound=proc.stdout,  # type: ignore[arg-type]
                        outbound=proc.stdin,  # type: ignore[arg-type]
                        env=env,
                        accelerators=len(slices[node_rank]),
                        close=lambda p=proc: _end(p),
                    )
                )
        except BaseException:
            self.stop()
            raise
        return links

    def free_port(self) -> int:
        # Chosen per rank group on loopback, never a fixed 29500: two pools (or a torchrun next
        # door) on one machine do not collide.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            return s.getsockname()[1]

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for p in procs:
            _end(p)


def _controller_path() -> str:
    """The controller's import path, so a function that imports the user's own modules (a
    sibling file of the flow) finds them on a local rank too."""
    parts = [os.path.abspath(p or ".") for p in sys.path]
    return os.pathsep.join(dict.fromkeys(p for p in parts if os.path.isdir(p)))


def _end(proc: subprocess.Popen) -> None:
    """Close the agent's stdin (it then stops its ranks and exits); kill it if it lingers."""
    if proc.poll() is None:
        try:
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()  # type: ignore[union-attr]
        except OSError:
            pass
