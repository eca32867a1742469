"""A torchrun user's first minute: the same 4-rank script under `torchrun --nproc-per-node 4` and
under `skytasks run --nodes 2 --procs-per-node 2`, with a Prefect server running and with none
configured (Prefect's ephemeral server starts for the run), side by side in one run.

    .venv/bin/python benchmarks/run.py --only cli
    .venv/bin/python benchmarks/cli_run.py 5 --also without-extra=/tmp/bare/bin/python

Each figure is the median wall time of whole commands, as a user times them in a shell. The
runs alternate, so a noisy moment on this shared machine does not land on one side. One unmeasured
run of each comes first: Prefect creates its database on a first run, which a user pays once.
`--also LABEL=PYTHON` times `skytasks run` under another interpreter too, in the same alternation
(an environment with skytasks installed without the `kubernetes` extra, say): its figures are
under `also[LABEL]`, their ratios to the same torchrun.
"""

from __future__ import annotations

import json
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


def cli_run(repeats: int, also: dict[str, str] | None = None) -> dict:
    """The table's figures; `also`: more interpreters (label: path) whose `skytasks run` is timed
    in the same alternation, each with Prefect homes of its own."""
    pythons = {"": sys.executable, **(also or {})}
    root = Path(tempfile.mkdtemp(prefix="skytasks-bench-cli-"))
    try:
        (root / "train.py").write_text(SCRIPT)
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        base.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING")
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
                    "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "train.py"]
        server = _Server(root / "server-home")
        try:
            rows = []  # (runs key, command, environment) in the order each round times them
            for label, python in pythons.items():
                skytasks = [python, "-m", "skytasks.cli", "run", "--nodes", "2", "--procs-per-node", "2", "train.py"]
                no_server = {**base, "PREFECT_HOME": str(root / f"ephemeral-home{label}")}
                with_server = {**base, "PREFECT_HOME": str(root / f"client-home{label}"), "PREFECT_API_URL": server.url}
                for env in (no_server, with_server):
                    _timed(skytasks, env, root)  # a first run creates Prefect's database: paid once
                rows += [(_key("server", label), skytasks, with_server), (_key("no_server", label), skytasks, no_server)]
            runs: dict[str, list[float]] = {"torchrun": [], **{key: [] for key, _, _ in rows}}
            for _ in range(repeats):
                runs["torchrun"].append(_timed(torchrun, base, root))
                for key, cmd, env in rows:
                    runs[key].append(_timed(cmd, env, root))
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    torchrun_s = statistics.median(runs["torchrun"])
    return {**_figures(runs, "", torchrun_s), "runs": runs,
            **({"also": {label: _figures(runs, label, torchrun_s) for label in also}} if also else {})}


def _key(row: str, label: str) -> str:
    return f"{row}:{label}" if label else row


def _figures(runs: dict[str, list[float]], label: str, torchrun_s: float) -> dict:
    server_s, none_s = (statistics.median(runs[_key(row, label)]) for row in ("server", "no_server"))
    return {"torchrun_s": torchrun_s, "with_server_s": server_s, "no_server_s": none_s,
            "with_server_ratio": server_s / torchrun_s, "no_server_ratio": none_s / torchrun_s}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("repeats", nargs="?", type=int, default=3)
    parser.add_argument("--also", action="append", default=[], metavar="LABEL=PYTHON",
                        help="time skytasks run under this interpreter too")
    args = parser.parse_args()
    print(json.dumps(cli_run(args.repeats, dict(a.split("=", 1) for a in args.also)), indent=2))
