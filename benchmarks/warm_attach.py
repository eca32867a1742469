"""A deployment's run twice on a warm local pool: the first run starts the pool (cold), the next
attaches to its running agents (warm). Issue 52's goal: the attached first call within a second.

    .venv/bin/python benchmarks/warm_attach.py 3

Each round ends the pool first (`skytasks pools down`), then runs the same flow as two separate
processes, as two scheduled runs of a deployment are: a 2-node x 2-rank gloo all-reduce in
`with pool:` on a saved local pool with keep_warm_minutes. Measured inside each process: the pool
up (started, or attached), its first call, both together; and each whole process as a shell times
it. A Prefect server of its own runs throughout. Figures: medians over the rounds.
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
from pathlib import Path

from benchmarks.cli_run import _Server

POOL = "bench-warm"
FLOW = """
import json, sys, time
from prefect import flow
from skytasks import GPUPool, distributed_task

@distributed_task
def train():
    import torch, torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()

@flow(name="nightly")
def nightly():
    started = time.perf_counter()
    pool = GPUPool.load(sys.argv[1])
    with pool:
        up = time.perf_counter() - started
        assert train() == [4.0] * 4
        first = time.perf_counter() - started
    return {"up_s": up, "first_call_s": first - up, "up_and_first_call_s": first}

print("FIGURES", json.dumps(nightly()))
"""


def _run(root: Path, env: dict) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "nightly.py", POOL], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    wall = time.perf_counter() - started
    line = next((x for x in done.stdout.splitlines() if x.startswith("FIGURES ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"the run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return {**json.loads(line[len("FIGURES "):]), "process_s": wall, "attached": "attached to warm pool" in
            done.stdout + done.stderr}


def warm_attach(repeats: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="skytasks-bench-warm-"))
    repo = str(Path(__file__).resolve().parent.parent)
    try:
        (root / "nightly.py").write_text(FLOW)
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        server = _Server(root / "server-home")
        env = {**base, "PREFECT_HOME": str(root / "client-home"), "PREFECT_API_URL": server.url,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": repo}
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        try:
            subprocess.run([sys.executable, "-c", "import sys; from skytasks import GPUPool; GPUPool(provider='local', "
                            "nodes=2, procs_per_node=2, keep_warm_minutes=5).save(sys.argv[1], overwrite=True)", POOL],
                           cwd=root, env=env, check=True, capture_output=True, timeout=120)
            for _ in range(repeats):
                subprocess.run([sys.executable, "-m", "skytasks.cli", "pools", "down", POOL], cwd=root, env=env,
                               check=True, capture_output=True, timeout=120)
                runs["cold"].append(_run(root, env))
                runs["warm"].append(_run(root, env))
            subprocess.run([sys.executable, "-m", "skytasks.cli", "pools", "down", POOL], cwd=root, env=env,
                           capture_output=True, timeout=120)
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not all(r["attached"] for r in runs["warm"]) or any(r["attached"] for r in runs["cold"]):
        raise RuntimeError(f"a warm run did not attach, or a cold one did: {runs}")
    figures = {kind: {key: statistics.median(r[key] for r in rows) for key in
                      ("up_s", "first_call_s", "up_and_first_call_s", "process_s")} for kind, rows in runs.items()}
    return {**figures, "runs": runs}


if __name__ == "__main__":
    print(json.dumps(warm_attach(int(sys.argv[1]) if len(sys.argv) > 1 else 3), indent=2))
