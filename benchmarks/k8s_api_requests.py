"""What a kubernetes pool costs the API server, in requests, counted by the API server itself.

    .venv/bin/python benchmarks/k8s_api_requests.py [--sizes 2,64] [--idle 60]      (root)

Starts the test cluster (tests/harness/k8s/: Kubernetes v1.20.2, one real kubelet), then:
- a background minute with no pool, to know what the cluster's own parts (kubelet, scheduler,
  controller-manager, the test DNS server) ask meanwhile;
- for each size, a real `GPUPool(provider="kubernetes")` (as tests/harness/kube.py builds it): its start
  (`with pool:` entered: pods made, running, agents up over exec streams), one idle minute inside
  `with pool:`, and its teardown.
Before and after each phase it reads the apiserver's /metrics: `apiserver_request_total` summed by
verb, resource and subresource, and `apiserver_response_sizes_sum` (bytes served). The idle rate is
net of the background minute's. A long-running request (a WATCH, an exec stream) is counted by
the apiserver when it ends, so an exec stream shows under teardown and a watch when it is renewed.

Writes the results into benchmarks/results-k8s-api.json under `--label` (other labels' runs are
kept: a "before" beside an "after") and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import ssl
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

OUT = HERE / "results-k8s-api.json"
# The requests a pool itself makes (the rest are the cluster's parts, answering to the pods).
POOL_ROWS = ("LIST pods", "WATCH pods", "LIST events", "WATCH events", "GET pods", "POST pods", "DELETE pods",
             "DELETECOLLECTION pods", "GET pods/exec", "POST pods/exec", "POST configmaps", "DELETE configmaps")
_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} ([0-9.e+-]+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metrics(cluster: Any) -> dict[str, Counter[str]]:
    """The apiserver's counters now: requests and bytes served, by "VERB resource[/subresource]"."""
    ctx = ssl.create_default_context(cafile=str(cluster.ca_cert))
    ctx.load_cert_chain(cluster.pki / "admin.crt", cluster.pki / "admin.key")
    with urllib.request.urlopen(f"{cluster.server}/metrics", context=ctx, timeout=30) as r:
        text = r.read().decode()
    out: dict[str, Counter[str]] = {"requests": Counter(), "bytes": Counter(), "open": Counter()}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in ("apiserver_request_total", "apiserver_response_sizes_sum",
                                       "apiserver_longrunning_gauge"):
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        key = f"{labels.get('verb', '?')} {resource or '-'}"
        which = {"apiserver_request_total": "requests", "apiserver_response_sizes_sum": "bytes",
                 "apiserver_longrunning_gauge": "open"}[m.group(1)]
        out[which][key] += float(m.group(3))
    return out


def delta(after: dict[str, Counter[str]], before: dict[str, Counter[str]], scale: float = 1.0) -> dict[str, dict]:
    return {k: {row: round((after[k][row] - before[k].get(row, 0)) * scale, 1)
                for row in after[k] if after[k][row] != before[k].get(row, 0)} for k in ("requests", "bytes")}


def net(rates: dict[str, dict], background: dict[str, dict]) -> dict[str, dict]:
    return {k: {row: round(v - background[k].get(row, 0), 1) for row, v in rates[k].items()} for k in rates}


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def measure(sizes: list[int], idle: float) -> dict:
    from tests.harness.k8s import K8sCluster
    from tests.harness.kube import kube_pool

    cluster = K8sCluster(Path(tempfile.mkdtemp(prefix="skytasks-bench-k8s-api-"))).start()
    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "idle_seconds": idle, "pools": {}}
    try:
        time.sleep(10)  # the cluster's parts settle (first leases, node status, service accounts)
        m0 = metrics(cluster)
        time.sleep(idle)
        background = delta(metrics(cluster), m0, 60.0 / idle)
        results["background_per_minute"] = background
        for n in sizes:
            template = cluster.host_python_template()
            template["spec"]["containers"].append({"resources": {"requests": {"cpu": "10m"}}})
            pool = kube_pool(cluster, nodes=n, k8s_pod_template=template, ready_timeout_seconds=900)
            free_before = mem_available_gib()
            before = metrics(cluster)
            t0 = time.monotonic()
            pool.__enter__()
            try:
                start_s = time.monotonic() - t0
                started = metrics(cluster)
                free_up = mem_available_gib()
                time.sleep(idle)
                idled = metrics(cluster)
            finally:
                t1 = time.monotonic()
                pool.__exit__(None, None, None)
                teardown_s = time.monotonic() - t1
            ended = metrics(cluster)
            results["pools"][str(n)] = {
                "start_seconds": round(start_s, 1), "teardown_seconds": round(teardown_s, 1),
                "memory_used_gib": round(free_before - free_up, 2),
                "start": delta(started, before),
                "idle_per_minute": net(delta(idled, started, 60.0 / idle), background),
                "teardown": delta(ended, idled),
                "open_while_idle": {r: v for r, v in idled["open"].items() if v},
            }
            print(f"pool of {n}: up in {start_s:.1f}s, torn down in {teardown_s:.1f}s", flush=True)
    finally:
        cluster.stop()
    return results


def table(results: dict) -> str:
    """Per size: the requests of the start, of each idle minute (net of the background), and of
    the teardown; the pool's own rows, then every request the apiserver served (the kubelet's and
    the scheduler's for the pool's pods too) and the bytes it sent."""
    sizes = list(results["pools"])
    phases = (("start", "start"), ("idle_per_minute", "idle/min"), ("teardown", "teardown"))
    lines = ["| request | " + " | ".join(f"{n} pods: {label}" for n in sizes for _, label in phases) + " |",
             "| --- |" + " ---: |" * (len(sizes) * len(phases))]

    def row(label: str, value: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(value(results["pools"][n][phase]) for n in sizes
                                                   for phase, _ in phases) + " |")

    for name in POOL_ROWS:
        if any(results["pools"][n][phase]["requests"].get(name) for n in sizes for phase, _ in phases):
            row(name, lambda p, name=name: f"{p['requests'].get(name, 0):g}")
    row("**the pool's own requests**", lambda p: f"**{sum(p['requests'].get(r, 0) for r in POOL_ROWS):g}**")
    row("every request (the kubelet's, scheduler's... too)", lambda p: f"{sum(p['requests'].values()):g}")
    row("bytes served, MB", lambda p: f"{sum(p['bytes'].values()) / 1e6:.3g}")
    lines.append("")
    lines.append(", ".join(f"{n} pods: up in {results['pools'][n]['start_seconds']:g} s, torn down in "
                           f"{results['pools'][n]['teardown_seconds']:g} s" for n in sizes))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,64", help="pool sizes, comma-separated (default 2,64)")
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of the idle phase (default 60)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--label", default="", help="what code was measured (e.g. 'before: polling')")
    args = ap.parse_args()
    results = measure([int(s) for s in args.sizes.split(",")], args.idle)
    results["label"] = args.label
    # One file for every run, by label: the "before" stays beside an "after".
    kept = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept[args.label or "latest"] = results
    args.out.write_text(json.dumps(kept, indent=1, sort_keys=True))
    print(table(results))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
