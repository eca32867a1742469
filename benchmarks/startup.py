"""What a fresh process pays, side by side in one run (issue 60): a deployment's next run attaching
to a warm local pool (its first call, measured inside the flow), the cold first call that starts
the pool, and `skytasks run --nodes 2 --procs-per-node 2` against `torchrun --nproc-per-node 4` on
the same 4-rank script, with a Prefect server running and with none configured.

    .venv/bin/python -m benchmarks.startup 5                      # figures as JSON
    .venv/bin/python -m benchmarks.startup 5 --write              # ... into results.json ("startup")
    .venv/bin/python -m benchmarks.startup 5 --code /tmp/old-tree # another checkout's skytasks
    .venv/bin/python -m benchmarks.run --only startup             # the same, printed as a table

Each round: the pool is ended (`skytasks pools down`), a flow run starts it (cold) and the next
attaches to it (warm); then torchrun, `skytasks run` with the server, `skytasks run` with none,
one after the other, so a noisy moment on this shared machine lands on every side. Figures are
medians over the rounds; a ratio is the median of each round's own ratio (pair by pair). One
unmeasured `skytasks run` of each kind comes first (Prefect creates its database on a first run,
paid once). `--code DIR` puts DIR first on the children's PYTHONPATH (a checkout whose `blocks/`
is reachable as `skytasks/blocks`), to measure an older tree with these same steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cli_run import SCRIPT, _free_port, _Server, _timed
from benchmarks.warm_attach import FLOW, POOL, _run

REPO = Path(__file__).resolve().parent.parent


def startup(repeats: int, code: Path = REPO) -> dict:
    root = Path(tempfile.mkdtemp(prefix="skytasks-bench-startup-"))
    try:
        (root / "train.py").write_text(SCRIPT)
        (root / "nightly.py").write_text(FLOW)
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        base.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING", PYTHONPATH=str(code))
        server = _Server(root / "server-home")
        try:
            with_server = {**base, "PREFECT_HOME": str(root / "client-home"), "PREFECT_API_URL": server.url}
            no_server = {**base, "PREFECT_HOME": str(root / "ephemeral-home")}
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
                        "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "train.py"]
            skytasks = [sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", "--procs-per-node", "2",
                        "train.py"]
            for env in (no_server, with_server):
                _timed(skytasks, env, root)  # a first run creates Prefect's database: paid once
            subprocess.run([sys.executable, "-c", "import sys; from skytasks import GPUPool; GPUPool(provider='local', "
                            "nodes=2, procs_per_node=2, keep_warm_minutes=5).save(sys.argv[1], overwrite=True)", POOL],
                           cwd=root, env=with_server, check=True, capture_output=True, timeout=120)
            rounds = []
            for _ in range(repeats):
                _pools_down(root, with_server)
                flow_env = {**with_server, "PREFECT_LOGGING_LEVEL": "INFO"}  # its "attached to warm pool" line
                cold, warm = _run(root, flow_env), _run(root, flow_env)
                if not warm["attached"] or cold["attached"]:
                    raise RuntimeError(f"a warm run did not attach, or a cold one did: {cold}, {warm}")
                rounds.append({"warm_first_call_s": warm["up_and_first_call_s"],
                               "cold_first_call_s": cold["up_and_first_call_s"],
                               "warm_process_s": warm["process_s"], "cold_process_s": cold["process_s"],
                               "torchrun_s": _timed(torchrun, base, root),
                               "with_server_s": _timed(skytasks, with_server, root),
                               "no_server_s": _timed(skytasks, no_server, root)})
            _pools_down(root, with_server)
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in rounds:
        r["with_server_ratio"] = r["with_server_s"] / r["torchrun_s"]
        r["no_server_ratio"] = r["no_server_s"] / r["torchrun_s"]
    return {**{key: statistics.median(r[key] for r in rounds) for key in rounds[0]}, "rounds": rounds,
            "code": str(code)}


def _pools_down(root: Path, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "skytasks.cli", "pools", "down", POOL], cwd=root, env=env, check=True,
                   capture_output=True, timeout=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("repeats", nargs="?", type=int, default=5)
    parser.add_argument("--code", type=Path, default=REPO, help="the skytasks checkout to measure")
    parser.add_argument("--write", action="store_true", help="into benchmarks/results.json as 'startup'")
    args = parser.parse_args()
    figures = startup(args.repeats, args.code)
    print(json.dumps(figures, indent=2))
    if args.write:
        from benchmarks.results_file import update_results

        update_results(Path(__file__).resolve().parent / "results.json", startup=figures)
