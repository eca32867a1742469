"""SLURM dispatch: the trivial 2-rank all_reduce on a real (test) SLURM cluster of namespaced
nodes, skytasks against torchrun started with srun on the same kind of allocation.

    .venv/bin/python benchmarks/run.py --only slurm     (root; Debian's slurm packages)

torchrun's figure is measured inside an allocation that already runs (it needs one from
somewhere); skytasks' cold figure includes asking SLURM for its own allocation.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def slurm_dispatch(repeats: int) -> dict:
    import os

    from benchmarks import workloads
    from skytasks import GPUPool, distributed_task
    from tests.harness.slurm_cluster import SlurmCluster

    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="skytasks-bench-slurm-")), nodes=2, gpus_per_node=0).start()
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        job = cluster.run("sbatch", "--parsable", "--output=/dev/null", "-N2", "--wrap", "sleep 600").stdout.strip()
        while "RUNNING" not in cluster.run("squeue", "-h", "-j", job, "-o", "%T").stdout:
            time.sleep(0.2)
        head = cluster.addresses["n0"]

        def torchrun_once() -> float:
            started = time.perf_counter()
            cluster.run("srun", f"--jobid={job}", "--overlap", "-N2", "--ntasks-per-node=1", "bash", "-c",
                        # as a cluster's users set it: gloo on the interface the nodes share
                        f"GLOO_SOCKET_IFNAME=eth0 exec {sys.executable} -m torch.distributed.run --nnodes=2 --nproc_per_node=1 "
                        f"--node_rank=$SLURM_NODEID --master_addr={head} --master_port=29577 "
                        f"{HERE / 'torchrun_job.py'} all_reduce")
            return time.perf_counter() - started

        torchrun_s = statistics.median(torchrun_once() for _ in range(repeats))
        cluster.run("scancel", job, check=False)
        cluster.wait_queue_empty()

        def pool() -> GPUPool:
            return GPUPool(provider="slurm", nodes=2, remote_python=sys.executable)

        all_reduce = distributed_task(workloads.all_reduce_once, name="all_reduce")
        all_reduce.with_options(pool=pool())()  # the package reaches the nodes' cache once
        cold_s = statistics.median(timed(all_reduce.with_options(pool=pool())) for _ in range(repeats))
        warm_pool = pool()
        with warm_pool:
            all_reduce.with_options(pool=warm_pool)()
            warm_s = statistics.median(timed(all_reduce.with_options(pool=warm_pool)) for _ in range(10))
    finally:
        cluster.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
    return {"torchrun_s": torchrun_s, "cold_s": cold_s, "warm_s": warm_s,
            "cold_ratio": cold_s / torchrun_s, "warm_ratio": warm_s / torchrun_s}


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
