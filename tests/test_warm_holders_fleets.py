"""A warm pool's provider that cannot be read is never taken for gone (issue 58, item 2), on the real
SLURM and Kubernetes test clusters.

SLURM: slurmctld frozen (SIGSTOP) while a warm pool is held: `skytasks pools` probes it and a second
process waits for it; the holder's call returns whole, and once slurmctld answers again the waiter
runs on the same agents in the same allocation, one job in the queue.
Kubernetes: the kube-apiserver restarted while a second process attaches, under rbac.yaml's
service account: it attaches to the same pods, and nothing is deleted or doubled.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from skytasks import GPUPool
from tests.harness.conformance_clusters import pod_of
from tests.harness.conformance_warm import use, wait_until
from tests.harness.kube import held
from tests.harness.warm import api_env as _env

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).parent / "programs"


def save_slurm(name: str, **fields) -> None:
    GPUPool(provider="slurm", nodes=2, remote_python=sys.executable, ready_timeout_seconds=60, reattach_seconds=10,
            **{"keep_warm_minutes": 2.0, **fields}).save(name, overwrite=True)


def skytasks_jobs(cluster) -> list[str]:
    return [ln for ln in cluster.run("squeue", "-h", "-o", "%i %j").stdout.splitlines() if "skytasks" in ln]


def save_kubernetes(k8s_cluster, name: str, **fields) -> None:
    """A warm pool under exactly deployments/kubernetes/rbac.yaml's service account (issue 58)."""
    from tests.harness.conformance_clusters import KubernetesFleet

    KubernetesFleet(k8s_cluster).warm_pool(nodes=2, **{"reattach_seconds": 10, "keep_warm_minutes": 2.0,
                                                      **fields}).save(name, overwrite=True)


def pods_of(k8s_cluster, pool_pods: list[str]) -> dict[str, str]:
    """Each of these pods that still exists, and its phase."""
    from tests.harness.conformance_clusters import KubernetesFleet

    return KubernetesFleet(k8s_cluster).phases(pool_pods)


def _start(program: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PROGRAMS / program), *args], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"did not end within {timeout:g}s: {proc.communicate()[0][-6000:]}") from None
    assert proc.returncode == 0, out[-6000:]
    return out


def test_a_frozen_slurmctld_ends_nothing_of_a_held_warm_pool(cluster, pool_name, tmp_path):
    save_slurm(pool_name)
    holder = _start("warm_call.py", pool_name, str(tmp_path / "a.json"), "45")
    waiter = None
    try:
        wait_until(lambda: len(list(tmp_path.glob("a.json.ready*"))) == 2, 180, "the holder's ranks in its call")
        jobs = skytasks_jobs(cluster)
        assert len(jobs) == 1, jobs
        cluster.freeze_controller()
        try:
            frozen = time.monotonic()
            listed = subprocess.run([sys.executable, "-m", "skytasks.cli", "pools"], env=_env(), cwd=ROOT,
                                    capture_output=True, text=True, timeout=180)
            assert listed.returncode == 0, listed.stderr[-3000:]
            row = next(line for line in listed.stdout.splitlines() if line.startswith(pool_name))
            assert "ended" not in row, listed.stdout
            waiter = _start("warm_call.py", pool_name, str(tmp_path / "b.json"))
            time.sleep(max(0.0, 25 - (time.monotonic() - frozen)))  # the waiter asks while slurmctld is frozen
            assert waiter.poll() is None
        finally:
            cluster.thaw_controller()
        _finish(holder, 180)
        first = json.loads((tmp_path / "a.json").read_text())
        assert first["ranks"] == [0, 1]  # the holder's call returned whole
        _finish(waiter, 240)
        second = json.loads((tmp_path / "b.json").read_text())
        assert second["ranks"] == [0, 1] and second["pids"] == first["pids"]  # the same agents
        assert skytasks_jobs(cluster) == jobs  # the same allocation, one job in the queue
    finally:
        for proc in (holder, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_an_apiserver_restart_while_a_second_process_attaches_deletes_nothing(k8s_cluster, pool_name, tmp_path):
    save_kubernetes(k8s_cluster, pool_name)  # under rbac.yaml's service account
    first = use(pool_name, tmp_path / "first.json")
    pods = sorted(pod_of(w) for w in first["where"])
    before = sorted(held(k8s_cluster))
    assert len(before) == 3, before  # two pods and their owner
    second = _start("warm_call.py", pool_name, str(tmp_path / "second.json"))
    try:
        time.sleep(4)  # the second process is reading the pool's owner and its pods
        k8s_cluster.restart_apiserver()
        _finish(second, 300)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    out = json.loads((tmp_path / "second.json").read_text())
    assert sorted(pod_of(w) for w in out["where"]) == pods and out["ranks"] == [0, 1]
    assert sorted(held(k8s_cluster)) == before  # nothing deleted, nothing doubled
    assert set(pods_of(k8s_cluster, pods).values()) == {"Running"}
