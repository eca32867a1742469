"""The GPU path on a machine with a GPU: what `make test` cannot prove on a CPU machine.

    python benchmarks/gpu_check.py [--out results.json] [--only TEXT] [--rounds N]

Each check prints one line, PASS or FAIL with what it saw, and the figures go to --out:
  - a 1-node pool on one GPU: nccl, the rank's device, an all-reduce on it, the rank forked from
    the node's template (after its one torch import) yet initialising CUDA on its own;
  - the same rank started cold (SKYTASKS_RANK_START=exec), and the first call's time either way;
  - two local nodes sharing the GPU: gloo, with CUDA tensors, said once;
  - a real CUDA out-of-memory on one rank keeps torch's type, names rank, node and device;
  - an unchanged Hugging Face Trainer on the GPU, through the decorator;
  - one-rank nccl DDP steps per second, forked and cold ranks against torchrun's, alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from benchmarks import workloads  # noqa: E402
from skytasks import DistributedTaskError, GPUPool, distributed_task, rank_info  # noqa: E402
from tests.harness.workloads import hf_train  # noqa: E402

RESULTS: dict = {}
ROUNDS = 3
CHECKS: list = []


def check(name: str):
    def register(fn):
        CHECKS.append((name, fn))
        return fn
    return register


def run(name: str, fn) -> None:
    started = time.perf_counter()
    try:
        seen = fn()
        RESULTS[name] = {"ok": True, "seen": seen, "s": round(time.perf_counter() - started, 2)}
        print(f"PASS {name} ({RESULTS[name]['s']} s): {seen}", flush=True)
    except Exception as e:  # every check runs; a failure is a line, with its traceback
        RESULTS[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "s": round(time.perf_counter() - started, 2)}
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


def template_has_torch() -> bool:
    """Whether this node's rank template (a child of the agent, as a forked rank is) loaded torch."""
    agent = os.getppid()
    for pid in open(f"/proc/{agent}/task/{agent}/children").read().split():
        if "skytasks.node.rank_template" in open(f"/proc/{pid}/cmdline").read().replace("\0", " "):
            return "libtorch" in open(f"/proc/{pid}/maps").read()
    return False


def on_my_gpu() -> dict:
    import torch
    import torch.distributed as dist

    info = rank_info()
    t = torch.ones(4, device=info.device)
    dist.all_reduce(t)
    return {"device": info.device, "backend": dist.get_backend(), "sum": t.sum().item(),
            "current": torch.cuda.current_device(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "forked": os.environ["SKYTASKS_CTRL_FD"] == "3", "template_has_torch": template_has_torch(),
            "name": torch.cuda.get_device_name()}


def first_and_warm(rank_start: str, procs: int = 1) -> dict:
    """A fresh pool's first call (the agent, the ranks, torch, CUDA and the group) and warm calls."""
    os.environ["SKYTASKS_RANK_START"] = rank_start
    try:
        pool = GPUPool(nodes=1, procs_per_node=procs)
        task = distributed_task(on_my_gpu, pool=pool)
        with pool:
            started = time.perf_counter()
            ranks = task()
            first_s = time.perf_counter() - started
            warm = []
            for _ in range(5):
                started = time.perf_counter()
                task()
                warm.append(time.perf_counter() - started)
        return {**ranks[0], "ranks": len(ranks), "sums": sorted({r["sum"] for r in ranks}),
                "all_forked": all(r["forked"] for r in ranks), "first_call_s": round(first_s, 2),
                "warm_call_s": round(statistics.median(warm), 3)}
    finally:
        os.environ.pop("SKYTASKS_RANK_START", None)


@check("one GPU, forked rank: nccl on cuda:0, torch from the template")
def forked() -> dict:
    seen = first_and_warm("fork")
    assert seen["backend"] == "nccl" and seen["device"] == "cuda:0" and seen["sum"] == 4.0, seen
    assert seen["forked"] and seen["template_has_torch"], seen
    return seen


@check("one GPU, cold rank (SKYTASKS_RANK_START=exec)")
def cold() -> dict:
    seen = first_and_warm("exec")
    assert seen["backend"] == "nccl" and seen["sum"] == 4.0 and not seen["forked"], seen
    return seen


@check("4 ranks on one GPU, forked against cold, alternated: first call")
def four_ranks() -> dict:
    runs: dict[str, list] = {"exec": [], "fork": []}
    for mode in ("exec", "fork", "exec", "fork"):
        seen = first_and_warm(mode, procs=4)
        assert seen["backend"] == "gloo" and seen["sums"] == [16.0] and seen["all_forked"] == (mode == "fork"), seen
        assert seen["template_has_torch"] == (mode == "fork"), seen
        runs[mode].append(seen["first_call_s"])
    return {"first_call_s": runs}


@check("two local nodes share the GPU: gloo on CUDA tensors, said once")
def shared() -> dict:
    import io
    from contextlib import redirect_stderr

    pool = GPUPool(nodes=2)
    task = distributed_task(on_my_gpu, pool=pool)
    err = io.StringIO()
    with redirect_stderr(err), pool:
        first, second = task(), task()
    assert [r["backend"] for r in first + second] == ["gloo"] * 4, first
    assert [r["device"] for r in first] == ["cuda:0"] * 2 and [r["sum"] for r in first] == [8.0, 8.0], first
    said = err.getvalue().count("using gloo, not nccl")
    return {"ranks": first, "said": said}


def real_oom() -> None:
    import torch

    if rank_info().rank == 1:
        torch.empty(1 << 50, dtype=torch.uint8, device=rank_info().device)  # 1 PiB
    time.sleep(60)


@check("a real CUDA out-of-memory keeps torch's type")
def oom() -> dict:
    import torch

    try:
        distributed_task(real_oom, pool=GPUPool(nodes=2))()
    except DistributedTaskError as e:
        (err,) = e.exceptions
        assert isinstance(err, torch.OutOfMemoryError), repr(err)
        notes = getattr(err, "__notes__", [])
        assert any("rank 1 failed (node 1" in n and "device cuda:0" in n for n in notes), notes
        return {"type": type(err).__name__, "notes": notes, "first_line": str(err).splitlines()[0][:160]}
    raise AssertionError("the call did not fail")


@check("an unchanged Hugging Face Trainer on the GPU")
def hf() -> dict:
    (seen,) = distributed_task(hf_train, pool=GPUPool(nodes=1))(5, use_cpu=False)
    assert seen["device"] == "cuda:0" and seen["param_device"] == "cuda:0" and seen["world"] == 1, seen
    return seen


def torchrun_ddp_gpu() -> float:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1",
                          "--master_addr=127.0.0.1", "--master_port=29517", str(HERE / "torchrun_job.py"), "ddp_gpu"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split("RESULT")[1].split()[0])


def rank_facts() -> dict:
    """What could make a rank's launch-bound loop slower than torchrun's: its threads and CPUs."""
    import torch

    return {"threads": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)),
            "omp": os.environ.get("OMP_NUM_THREADS"), "nice": os.nice(0)}


@check("one-rank nccl DDP steps/s against torchrun")
def throughput() -> dict:
    """Forked ranks, cold ranks and torchrun, alternated, so a noisy moment does not land on one side."""
    ours: dict = {"fork": [], "exec": []}
    theirs: list = []
    facts = {}
    pools = {}
    for start in ours:
        os.environ["SKYTASKS_RANK_START"] = start
        pools[start] = GPUPool(nodes=1).__enter__()
        facts[start] = distributed_task(rank_facts, pool=pools[start])()[0]
    os.environ.pop("SKYTASKS_RANK_START")
    try:
        for _ in range(ROUNDS):
            theirs.append(torchrun_ddp_gpu())
            for start, pool in pools.items():
                ours[start].append(distributed_task(workloads.ddp_gpu_steps_per_second, pool=pool, name="ddp_gpu")()[0])
    finally:
        for pool in pools.values():
            pool.__exit__(None, None, None)
    seen = {"torchrun": round(statistics.median(theirs), 1), "runs": {"torchrun": theirs, **ours}, "facts": facts}
    for start, figures in ours.items():
        seen[start] = round(statistics.median(figures), 1)
        seen[f"{start}_ratio"] = round(seen[start] / seen["torchrun"], 3)
    return seen


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--only", help="run only the checks whose name holds this text")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the throughput check")
    args = parser.parse_args()
    out, ROUNDS = args.out, args.rounds
    import torch

    RESULTS["machine"] = {"torch": torch.__version__, "gpus": torch.cuda.device_count(),
                          "name": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    print(RESULTS["machine"], flush=True)
    for name, fn in CHECKS:
        if not args.only or args.only in name:
            run(name, fn)
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=1))
    sys.exit(0 if all(r.get("ok", True) for r in RESULTS.values()) else 1)
