"""skytasks against torchrun, measured side by side in one run on this machine.

    make bench            # or: .venv/bin/python benchmarks/run.py [--quick]

Prints one table per figure with ratios, and writes benchmarks/results.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from benchmarks import reports, workloads  # noqa: E402
from benchmarks.results_file import update_results  # noqa: E402
from skytasks import GPUPool, distributed_task  # noqa: E402
from skytasks.node.ports import free_port  # noqa: E402


def torchrun(kind: str, standalone: bool = False) -> tuple[float, float]:
    """Wall time of a whole torchrun job, and the RESULT it printed. The fastest way to start
    torchrun on one machine is a fixed --master_port (static rendezvous); --standalone starts a
    c10d rendezvous first and takes seconds longer: the baseline must not flatter us."""
    where = (["--standalone"] if standalone else
             ["--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={free_port('127.0.0.1')}"])
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node=2",
         str(HERE / "torchrun_job.py"), kind],
        capture_output=True, text=True, check=True,
    ).stdout
    elapsed = time.perf_counter() - started
    return elapsed, float(out.split("RESULT")[1].split()[0])


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - started, result


def dispatch(repeats: int) -> dict:
    all_reduce = distributed_task(workloads.all_reduce_once, name="all_reduce")
    standalone_s = statistics.median(torchrun("all_reduce", standalone=True)[0] for _ in range(repeats))
    torchrun_s = min(standalone_s, statistics.median(torchrun("all_reduce")[0] for _ in range(repeats)))
    # A controller's first cold call starts its fork server, which imports torch once; its later
    # cold calls fork agents whose templates have it (see skytasks/node/forkserver.py).
    first_s = statistics.median(_first_cold_call() for _ in range(repeats))
    cold_s = statistics.median(timed(all_reduce.with_options(pool=GPUPool(nodes=1, procs_per_node=2)))[0] for _ in range(repeats))
    pool = GPUPool(nodes=1, procs_per_node=2)
    with pool:
        all_reduce.with_options(pool=pool)()
        warm_s = statistics.median(timed(all_reduce.with_options(pool=pool))[0] for _ in range(max(10, repeats * 5)))
    return {"torchrun_s": torchrun_s, "torchrun_standalone_s": standalone_s, "first_cold_s": first_s, "cold_s": cold_s,
            "warm_s": warm_s, "first_cold_ratio": first_s / torchrun_s, "cold_ratio": cold_s / torchrun_s,
            "warm_ratio": warm_s / torchrun_s}


FIRST_COLD_CALL = """
import sys, time
from benchmarks import workloads
from skytasks import GPUPool, distributed_task
task = distributed_task(workloads.all_reduce_once, name="all_reduce", pool=GPUPool(nodes=1, procs_per_node=2))
started = time.perf_counter()
task()
print("RESULT", time.perf_counter() - started)
"""


def _first_cold_call() -> float:
    """The first cold call of a fresh controller process (its imports not counted, as a flow's
    process has them before it calls): what `skytasks run` or a flow's first call pays."""
    out = subprocess.run([sys.executable, "-c", FIRST_COLD_CALL], cwd=HERE.parent,
                         capture_output=True, text=True, check=True).stdout
    return float(out.split("RESULT")[1].split()[0])


def warm_in_flow(torchrun_s: float, calls: int = 20) -> dict:
    """What a flow that calls a distributed task in a loop pays per call (an evaluation per
    epoch, a sweep), beside a plain Prefect task in the same flow, against the fastest torchrun."""
    from prefect import flow, task

    pool = GPUPool(nodes=1, procs_per_node=2)
    all_reduce = distributed_task(workloads.all_reduce_once, pool=pool, name="all_reduce")
    plain = task(workloads.started_at, name="plain")

    @flow(name="warm-calls")
    def loop() -> tuple[list[float], list[float]]:
        plain_s = [timed(plain)[0] for _ in range(calls)]
        with pool:
            all_reduce()
            return plain_s, [timed(all_reduce)[0] for _ in range(calls)]

    plain_s, times = loop()
    ordered = sorted(times)
    median = statistics.median(times)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return {"calls": calls, "plain_task_median_s": statistics.median(plain_s), "median_s": median, "p90_s": p90,
            "max_s": max(times), "median_ratio": median / torchrun_s, "p90_over_median": p90 / median}


def throughput(repeats: int) -> dict:
    task = distributed_task(workloads.ddp_steps_per_second, pool=GPUPool(nodes=1, procs_per_node=2), name="ddp")
    # Alternate the two, so a noisy moment on this shared machine does not land on one side.
    torchrun_runs, skytasks_runs = [], []
    for _ in range(repeats):
        torchrun_runs.append(torchrun("ddp")[1])
        skytasks_runs.append(task()[0])
    torchrun_sps, skytasks_sps = statistics.median(torchrun_runs), statistics.median(skytasks_runs)
    return {"torchrun_steps_per_s": torchrun_sps, "skytasks_steps_per_s": skytasks_sps,
            "ratio": skytasks_sps / torchrun_sps}


def fan_out(sizes: list[int]) -> list[dict]:
    from prefect import flow

    rows = []
    for n in sizes:
        ppn = min(n, 8)
        pool = GPUPool(nodes=n // ppn, procs_per_node=ppn)
        task = distributed_task(workloads.started_at, pool=pool, init_torch=False, name=f"fanout-{n}")

        t0 = time.time()
        plain_s, starts = timed(task)
        running_s = max(starts) - t0

        @flow(name=f"fanout-{n}")
        def in_a_flow():
            return timed(task)  # noqa: B023 - called at once, in this iteration

        flow_s = in_a_flow()[0]
        rows.append({"ranks": n, "all_running_s": running_s, "call_s": plain_s, "call_in_flow_s": flow_s,
                     "prefect_s": flow_s - plain_s})
    return rows


def raw_pipe_mb_per_s(mb: int) -> float:
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys\nb=bytearray(1<<20)\nr=sys.stdin.buffer.raw\nwhile r.readinto(b): pass"],
        stdin=subprocess.PIPE,
    )
    chunk = b"x" * (1 << 20)
    started = time.perf_counter()
    for _ in range(mb):
        reader.stdin.write(chunk)
    reader.stdin.close()
    reader.wait()
    return mb / (time.perf_counter() - started)


def broadcast(sizes_mb: list[int], node_counts: list[int], samples: int = 3) -> dict:
    """A large argument to every rank. From 3 nodes it goes down the relay tree, node to node over
    TLS: those rows run again with SKYTASKS_PEER_TLS=0 (the links in the clear), in the same run,
    to show what TLS costs. Below 3 nodes the controller sends to each node itself: no peer link.

    This machine's speed swings from minute to minute, so each figure is a median: a row's time
    is the median of `samples` calls, each with bytes the ranks have not seen (a repeat of the same
    bytes is not sent again: `repeat_s`), and the raw pipe (best of 3) is sampled before every pool and
    at the end, its median the yardstick (its lowest and highest are kept beside it)."""
    import numpy as np

    from skytasks.controller.channel import RELAY_TREE_NODES

    def pipe_now() -> float:  # best of 3, once the last pool's processes and memory are gone
        gc.collect()
        time.sleep(1.0)
        return max(raw_pipe_mb_per_s(max(sizes_mb)) for _ in range(3))

    rows = []
    pipes = [pipe_now()]
    for nodes in node_counts:
        for tls in (True, False) if nodes >= RELAY_TREE_NODES else (None,):
            if tls is False:
                os.environ["SKYTASKS_PEER_TLS"] = "0"
            try:
                pipes.append(pipe_now())
                pool = GPUPool(nodes=nodes)
                task = distributed_task(workloads.payload_size, pool=pool, init_torch=False, name="broadcast")
                with pool:
                    # The empty call takes an empty array: the ranks import numpy once, which is no part
                    # of moving bytes (about 0.1 s on this machine, paid by the first array a rank gets).
                    empty_s = statistics.median(timed(task, np.zeros(0, np.uint8))[0] for _ in range(5))
                    for mb in sizes_mb:
                        data = np.frombuffer(os.urandom(mb << 20), dtype=np.uint8)
                        times = []
                        for i in range(samples):
                            fresh = data + np.uint8(i)  # new bytes each time: sent, not found on the ranks
                            took, sizes = timed(task, fresh)
                            assert sizes == [len(data)] * nodes
                            times.append(took)
                            del fresh
                        repeat_s, _ = timed(task, data + np.uint8(samples - 1))
                        call_s = statistics.median(times)
                        moved = mb * nodes
                        rows.append({"nodes": nodes, "mb": mb, "peer_tls": tls, "call_s": call_s, "calls_s": times,
                                     "repeat_s": repeat_s, "empty_call_s": empty_s,
                                     "mb_per_s": moved / max(call_s - empty_s, 1e-9)})
                        del data
            finally:
                os.environ.pop("SKYTASKS_PEER_TLS", None)
    pipes.append(pipe_now())
    pipe = statistics.median(pipes)
    for row in rows:
        row["fraction_of_pipe"] = row["mb_per_s"] / pipe
    return {"raw_pipe_mb_per_s": pipe, "raw_pipe_range_mb_per_s": [min(pipes), max(pipes)], "rows": rows}


def ssh_dispatch(repeats: int) -> dict:
    """The same trivial all_reduce on two ssh "hosts" (an OpenSSH server on 127.0.0.1 and
    127.0.0.2): what connecting, shipping the package and starting agents over SSH adds."""
    import tempfile

    from tests.harness.sshd import SSHServer, free_port

    hosts = ["127.0.0.1", "127.0.0.2"]
    server = SSHServer(Path(tempfile.mkdtemp(prefix="skytasks-bench-sshd-")), hosts, free_port())
    try:
        def pool() -> GPUPool:
            return GPUPool(provider="ssh", nodes=2, hosts=[f"root@{h}:{server.port}" for h in hosts],
                           ssh_private_key=server.client_key, known_hosts=server.known_hosts(),
                           remote_python=sys.executable)

        all_reduce = distributed_task(workloads.all_reduce_once, name="all_reduce")
        torchrun_s = statistics.median(torchrun("all_reduce")[0] for _ in range(repeats))
        all_reduce.with_options(pool=pool())()  # the package is shipped once, then cached on the node
        cold_s = statistics.median(timed(all_reduce.with_options(pool=pool()))[0] for _ in range(repeats))
        warm_pool = pool()
        with warm_pool:
            all_reduce.with_options(pool=warm_pool)()
            warm_s = statistics.median(timed(all_reduce.with_options(pool=warm_pool))[0] for _ in range(10))
    finally:
        server.stop()
    return {"torchrun_s": torchrun_s, "cold_s": cold_s, "warm_s": warm_s,
            "cold_ratio": cold_s / torchrun_s, "warm_ratio": warm_s / torchrun_s}


def _figure(args: argparse.Namespace, out: Path, results: dict, key: str, run, report) -> bool:
    """One section: measure, print, and with --only write it alone into results.json (True: done)."""
    results[key] = figures = run()
    report(figures)
    if args.only:
        update_results(out, **{key: figures})
    return bool(args.only)


def _kubernetes(repeats: int) -> dict:
    from benchmarks.k8s_pool import kubernetes_pools

    torchrun_s = statistics.median(torchrun("all_reduce")[0] for _ in range(repeats))
    return kubernetes_pools(torchrun_s, repeats=repeats)


def _load(quick: bool) -> list[dict]:
    from benchmarks.load import TUNED_SERVER, load

    flows, calls = (4, 10) if quick else (16, 50)
    rows = []
    # Prefect alone first (the same flows, as many task runs by Prefect's own @task), then
    # skytasks on the same server settings, then on a server whose recorders write in batches.
    for plain, settings in ((True, None), (False, None), (False, TUNED_SERVER)):
        reports.load_row(flows, calls, plain, settings is not None)
        rows.append(row := load(flows, calls, server_settings=settings, plain=plain))
        reports.load_row(flows, calls, plain, settings is not None, row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    parser.add_argument("--only", choices=["startup", "cli", "dispatch", "broadcast", "ssh", "slurm", "recovery", "preemption",
                                           "flow", "scale", "load", "kubernetes"],
                        help="run one figure (flow: warm calls and fan-out inside a flow; startup: a warm attach's first "
                             "call, a cold first call and skytasks run, each against torchrun) and update results.json")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    results: dict = {"machine": f"{os.cpu_count()} cores", "python": sys.version.split()[0]}
    out = HERE / "results.json"
    root = os.geteuid() == 0  # the SLURM and Kubernetes test clusters run as root

    def cli_run() -> dict:
        from benchmarks.cli_run import cli_run

        return cli_run(repeats)

    def startup() -> dict:
        from benchmarks.startup import startup

        return startup(3 if args.quick else 5)  # medians of 5 rounds: the figures issue 60 states

    def slurm() -> dict:
        from benchmarks.slurm_dispatch import slurm_dispatch

        return slurm_dispatch(repeats)

    def recovery() -> dict:
        from benchmarks.recovery import recovery

        return recovery(repeats)

    def preemption() -> dict:
        from benchmarks.preemption import preemption

        return preemption(repeats)

    sizes = ([10, 100] if args.quick else [10, 100, 500], [2] if args.quick else [2, 4])
    sections = [  # (--only's name, run without --only, results' key, measure, report)
        ("startup", True, "startup", startup, reports.startup),
        ("cli", True, "cli_run", cli_run, reports.cli),
        ("broadcast", True, "broadcast", lambda: broadcast(*sizes), reports.broadcast),
        ("ssh", True, "ssh_dispatch", lambda: ssh_dispatch(repeats), reports.ssh),
        ("slurm", root, "slurm_dispatch", slurm, reports.slurm),
        ("kubernetes", root, "kubernetes", lambda: _kubernetes(repeats), reports.kubernetes),
        ("recovery", True, "recovery", recovery, reports.recovery),
        ("preemption", True, "preemption", preemption, reports.preemption),
    ]
    for name, by_default, key, run, report in sections:
        if args.only == name or (args.only is None and by_default):
            if _figure(args, out, results, key, run, report):
                return

    if args.only == "scale":
        from benchmarks.scale import scale

        print("\nscale: real agents and ranks, 8 per node, init_torch=False")
        rows = scale([16, 64, 256] if args.quick else [16, 64, 256, 1024], repeats)
        return update_results(out, scale=rows)

    if args.only == "load":
        return update_results(out, load=_load(args.quick))

    from prefect.testing.utilities import prefect_test_harness

    if args.only == "flow":
        fastest = min(torchrun("all_reduce")[0] for _ in range(repeats))
        with prefect_test_harness(server_startup_timeout=120):
            w = warm_in_flow(fastest)
            rows = fan_out([2, 8, 64])
        reports.flow_only(w, rows, fastest)
        return update_results(out, warm_in_flow={**w, "torchrun_fastest_s": fastest}, fan_out_in_flow_check=rows)

    results["dispatch"] = d = dispatch(repeats)
    reports.dispatch(d)
    if args.only == "dispatch":
        return update_results(out, dispatch=d)

    with prefect_test_harness(server_startup_timeout=120):
        results["warm_in_flow"] = w = warm_in_flow(d["torchrun_s"])
        results["fan_out"] = rows = fan_out([2, 4, 8, 16] if args.quick else [2, 4, 8, 16, 32, 64])
    reports.in_flow(w)
    results["throughput"] = t = throughput(repeats)
    reports.throughput(t)
    reports.fan_out(rows)

    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
