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

from benchmarks import workloads  # noqa: E402
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


def update_results(out: Path, **figures: object) -> None:
    """`--only`: these figures into results.json, the others kept as they were."""
    merged = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**merged, **figures}, indent=2))
    print(f"\nupdated {out}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    parser.add_argument("--only", choices=["cli", "dispatch", "broadcast", "ssh", "slurm", "recovery", "preemption",
                                           "flow", "scale", "load", "kubernetes"],
                        help="run one figure (flow: warm calls and fan-out inside a flow) and update results.json")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    results: dict = {"machine": f"{os.cpu_count()} cores", "python": sys.version.split()[0]}
    out = HERE / "results.json"

    if args.only is None or args.only == "cli":
        from benchmarks.cli_run import cli_run

        results["cli_run"] = c = cli_run(repeats)
        print("\n0. the same 4-rank script, `torchrun --nproc-per-node 4` against `skytasks run --nodes 2 "
              "--procs-per-node 2` (median wall seconds of whole commands)")
        print(f"   torchrun {c['torchrun_s']:.2f}   skytasks run, a server running {c['with_server_s']:.2f} "
              f"({c['with_server_ratio']:.2f}x)   none configured {c['no_server_s']:.2f} ({c['no_server_ratio']:.2f}x)")
        if args.only:
            return update_results(out, cli_run=c)

    if args.only is None or args.only == "broadcast":
        results["broadcast"] = b = broadcast([10, 100] if args.quick else [10, 100, 500], [2] if args.quick else [2, 4])
        low, high = b["raw_pipe_range_mb_per_s"]
        print(f"\n4. argument broadcast (raw pipe on this machine: median {b['raw_pipe_mb_per_s']:.0f} MB/s, "
              f"{low:.0f}-{high:.0f} through the run)")
        print("   nodes    MB  peer TLS  call (median)  MB/s moved  of pipe  same bytes again")
        for r in b["rows"]:
            tls = {True: "on", False: "off", None: "-"}[r["peer_tls"]]
            print(f"   {r['nodes']:>5} {r['mb']:>5}  {tls:>8}  {r['call_s']:>13.3f}  {r['mb_per_s']:>10.0f}  "
                  f"{r['fraction_of_pipe']:>6.0%}  {r['repeat_s']:>16.3f}")
        if args.only:
            return update_results(out, broadcast=b)

    if args.only is None or args.only == "ssh":
        results["ssh_dispatch"] = d = ssh_dispatch(repeats)
        print("\n5. trivial all_reduce on 2 ssh hosts, 1 rank each (median seconds)")
        print(f"   torchrun (local, 2 procs) {d['torchrun_s']:.2f}   skytasks ssh cold {d['cold_s']:.2f} "
              f"({d['cold_ratio']:.2f}x)   warm {d['warm_s']:.4f} ({d['warm_ratio']:.4f}x)")
        if args.only:
            return update_results(out, ssh_dispatch=d)

    if args.only == "slurm" or (args.only is None and os.geteuid() == 0):
        from benchmarks.slurm_dispatch import slurm_dispatch

        results["slurm_dispatch"] = d = slurm_dispatch(repeats)
        print("\n5b. trivial all_reduce on 2 SLURM nodes, 1 rank each (median seconds)")
        print(f"   torchrun (srun in a running allocation) {d['torchrun_s']:.2f}   skytasks slurm cold, own "
              f"allocation {d['cold_s']:.2f} ({d['cold_ratio']:.2f}x)   warm {d['warm_s']:.4f} ({d['warm_ratio']:.4f}x)")
        if args.only:
            return update_results(out, slurm_dispatch=d)

    if args.only == "kubernetes" or (args.only is None and os.geteuid() == 0):
        from benchmarks.k8s_pool import kubernetes_pools

        torchrun_s = statistics.median(torchrun("all_reduce")[0] for _ in range(repeats))
        results["kubernetes"] = k = kubernetes_pools(torchrun_s, repeats=repeats)
        print("\n5c. Kubernetes (the test cluster's real kubelet): a pool up, a warm call, an unschedulable pod's "
              "error, a lost pod's retry (median seconds; torchrun's whole process: "
              f"{k['torchrun_s']:.2f})")
        print("   " + "   ".join(f"{n} pods up {k[f'pool_up_{n}_s']:.2f} ({k[f'pool_up_{n}_ratio']:.1f}x)"
                                  for n in (2, 4, 8)))
        print(f"   warm call {k['warm_s']:.4f} ({k['warm_ratio']:.4f}x)   unschedulable -> error "
              f"{k['unschedulable_error_s']:.2f}   pod deleted -> retry's ranks ran {k['lost_pod_to_retry_s']:.2f}")
        if args.only:
            return update_results(out, kubernetes=k)

    if args.only is None or args.only == "recovery":
        from benchmarks.recovery import recovery

        results["recovery"] = r = recovery(repeats)
        print("\n6. recovery on the local pool (median seconds)")
        print(f"   a node is lost -> replaced, and the retry's ranks running: {r['lost_node_to_retry_running_s']:.2f}")
        print(f"   hang detected -> the caller has the error: {r['hang_detected_to_error_s']:.2f}")
        if args.only:
            return update_results(out, recovery=r)

    if args.only is None or args.only == "preemption":
        from benchmarks.preemption import preemption

        results["preemption"] = p = preemption(repeats)
        print("\n7. a preemption notice on an elastic local pool, 2 nodes x 2 ranks (median seconds after the notice)")
        print(f"   every rank knows {p['every_rank_s']:.3f}   the head's checkpoint on disk "
              f"{p['checkpoint_on_disk_s']:.3f}   the retry running on the node left {p['retry_running_s']:.2f}")
        if args.only:
            return update_results(out, preemption=p)

    if args.only == "scale":
        from benchmarks.scale import scale

        print("\nscale: real agents and ranks, 8 per node, init_torch=False")
        rows = scale([16, 64, 256] if args.quick else [16, 64, 256, 1024], repeats)
        return update_results(out, scale=rows)

    if args.only == "load":
        from benchmarks.load import TUNED_SERVER, load

        flows, calls = (4, 10) if args.quick else (16, 50)
        rows = []
        # Prefect alone first (the same flows, as many task runs by Prefect's own @task), then
        # skytasks on the same server settings, then on a server whose recorders write in batches.
        for plain, settings in ((True, None), (False, None), (False, TUNED_SERVER)):
            print(f"\nload: {flows} flows at once x {calls} warm calls, 4 ranks each, Prefect server on PostgreSQL "
                  f"({'its recorder batching' if settings else 'its defaults'})"
                  + (": Prefect's own tasks, as many task runs (the baseline)" if plain else ""))
            rows.append(row := load(flows, calls, server_settings=settings, plain=plain))
            print(f"   flows took {row['flows_took_s']:.1f}s; the record settled {row['settled_after_flows_s']:.1f}s "
                  f"after the last ended; task runs {row['task_runs']} of {row['task_runs_expected']} "
                  f"({row['task_runs_final']} final), logs {row['logs']} ({row['logs_per_call']:.1f} a call)")
        return update_results(out, load=rows)

    if args.only == "flow":
        from prefect.testing.utilities import prefect_test_harness

        fastest = min(torchrun("all_reduce")[0] for _ in range(repeats))
        with prefect_test_harness(server_startup_timeout=120):
            w = warm_in_flow(fastest)
            rows = fan_out([2, 8, 64])
        print(f"warm in flow: median {w['median_s']:.3f} ({w['median_ratio']:.3f}x fastest torchrun {fastest:.2f}), "
              f"p90 {w['p90_s']:.3f} ({w['p90_over_median']:.2f}x), max {w['max_s']:.3f}, "
              f"plain task {w['plain_task_median_s']:.3f}")
        for r in rows:
            print(f"fan-out {r['ranks']}: outside a flow {r['call_s']:.2f}, in a flow {r['call_in_flow_s']:.2f}, "
                  f"Prefect part {r['prefect_s']:.2f}")
        return update_results(out, warm_in_flow={**w, "torchrun_fastest_s": fastest}, fan_out_in_flow_check=rows)

    results["dispatch"] = d = dispatch(repeats)
    print("\n1. trivial 2-rank all_reduce (median seconds)")
    print(f"   torchrun fastest {d['torchrun_s']:.2f} (--standalone {d['torchrun_standalone_s']:.2f})"
          f"   skytasks cold, a controller's first {d['first_cold_s']:.2f} ({d['first_cold_ratio']:.2f}x)"
          f"   cold, later {d['cold_s']:.2f} ({d['cold_ratio']:.2f}x)   warm {d['warm_s']:.4f} ({d['warm_ratio']:.4f}x)")
    if args.only == "dispatch":
        return update_results(out, dispatch=d)

    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        results["warm_in_flow"] = w = warm_in_flow(d["torchrun_s"])
        results["fan_out"] = rows = fan_out([2, 4, 8, 16] if args.quick else [2, 4, 8, 16, 32, 64])
    print(f"\n1b. the same call, warm, {w['calls']} times inside a flow (seconds)")
    print(f"   plain Prefect task {w['plain_task_median_s']:.3f}   skytasks median {w['median_s']:.3f} "
          f"({w['median_ratio']:.3f}x fastest torchrun)   p90 {w['p90_s']:.3f} ({w['p90_over_median']:.2f}x median)"
          f"   max {w['max_s']:.3f}")

    results["throughput"] = t = throughput(repeats)
    print("\n2. DDP training throughput (steps/s, same model and data)")
    print(f"   torchrun {t['torchrun_steps_per_s']:.1f}   skytasks {t['skytasks_steps_per_s']:.1f} ({t['ratio']:.3f}x)")

    print("\n3. fan-out on the local pool, init_torch=False (seconds)")
    print("   ranks  all running  call  call in flow  Prefect part")
    for r in rows:
        print(f"   {r['ranks']:>5}  {r['all_running_s']:>11.2f}  {r['call_s']:>4.2f}  {r['call_in_flow_s']:>12.2f}  {r['prefect_s']:>12.2f}")


    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
