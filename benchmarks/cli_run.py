"""A torchrun user's first minute: the same 4-rank script under `torchrun --nproc-per-node 4` and
under `skytasks run --nodes 2 --procs-per-node 2`, with a Prefect server running and with none
configured (Prefect's ephemeral server starts for the run), side by side in one run.

    .venv/bin/python benchmarks/run.py --only cli

Each figure is the median wall time of whole commands, as a user times them in a shell. The
runs alternate, so a noisy moment on this shared machine does not land on one side. One unmeasured
run of each comes first: Prefect creates its database on a first run, which a user pays once.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
dist.all_reduce(t)
if dist.get_rank() == 0:
    print("RESULT", t[0].item(), flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    from skytasks.node.ports import free_port  # imported here: as a script, skytasks is on the path only in main

    return free_port("127.0.0.1")


def _timed(cmd: list[str], env: dict, cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or "RESULT 16.0" not in done.stdout + done.stderr:
        raise RuntimeError(f"{cmd[:4]} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return elapsed


class _Server:
    """`prefect server start` on loopback, with its own home, stopped on exit."""

    def __init__(self, home: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_UI_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(self.port)], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("prefect server start did not answer within 120 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def cli_run(repeats: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="skytasks-bench-cli-"))
    try:
        (root / "train.py").write_text(SCRIPT)
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        base.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING")
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
                    "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "train.py"]
        skytasks = [sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", "--procs-per-node", "2", "train.py"]
        no_server = {**base, "PREFECT_HOME": str(root / "ephemeral-home")}
        server = _Server(root / "server-home")
        try:
            with_server = {**base, "PREFECT_HOME": str(root / "client-home"), "PREFECT_API_URL": server.url}
            for env in (no_server, with_server):
                _timed(skytasks, env, root)  # a first run creates Prefect's database: paid once
            runs: dict[str, list[float]] = {"torchrun": [], "server": [], "no_server": []}
            for _ in range(repeats):
                runs["torchrun"].append(_timed(torchrun, base, root))
                runs["server"].append(_timed(skytasks, with_server, root))
                runs["no_server"].append(_timed(skytasks, no_server, root))
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    torchrun_s, server_s, none_s = (statistics.median(runs[k]) for k in ("torchrun", "server", "no_server"))
    return {"torchrun_s": torchrun_s, "with_server_s": server_s, "no_server_s": none_s,
            "with_server_ratio": server_s / torchrun_s, "no_server_ratio": none_s / torchrun_s,
            "runs": runs}


if __name__ == "__main__":
    print(cli_run(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
