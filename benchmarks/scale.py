"""Cluster scale on one machine: real node agents and real rank processes (8 per node,
`init_torch=False`), at 16, 64, 256 and 1,024 ranks.

    .venv/bin/python benchmarks/run.py --only scale [--quick]

For each size: the pool up with its first call; a warm empty call outside a flow and inside one
(against Prefect's test server); a large argument (100 MB up to 64 ranks; above, what fits 6 GB
in all, since every rank holds its own copy on this one machine); the first failure's report reaching the caller
(and how many console lines it printed, the machine's CPU per rank for it, and the floor under it: the
kernel ending as many forked processes, measured in the same run); a lost node to the next attempt's ranks running; a hang to
`HangError`; the controller's peak RSS and CPU seconds. Writes `docs/scale.png` when matplotlib is
there. Each size runs in a process of its own, so the controller's figures are that size's alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PER_NODE = 8


def empty() -> int:
    return 0


def takes(blob) -> int:
    return len(blob)


def one_fails(marker_dir: str) -> int:
    from skytasks import rank_info

    info = rank_info()
    if info.rank == info.world_size // 2:
        Path(marker_dir, "failed").write_text(repr(time.time()))
        raise ValueError(f"rank {info.rank} gives up")
    time.sleep(120)
    return info.rank


def lose_a_node(marker_dir: str) -> float:
    """Attempt 1: node 1's first rank kills its agent (the node is gone). Attempt 2: the time it runs."""
    import signal

    from skytasks import rank_info

    info = rank_info()
    if info.attempt == 1:
        if info.node_rank == 1 and info.local_rank == 0:
            Path(marker_dir, "killed").write_text(repr(time.time()))
            os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(120)
    return time.time()


def chatter(seconds: float) -> int:
    """10 lines a second, as a chatty training loop prints."""
    n = 0
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            print(f"step {n}: loss 0.{n % 1000:03d}")
            n += 1
        time.sleep(1)
    return n


def hang_forever() -> None:
    time.sleep(600)


def _machine_cpu_s() -> float:
    """CPU seconds this machine has spent busy (all processes, user and kernel), from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


_EXIT_FLOOR = """
import os, signal, sys, time
import skytasks.node.worker  # what a rank runs, as a rank template has it imported
held, alive = os.pipe()  # each child waits on it: if this process dies first, they see EOF and go
pids = []
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os.close(alive)
        os.read(held, 1)
        os._exit(0)
    pids.append(pid)
time.sleep(1.0)
t = time.perf_counter()
for pid in pids:
    os.kill(pid, signal.SIGKILL)
for pid in pids:
    os.waitpid(pid, 0)
print(time.perf_counter() - t)
"""


def _process_exit_floor(n: int) -> float:
    """Seconds for the kernel to end `n` forked processes of a rank's kind, all killed at once."""
    done = subprocess.run([sys.executable, "-c", _EXIT_FLOOR, str(n)], capture_output=True, text=True, cwd=ROOT,
                          check=True, timeout=300)
    return float(done.stdout.strip().splitlines()[-1])


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def measure(ranks: int, repeats: int) -> dict:
    """One size, in this process."""
    import numpy as np
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from skytasks import DistributedTaskError, GPUPool, distributed_task

    nodes = ranks // PER_NODE
    out: dict = {"ranks": ranks, "nodes": nodes}
    pool = GPUPool(nodes=nodes, procs_per_node=PER_NODE)
    task = distributed_task(empty, pool=pool, init_torch=False)
    started = time.perf_counter()
    with pool:
        assert len(task()) == ranks
        out["pool_up_and_first_call_s"] = time.perf_counter() - started
        warm = []
        for _ in range(max(5, repeats)):
            t = time.perf_counter()
            task()
            warm.append(time.perf_counter() - t)
        out["warm_call_s"] = _median(warm)
        with prefect_test_harness(server_startup_timeout=120):
            @flow
            def warm_calls() -> list[float]:
                times = []
                for _ in range(max(5, repeats)):
                    t = time.perf_counter()
                    task()
                    times.append(time.perf_counter() - t)
                return times

            warm_calls()  # the first: Prefect's task machinery warms up
            out["warm_call_in_flow_s"] = _median(warm_calls())
        # The steps below run on this pool, up and warm, as a flow's `with pool:` block has it: on a
        # pool of their own, a hang's figure would hold 1,024 ranks' start, and a failure's the whole
        # pool's teardown.
        marker = Path(os.environ.get("TMPDIR", "/tmp"), f"skytasks-scale-{os.getpid()}")
        marker.mkdir(exist_ok=True)
        # The first failure's report, and what the console shows of it.
        console = io.StringIO()
        cpu_before = _machine_cpu_s()
        with contextlib.redirect_stderr(console), contextlib.redirect_stdout(console):
            try:
                distributed_task(one_fails, pool=pool, init_torch=False, node_recoveries=0)(str(marker))
            except DistributedTaskError as err:
                caught = time.time()
                print(repr(err), file=sys.stderr)
        out["failure_report_s"] = caught - float((marker / "failed").read_text())
        # What the whole machine spent on it, per rank: the ranks' exits, their agents, the controller.
        out["failure_cpu_ms_per_rank"] = (_machine_cpu_s() - cpu_before) / ranks * 1000
        out["failure_console_lines"] = len(console.getvalue().splitlines())
        # The floor under that figure, in the same run: the kernel ending as many processes of a
        # rank's kind (forked from a process that imported what a rank template imports), with no
        # skytasks in the way. On one 2-core machine both are the kernel's exit work done 1,023 times.
        out["process_exit_floor_s"] = _process_exit_floor(ranks - 1)
        # A lost node, to the next attempt's ranks running (the pool brings a replacement up): lost
        # from a group that is up, so the figure is the loss's alone (the failure above broke the
        # group; the empty call brings the next one up first).
        task()
        values = distributed_task(lose_a_node, pool=pool, init_torch=False)(str(marker))
        killed = float((marker / "killed").read_text())
        out["lost_node_to_retry_running_s"] = min(values) - killed  # its first rank runs the call
        out["lost_node_to_retry_all_running_s"] = max(values) - killed  # its last one does
        # A hang, to the caller's HangError.
        hang = 2.0
        t = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                distributed_task(hang_forever, pool=pool, init_torch=False, hang_timeout_seconds=hang)()
            except DistributedTaskError:
                pass
        out["hang_to_error_s"] = time.perf_counter() - t - hang
        # Every rank printing 10 lines a second: the ranks must not wait on the record, and what the
        # record cannot take is dropped and counted (LinesDropped), never held without bound.
        from skytasks.events import LinesDropped, listen

        flood_s = 5.0
        t = time.perf_counter()
        with listen() as heard, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            printed = sum(distributed_task(chatter, pool=pool, init_torch=False)(flood_s))
        out["flood_lines"] = printed
        out["flood_call_over_its_length_s"] = time.perf_counter() - t - flood_s
        out["flood_lines_dropped"] = sum(e.total for e in heard if isinstance(e, LinesDropped))
        # Last: every rank keeps its own copy of an argument: on one machine, 100 MB x 1,024 ranks
        # is 100 GB. The argument is 100 MB up to 64 ranks and shrinks to fit 6 GB in all above.
        # It is `bytes`, which a rank unpickles with nothing to import: as a numpy array, 1,024
        # ranks would each import numpy for it, minutes of CPU and most of the machine's memory,
        # and the step would measure that instead of the relay (with nodes stalled past their
        # heartbeat).
        mb = min(100, 6000 // ranks)
        blob = np.random.default_rng(0).integers(0, 255, mb * 1024 * 1024, dtype=np.uint8).tobytes()
        from skytasks.controller.channel import bytes_sent

        takes_task = distributed_task(takes, pool=pool, init_torch=False)
        takes_task(b"")  # the group up, its relay listeners open
        t, sent = time.perf_counter(), bytes_sent()
        assert takes_task(blob)[0] == len(blob)
        out["broadcast_mb"] = mb
        out["broadcast_s"] = time.perf_counter() - t
        out["broadcast_mb_per_s_to_ranks"] = mb * ranks / out["broadcast_s"]
        # What the argument cost the controller's own link: once down the relay tree from 3
        # nodes up, once per node below that.
        out["controller_mb_sent_per_argument_mb"] = (bytes_sent() - sent) / len(blob)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["controller_peak_rss_mb"] = usage.ru_maxrss / 1024
    out["controller_cpu_s"] = usage.ru_utime + usage.ru_stime
    return out


def scale(sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for ranks in sizes:
        done = subprocess.run([sys.executable, "-m", "benchmarks.scale", str(ranks), str(repeats)], capture_output=True, text=True,
                              cwd=ROOT, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"scale {ranks} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"   {ranks:>5} ranks: {rows[-1]}", flush=True)
    _plot(rows)
    return rows


FIGURES = [("pool_up_and_first_call_s", "pool up + first call (s)"), ("warm_call_s", "warm call (s)"),
           ("warm_call_in_flow_s", "warm call in a flow (s)"), ("broadcast_mb_per_s_to_ranks", "argument MB/s reaching the ranks"),
           ("failure_report_s", "failure report (s)"), ("lost_node_to_retry_running_s", "lost node -> retry (s)"),
           ("hang_to_error_s", "hang -> HangError (s)"), ("controller_peak_rss_mb", "controller peak RSS (MB)"),
           ("controller_mb_sent_per_argument_mb", "controller MB sent per argument MB")]
# A figure's floor on this machine, measured in the same run, drawn beside it.
FLOORS = {"failure_report_s": ("process_exit_floor_s", "the kernel ending as many processes")}


def _plot(rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("   (no matplotlib: docs/scale.png not drawn)")
        return
    fig, axes = plt.subplots(3, 3, figsize=(14, 10))
    xs = [r["ranks"] for r in rows]
    for ax, (key, title) in zip(axes.flat, FIGURES):
        ax.plot(xs, [r[key] for r in rows], marker="o", label="skytasks")
        if key in FLOORS and all(FLOORS[key][0] in r for r in rows):
            floor, what = FLOORS[key]
            ax.plot(xs, [r[floor] for r in rows], marker="x", linestyle="--", color="grey", label=what)
            ax.legend(fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ranks (8 per node)")
        ax.grid(alpha=0.3)
    fig.suptitle("skytasks at scale on one 2-core machine: real agents and rank processes (init_torch=False)")
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "scale.png", dpi=80)
    print(f"   drew {ROOT / 'docs' / 'scale.png'}")


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
