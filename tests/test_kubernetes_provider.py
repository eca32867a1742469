"""provider="kubernetes" against a real Kubernetes (tests/harness/k8s/: etcd, kube-apiserver,
controller-manager, scheduler, and a kubelet with containerd and runc running real containers).

The controller reaches its pods through the API server only: nothing listens on this machine
for them. After every test the API server holds nothing the pool made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from skytasks import PoolConfigError, PoolStartError, distributed_task, rank_info
from skytasks.events import NodeLost, NodeReplaced, listen
from tests.harness.kube import Said, held, kube_pool
from tests.harness.workloads import hf_train, lightning_fit

ROOT = Path(__file__).resolve().parent.parent


def where():
    import socket

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank_info().rank + 1)])
    dist.all_reduce(t)
    info = rank_info()
    return dict(rank=info.rank, host=socket.gethostname(), master=os.environ["MASTER_ADDR"], sum=t.item(),
                secret=os.environ.get("MY_TOKEN"), aws=os.environ.get("AWS_SECRET_ACCESS_KEY"),
                shm=os.statvfs("/dev/shm").f_bsize > 0 and os.path.ismount("/dev/shm"))


def test_two_pods_run_a_call_with_their_own_ips_and_nothing_secret_in_any_pod_spec(k8s):
    secret, aws = "tok-3f9a7c", "aws-9b2d1e"
    pool = kube_pool(k8s, env={"MY_TOKEN": secret},
                     aws_credentials={"aws_access_key_id": "AKIATEST", "aws_secret_access_key": aws})
    with pool:
        out = distributed_task(where, pool=pool)()
        specs = k8s.kubectl("get", "pods", "-l", "app.kubernetes.io/managed-by=skytasks", "-o", "json").stdout
        pods = {p["metadata"]["name"]: p for p in json.loads(specs)["items"]}
    assert [o["rank"] for o in out] == [0, 1] and {o["sum"] for o in out} == {3.0}
    assert {o["host"] for o in out} == set(pods)  # each rank in a pod of its own
    head = next(p for p in pods.values() if p["metadata"]["labels"]["skytasks.io/node"] == "0")
    assert {o["master"] for o in out} == {head["status"]["podIP"]}
    assert all(o["secret"] == secret and o["aws"] == aws and o["shm"] for o in out)
    assert secret not in specs and aws not in specs
    assert held(k8s) == []  # the pool's exit deleted everything and waited until it was gone


def test_on_a_fixed_cluster_a_pod_no_node_can_take_fails_the_start_at_once_naming_the_field(k8s):
    started = time.monotonic()
    with pytest.raises(PoolStartError, match="^k8s_node_selector") as caught:
        with kube_pool(k8s, k8s_node_selector={"skytasks-test/no-such-label": "x"}, k8s_autoscaler="none"):
            pass
    assert time.monotonic() - started < 20  # not the ready timeout (90 s)
    assert "didn't match" in str(caught.value) and "every pod was deleted" in str(caught.value)


def test_an_image_that_does_not_exist_fails_the_start_at_once(k8s):
    template = k8s.host_python_template()
    template["spec"]["containers"][0]["image"] = "skytasks-test/no-such-image:1"
    template["spec"]["containers"][0]["imagePullPolicy"] = "Never"
    with pytest.raises(PoolStartError, match="^k8s_image") as caught:
        with kube_pool(k8s, k8s_pod_template=template):
            pass
    assert "ErrImageNeverPull" in str(caught.value)


def test_pods_waiting_for_room_say_why_within_seconds_and_fail_at_the_ready_timeout(k8s):
    with Said() as said:
        with pytest.raises(PoolStartError, match="ready_timeout_seconds") as caught:
            with kube_pool(k8s, k8s_cpu="64", ready_timeout_seconds=8):
                pass
    first = next(t for t, text in said.lines if "Insufficient cpu" in text)
    assert first < 5, said.lines  # the scheduler's own words, within seconds
    assert "Insufficient cpu" in str(caught.value)


def test_a_python_without_torch_fails_the_start_naming_remote_python(k8s):
    with pytest.raises(PoolStartError, match="remote_python") as caught:
        with kube_pool(k8s, remote_python="/usr/bin/python3"):
            pass
    assert "/usr/bin/python3" in str(caught.value) and "torch" in str(caught.value)


def test_a_deleted_pod_is_a_lost_node_replaced_from_node_recoveries(k8s, tmp_path):
    marker = tmp_path / "rank1"
    pool = kube_pool(k8s, share=tmp_path)

    @distributed_task(pool=pool, retries=0)
    def slow(marker: str):
        import socket

        if rank_info().attempt == 1 and rank_info().rank == 1:
            Path(marker).write_text(socket.gethostname())
            time.sleep(120)
        return (rank_info().attempt, socket.gethostname())

    def delete_rank_1_pod() -> None:
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        k8s.kubectl("delete", "pod", marker.read_text(), "--grace-period=0", "--force", "--wait=false")

    with listen() as heard:
        with pool:
            threading.Thread(target=delete_rank_1_pod, daemon=True).start()
            out = slow(str(marker))
    lost = [e for e in heard if isinstance(e, NodeLost)]
    assert [e.node for e in lost] == [1] and [e.node for e in heard if isinstance(e, NodeReplaced)] == [1]
    assert "deleted" in lost[0].reason or "Kubernetes" in lost[0].reason, lost[0].reason
    assert [o[0] for o in out] == [2, 2] and out[1][1] != marker.read_text()


def test_a_pod_asked_to_leave_is_a_preemption_with_its_grace_period(k8s, tmp_path):
    from skytasks import Checkpointer, on_preemption

    marker = tmp_path / "rank1"
    pool = kube_pool(k8s, share=tmp_path)

    @distributed_task(pool=pool)
    def train(ckpt_dir: str, marker: str):
        import socket

        ckpt = Checkpointer(ckpt_dir)
        seen = {}
        on_preemption(lambda notice: seen.setdefault("deadline", notice.deadline))
        found = ckpt.load_latest()
        start = 0 if found is None else found[0] + 1
        for step in range(start, 4):
            ckpt.save({"step": step}, step)
            if rank_info().attempt == 1 and step == 1:
                if rank_info().rank == 1:
                    Path(marker).write_text(socket.gethostname())
                for _ in range(600):
                    if seen:
                        ckpt.save_if_preempted({"step": step}, step)
                        break
                    time.sleep(0.1)
                time.sleep(60)
        return (rank_info().attempt, start)

    deleted_at: list[float] = []

    def delete_gracefully() -> None:
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        deleted_at.append(time.time())
        # 20 s: the deletion's own grace, not the pod's terminationGracePeriodSeconds (30 s)
        k8s.kubectl("delete", "pod", marker.read_text(), "--grace-period=20", "--wait=false")

    from skytasks.events import NodePreempted

    with listen() as heard:
        with pool:
            threading.Thread(target=delete_gracefully, daemon=True).start()
            out = train(str(tmp_path / "ckpt"), str(marker))
    [preempted] = [e for e in heard if isinstance(e, NodePreempted)]
    assert preempted.node == 1 and "asked the pod to leave" in preempted.source
    assert preempted.deadline is not None and abs(preempted.deadline - (deleted_at[0] + 20)) < 5, \
        (preempted.deadline, deleted_at)  # the deletion's deadline, as the API server set it
    assert out == [(2, 2), (2, 2)]  # the next attempt went on from the step after the checkpoint


def holding_controller(k8s, folder: Path, pool_fields: str = "") -> subprocess.Popen:
    """A controller in a process of its own that starts a kube pool on the cluster (with
    `pool_fields`, Python keyword text) and holds it: it prints UP once the pool is up."""
    program = folder / "hold.py"
    program.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tests.harness.kube import kube_pool
        class C: pass
        cluster = C()
        cluster.image, cluster.admin_kubeconfig = {k8s.image!r}, {str(k8s.admin_kubeconfig)!r}
        cluster.host_python_template = lambda: {k8s.host_python_template()!r}
        with kube_pool(cluster, {pool_fields}):
            print("UP", flush=True)
            time.sleep(300)
    """))
    return subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("how", ["sigterm", "sigint"])
def test_a_controller_ended_by_a_signal_deletes_its_pods(k8s, tmp_path, how):
    proc = holding_controller(k8s, tmp_path)
    try:
        assert proc.stdout.readline().strip() == "UP"
        assert len([h for h in held(k8s) if h.startswith("pods/")]) == 2
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        proc.wait(90)
    finally:
        proc.kill()
    assert held(k8s) == []


def test_a_sigkilled_controllers_pods_end_themselves_and_gc_deletes_the_rest(k8s, tmp_path):
    proc = holding_controller(k8s, tmp_path, "idle_minutes=0.1")
    try:
        assert proc.stdout.readline().strip() == "UP"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    phases: list[str] = []
    while time.monotonic() < deadline:
        listed = json.loads(k8s.kubectl("get", "pods", "-l", "app.kubernetes.io/managed-by=skytasks", "-o",
                                        "json").stdout)["items"]
        phases = [p["status"].get("phase") for p in listed]
        if phases and all(ph in ("Succeeded", "Failed") for ph in phases):
            break
        time.sleep(0.5)
    assert phases == ["Succeeded", "Succeeded"]  # each ended itself: its controller fell silent
    env = {**os.environ, "KUBECONFIG": str(k8s.admin_kubeconfig)}
    swept = subprocess.run([sys.executable, "-m", "skytasks.cli", "gc", "--kubernetes"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert swept.returncode == 0 and "1 kubernetes pool(s) deleted" in swept.stdout, swept.stdout + swept.stderr
    assert "every pod has ended" in swept.stderr


@pytest.fixture(scope="module")
def limited(k8s_cluster):
    """A namespace where the identity `skytasks` holds exactly deployments/kubernetes/rbac.yaml,
    and `nobody` holds nothing."""
    ns = "limited"
    k8s_cluster.kubectl("create", "namespace", ns, check=False)
    k8s_cluster.kubectl("apply", "-n", ns, "-f", str(ROOT / "deployments/kubernetes/rbac.yaml"))
    k8s_cluster.kubectl("create", "serviceaccount", "nobody", "-n", ns, check=False)
    yield ns
    k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_pool_runs_with_exactly_the_rbac_file_and_without_it_names_the_permission(k8s, limited):
    allowed = k8s.kubeconfig_for_service_account(limited, "skytasks")
    pool = kube_pool(k8s, kubeconfig=allowed, k8s_namespace=limited)
    out = distributed_task(where, pool=pool)()
    assert [o["rank"] for o in out] == [0, 1]
    assert held(k8s, limited) == []
    nobody = k8s.kubeconfig_for_service_account(limited, "nobody")
    with pytest.raises(PoolConfigError, match="kubernetes_credentials: the pool's identity may not create configmaps"
                       ) as caught:
        with kube_pool(k8s, kubeconfig=nobody, k8s_namespace=limited):
            pass
    assert "rbac.yaml" in str(caught.value)


def test_skytasks_check_asks_the_cluster_without_starting_anything(k8s, limited):
    names = {"ok": (k8s.kubeconfig_for_service_account(limited, "skytasks"), {}),
             "bad": (k8s.kubeconfig_for_service_account(limited, "nobody"), {"k8s_service_account": "missing",
                                                                             "k8s_cpu": "64"})}
    said = {}
    for label, (kubeconfig, extra) in names.items():
        name = f"k8s-check-{label}-{os.getpid()}"
        kube_pool(k8s, kubeconfig=kubeconfig, k8s_namespace=limited, **extra).save(name, overwrite=True)
        from prefect.settings import PREFECT_API_URL

        said[label] = subprocess.run([sys.executable, "-m", "skytasks.cli", "check", "--pool", name],
                                     env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                                     capture_output=True, text=True, timeout=120)
    ok, bad = said["ok"], said["bad"]
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS  may do what a pool does in namespace 'limited'" in ok.stdout
    assert "PASS  namespace 'limited' exists" in ok.stdout
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL  may do what a pool does" in bad.stdout and "missing: create configmaps" in bad.stdout
    assert held(k8s, limited) == []


def test_a_controller_in_a_pod_uses_its_service_account(k8s, limited):
    """A flow's process that itself runs in a pod (a Prefect Kubernetes work pool's job): no
    credentials given, the pool finds the pod's service account and in-cluster configuration."""
    program = textwrap.dedent(f"""
        import sys
        from skytasks import GPUPool, distributed_task, rank_info
        pool = GPUPool(provider="kubernetes", nodes=2, k8s_namespace={limited!r}, k8s_image={k8s.image!r},
                       k8s_pod_template={k8s.host_python_template()!r}, remote_python=sys.executable,
                       ready_timeout_seconds=90)
        @distributed_task(pool=pool)
        def which():
            return rank_info().rank
        print("RESULT", which(), flush=True)
    """)
    template = k8s.host_python_template()
    container = template["spec"]["containers"][0]
    container.update(name="controller", command=[sys.executable, "-c", program],
                     env=[{"name": k, "value": v} for k, v in {**k8s.in_cluster_env(), "HOME": "/tmp"}.items()])
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "controller", "namespace": limited},
                "spec": {**template["spec"], "serviceAccountName": "skytasks", "restartPolicy": "Never"}}
    path = Path(k8s.folder) / "controller.json"
    path.write_text(json.dumps(manifest))
    k8s.kubectl("apply", "-f", str(path))
    try:
        deadline = time.monotonic() + 180
        phase = ""
        while time.monotonic() < deadline and phase not in ("Succeeded", "Failed"):
            time.sleep(1)
            phase = json.loads(k8s.kubectl("get", "pod", "controller", "-n", limited, "-o", "json").stdout)[
                "status"].get("phase", "")
        logs = k8s.kubectl("logs", "controller", "-n", limited, check=False).stdout
        status = k8s.kubectl("get", "pod", "controller", "-n", limited, "-o", "json").stdout
        assert phase == "Succeeded", logs[-3000:] + json.dumps(json.loads(status)["status"].get("containerStatuses"))
        assert "RESULT [0, 1]" in logs
    finally:
        k8s.kubectl("delete", "pod", "controller", "-n", limited, "--grace-period=0", "--force", check=False)
    assert held(k8s, limited) == []


def test_users_code_unchanged_on_two_pods(k8s, tmp_path):
    """The example flow on a saved kubernetes pool, a Lightning Trainer and a Hugging Face Trainer
    on the same pods, and a torchrun script through `skytasks run --pool`."""
    from flows.ddp_train import ddp_train
    from skytasks import GPUPool
    from tests.test_run_script import TRAIN

    name = f"k8s-example-{os.getpid()}"
    kube_pool(k8s).save(name, overwrite=True)  # the credentials block is saved with it, as a reference
    pool = GPUPool.load(name)
    with pool:
        results = ddp_train(epochs=2, samples=256, pool=name, checkpoint_dir="/tmp/ckpt")
        fitted = distributed_task(lightning_fit, pool=pool)("/tmp/lightning")
        hf = distributed_task(hf_train, pool=pool)(4)
    losses = results[0]["epoch_losses"]
    assert [r["rank"] for r in results] == [0, 1] and losses[-1] < losses[0]
    assert [(f["global_rank"], f["world_size"], f["node_rank"]) for f in fitted] == [(0, 2, 0), (1, 2, 1)]
    assert fitted[0]["weights"] == fitted[1]["weights"]  # one model, trained together
    assert [(h["world"], h["rank"]) for h in hf] == [(2, 0), (2, 1)] and hf[0]["weights"] == hf[1]["weights"]

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(TRAIN)
    (project / "helpers.py").write_text("def double(x):\n    return 2 * x\n")
    from prefect.settings import PREFECT_API_URL

    ran = subprocess.run([sys.executable, "-m", "skytasks.cli", "run", "--pool", name, "train.py", "--lr", "0.1",
                          "--out", "/tmp/out"], cwd=project, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "[rank 0] rank 0/2 sum=1.0 lr=0.1 double=4" in ran.stdout
    assert "[rank 1] rank 1/2 sum=1.0 lr=0.1 double=4" in ran.stdout
    assert held(k8s) == []
