"""Screenshot a Kubernetes call's flow run in Prefect's UI: start a Prefect server on loopback and
the test cluster (tests/harness/k8s/: a real Kubernetes v1.20.2 on this machine), keep the pool's
pods Pending for a few seconds behind a "blocker" pod that holds the node's CPU, then delete it so
they schedule and the call runs. Headless Chromium, driven over the DevTools protocol as in
scripts/screenshot_flow_run.py (whose helpers this reuses), waits for what each picture shows:

- `k8s-flow-run.png`: the flow run page, its log with the scheduler's reason the pods waited;
- `k8s-flow-run-graph.png`: its graph with the parent task run expanded to its rank runs;
- `k8s-rank-task-run.png`: rank 0's task run page (its lines, then what it used);
- `k8s-rank-state.png`: the event of rank 0's Completed state (Event Feed, Raw), whose message
  names its pod and node (the UI shows a task run's state message nowhere else);
- `k8s-artifacts.png`: the flow run's artifacts: the pool's launch progress and the call's;
- `k8s-rank-table.png`: the `train-ranks` table scrolled to its address column, which names each
  rank's pod and node.

    .venv/bin/python scripts/screenshot_kubernetes.py OUT_DIR

Needs root, the cluster's binaries (`make system-deps`) and chromium. Only one test cluster can
run on a machine (its node's address is fixed): this waits until no other kube-apiserver runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from scripts.screenshot_flow_run import (
    WIDTH,
    Page,
    _chromium,
    _free_port,
    _graph_expanded,
    _latest_flow_run,
    _stop,
    _wait_healthy,
    devtools_page,
)

ROOT = Path(__file__).resolve().parent.parent

STEPS = 8


def train(steps: int) -> dict:
    """Each rank: a few steps of an all_reduce, reported as it goes."""
    import socket
    import time

    import torch
    import torch.distributed as dist

    from skytasks import rank_info, report

    info = rank_info()
    total = torch.zeros(1)
    for step in range(1, steps + 1):
        t = torch.tensor([float(info.rank + step)])
        dist.all_reduce(t)
        total += t
        report(step=step, steps=steps, sum=t.item())
        time.sleep(0.5)
    print(f"rank {info.rank} in pod {socket.gethostname()}: {steps} all_reduce steps, total {total.item():.0f}")
    return {"rank": info.rank, "pod": socket.gethostname(), "total": total.item()}


# -- the cluster -------------------------------------------------------------------------------------


def _apiserver_running() -> bool:
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "kube-apiserver":
                return True
        except OSError:
            pass
    return False


def _wait_for_no_other_cluster(timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    said = False
    while _apiserver_running():
        if not said:
            print("another Kubernetes test cluster runs on this machine: waiting until it stops", flush=True)
            said = True
        if time.monotonic() > deadline:
            raise RuntimeError("another Kubernetes test cluster kept running")
        time.sleep(5)


def _millicores(cpu: str) -> int:
    return int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)


def _start_blocker(cluster) -> None:
    """A pod that requests all but 150m of the node's allocatable CPU, so that pods asking 200m
    wait with "Insufficient cpu"; returns once it is scheduled."""
    node = json.loads(cluster.kubectl("get", "node", cluster.node_name, "-o", "json").stdout)
    allocatable = _millicores(node["status"]["allocatable"]["cpu"])
    template = cluster.host_python_template()
    container = {**template["spec"]["containers"][0], "name": "blocker",
                 "command": [sys.executable, "-c", "import time; time.sleep(600)"],
                 "resources": {"requests": {"cpu": f"{allocatable - 150}m"}}}
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "blocker", "namespace": "default"},
                "spec": {"volumes": template["spec"]["volumes"], "containers": [container],
                         "terminationGracePeriodSeconds": 0, "restartPolicy": "Never"}}
    path = cluster.folder / "blocker.json"
    path.write_text(json.dumps(manifest))
    cluster.kubectl("apply", "-f", str(path))
    cluster.kubectl("wait", "--for=condition=PodScheduled", "pod/blocker", "--timeout=60s", timeout=90)
    print(f"blocker pod holds {allocatable - 150}m of the node's {allocatable}m CPU", flush=True)


def _unblock_after_pending(cluster, seconds: float = 5.0, timeout: float = 60.0) -> None:
    """Once a pod of the pool is Unschedulable, wait `seconds` more (so the reason reaches the
    log), then delete the blocker."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = json.loads(cluster.kubectl("get", "pods", "-l", "app.kubernetes.io/managed-by=skytasks", "-o", "json",
                                          check=False).stdout or "{}").get("items", [])
        if any(c.get("reason") == "Unschedulable" for p in pods for c in p.get("status", {}).get("conditions") or []):
            break
        time.sleep(0.5)
    time.sleep(seconds)
    cluster.kubectl("delete", "pod", "blocker", "--grace-period=0", "--force", "--wait=false", check=False)
    print("blocker pod deleted", flush=True)


def _run_flow(cluster) -> None:
    from prefect import flow, get_run_logger

    from skytasks import distributed_task
    from tests.harness.kube import kube_pool

    template = cluster.host_python_template()
    template["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "200m"}}
    pool = kube_pool(cluster, nodes=2, k8s_pod_template=template)
    task = distributed_task(train, pool=pool, name="train")

    @flow(name="k8s-train", log_prints=True)
    def k8s_train(steps: int = STEPS) -> list[dict]:
        results = task(steps)
        get_run_logger().info("ranks ran in pods %s", ", ".join(r["pod"] for r in results))
        return results

    unblock = threading.Thread(target=_unblock_after_pending, args=(cluster,), daemon=True)
    unblock.start()
    k8s_train()
    unblock.join(timeout=60)


# -- the pictures ------------------------------------------------------------------------------------


async def _shoot(devtools_port: int, ui: str, run: dict, tasks: list[dict], artifacts: list[dict],
                 state_event: dict, out_dir: Path) -> None:
    async with devtools_page(devtools_port) as page:
        flow_url = f"{ui}/runs/flow-run/{run['id']}"
        await page.open(flow_url, shows="Insufficient cpu")
        await page.screenshot(out_dir / "k8s-flow-run.png")
        rank0 = next(t for t in tasks if t["name"].endswith("[rank 0/2]"))
        await page.open(f"{ui}/runs/task-run/{rank0['id']}", shows="[rank 0]")
        await page.wait_for("used over the call")
        await page.screenshot(out_dir / "k8s-rank-task-run.png")
        await _graph_expanded(page, flow_url, out_dir / "k8s-flow-run-graph.png")
        await page.open(flow_url, shows=run["name"])
        await _click_text(page, "Artifacts")
        await page.wait_for("train-ranks")
        await page.screenshot(out_dir / "k8s-artifacts.png")
        await page.send("Emulation.setDeviceMetricsOverride", width=WIDTH, height=760, deviceScaleFactor=1,
                        mobile=False)
        day = state_event["occurred"][:10]
        await page.open(f"{ui}/events/event/{day}/{state_event['id']}", shows="Task run completed")
        await _click_text(page, "Raw")
        await page.wait_for("on node")
        await page.screenshot(out_dir / "k8s-rank-state.png")
        # The table is wider than its pane: scrolled (as a reader would) to the columns that say
        # where each rank ran.
        ranks = next(a for a in artifacts if a["key"] == "train-ranks")
        await page.send("Emulation.setDeviceMetricsOverride", width=WIDTH, height=480, deviceScaleFactor=1,
                        mobile=False)
        await page.open(f"{ui}/artifacts/artifact/{ranks['id']}", shows="on node")
        await page.send("Runtime.evaluate", expression="""(() => { const t = document.querySelector('.p-table');
            const th = [...t.querySelectorAll('th')].find(e => e.textContent.trim() === 'attempt');
            t.scrollLeft = th.offsetLeft; })()""")
        await asyncio.sleep(1.0)
        await page.screenshot(out_dir / "k8s-rank-table.png")


async def _click_text(page: Page, text: str) -> None:
    await page.send("Runtime.evaluate", expression=f"""[...document.querySelectorAll('*')]
        .filter(e => e.children.length === 0 && e.textContent.trim() === {json.dumps(text)}).pop().click()""")


def _completed_event(api: str, task_run_id: str, timeout: float = 30.0) -> dict:
    """The `prefect.task-run.Completed` event of a task run (events are stored a moment after)."""
    deadline = time.monotonic() + timeout
    while True:
        found = httpx.post(f"{api}/events/filter", json={"filter": {
            "any_resource": {"id": [f"prefect.task-run.{task_run_id}"]},
            "event": {"name": ["prefect.task-run.Completed"]}}, "limit": 5}).json()["events"]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no Completed event for task run {task_run_id}")
        time.sleep(1.0)


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    home, work = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp(prefix="skytasks-k8s-shots-"))
    port, devtools_port = _free_port(), _free_port()
    api, ui = f"http://127.0.0.1:{port}/api", f"http://127.0.0.1:{port}"
    os.environ.update({"PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "PREFECT_UI_API_URL": api})
    from tests.harness.k8s import K8sCluster

    # SIGTERM ends the script through its finally: the cluster, the server and Chromium stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    _wait_for_no_other_cluster()
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=dict(os.environ), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    browser, cluster = None, None
    profile, ok = tempfile.mkdtemp(), False
    try:
        cluster = K8sCluster(work / "cluster")
        cluster.start(timeout=300)
        print(f"cluster up in {cluster.timings['start']:.0f} s", flush=True)
        _wait_healthy(api)
        _start_blocker(cluster)
        _run_flow(cluster)
        cluster.stop()  # nothing below needs it
        run, tasks = _latest_flow_run(api)
        for t in sorted(tasks, key=lambda t: t["name"]):
            print(f"{t['name']}: {t['state']['type']} {t['state'].get('message') or ''}")
        rank0 = next(t for t in tasks if t["name"].endswith("[rank 0/2]"))
        state_event = _completed_event(api, rank0["id"])
        artifacts = httpx.post(f"{api}/artifacts/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}).json()
        print(f"artifacts of the flow run: {sorted(a['key'] for a in artifacts)}")
        browser = _chromium(profile, devtools_port)
        asyncio.run(_shoot(devtools_port, ui, run, tasks, artifacts, state_event, out_dir))
        ok = True
    finally:
        if cluster is not None:
            cluster.stop()
        _stop((browser, server), profile, home)
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"the cluster's logs are in {work / 'cluster' / 'log'}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "screenshots"))
