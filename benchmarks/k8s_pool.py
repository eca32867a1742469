"""Kubernetes: the trivial all_reduce on pods of the real test cluster (tests/harness/k8s/: one
real kubelet with containerd), against torchrun's whole-process time in the same run.

    .venv/bin/python benchmarks/run.py --only kubernetes      (root; `make test` builds the cluster)

Measured: a pool up (pods created, scheduled, running, agents started over exec streams) for 2, 4
and 8 pods; a warm call on 2; how long until an unschedulable pod is the caller's error; and how
long from a pod deleted mid-call until the retry's ranks run on its replacement.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def kubernetes_pools(torchrun_s: float, sizes: tuple[int, ...] = (2, 4, 8), repeats: int = 3) -> dict:
    from benchmarks import workloads
    from skytasks import PoolStartError, distributed_task, rank_info
    from tests.harness.k8s import K8sCluster
    from tests.harness.kube import kube_pool, sharing

    cluster = K8sCluster(Path(tempfile.mkdtemp(prefix="skytasks-bench-k8s-"))).start()
    try:
        all_reduce = distributed_task(workloads.all_reduce_once, name="all_reduce")

        def small(share: Path | None = None, **fields):
            template = sharing(cluster, share) if share else cluster.host_python_template()
            template["spec"]["containers"].append({"resources": {"requests": {"cpu": "10m"}}})
            return kube_pool(cluster, k8s_pod_template=template, **fields)

        up: dict[int, float] = {}
        for n in sizes:
            runs = []
            for _ in range(repeats):
                pool = small(nodes=n)
                runs.append(timed(pool.__enter__))
                pool.__exit__(None, None, None)
            up[n] = statistics.median(runs)
        pool = small(nodes=2)
        with pool:
            all_reduce.with_options(pool=pool)()
            warm_s = statistics.median(timed(all_reduce.with_options(pool=pool)) for _ in range(10))
            cold_first = timed(all_reduce.with_options(pool=pool))

        started = time.perf_counter()
        try:
            with small(nodes=2, k8s_node_selector={"skytasks-bench/none": "x"}):
                pass
        except PoolStartError:
            pass
        unschedulable_s = time.perf_counter() - started

        marks: dict[str, float] = {}
        shared = Path(tempfile.mkdtemp())  # where the test and the pods meet
        marker = shared / "pod"
        lost_pool = small(nodes=2, share=shared)

        @distributed_task(pool=lost_pool)
        def long_step(marker: str):
            import socket

            if rank_info().attempt == 1:
                if rank_info().rank == 1:
                    Path(marker).write_text(socket.gethostname())
                time.sleep(120)
            return time.time()

        def delete_pod() -> None:
            while not marker.exists():
                time.sleep(0.05)
            marks["deleted"] = time.time()
            cluster.kubectl("delete", "pod", marker.read_text(), "--grace-period=0", "--force", "--wait=false")

        with lost_pool:
            threading.Thread(target=delete_pod, daemon=True).start()
            ended = long_step(str(marker))
        lost_to_running_s = min(ended) - marks["deleted"]
    finally:
        cluster.stop()
    return {"torchrun_s": torchrun_s, **{f"pool_up_{n}_s": s for n, s in up.items()},
            **{f"pool_up_{n}_ratio": s / torchrun_s for n, s in up.items()}, "warm_s": warm_s,
            "warm_ratio": warm_s / torchrun_s, "warm_single_s": cold_first, "unschedulable_error_s": unschedulable_s,
            "lost_pod_to_retry_s": lost_to_running_s}
