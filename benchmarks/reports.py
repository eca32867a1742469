"""What `python -m benchmarks.run` prints for each figure: one function a section, given the
figures that section measured (as results.json holds them)."""

from __future__ import annotations


def cli(c: dict) -> None:
    print("\n0. the same 4-rank script, `torchrun --nproc-per-node 4` against `skytasks run --nodes 2 "
          "--procs-per-node 2` (median wall seconds of whole commands)")
    print(f"   torchrun {c['torchrun_s']:.2f}   skytasks run, a server running {c['with_server_s']:.2f} "
          f"({c['with_server_ratio']:.2f}x)   none configured {c['no_server_s']:.2f} ({c['no_server_ratio']:.2f}x)")


def startup(s: dict) -> None:
    print("\nwhat a fresh process pays (medians of rounds; a ratio is the median of each round's own)")
    print(f"   a flow's first call: attached to a warm 2-node local pool {s['warm_first_call_s']:.2f} s, "
          f"starting it cold {s['cold_first_call_s']:.2f} s (whole processes {s['warm_process_s']:.2f} s, "
          f"{s['cold_process_s']:.2f} s)")
    print(f"   torchrun {s['torchrun_s']:.2f}   skytasks run, a server running {s['with_server_s']:.2f} "
          f"({s['with_server_ratio']:.2f}x)   none configured {s['no_server_s']:.2f} ({s['no_server_ratio']:.2f}x)")


def broadcast(b: dict) -> None:
    low, high = b["raw_pipe_range_mb_per_s"]
    print(f"\n4. argument broadcast (raw pipe on this machine: median {b['raw_pipe_mb_per_s']:.0f} MB/s, "
          f"{low:.0f}-{high:.0f} through the run)")
    print("   nodes    MB  peer TLS  call (median)  MB/s moved  of pipe  same bytes again")
    for r in b["rows"]:
        tls = {True: "on", False: "off", None: "-"}[r["peer_tls"]]
        print(f"   {r['nodes']:>5} {r['mb']:>5}  {tls:>8}  {r['call_s']:>13.3f}  {r['mb_per_s']:>10.0f}  "
              f"{r['fraction_of_pipe']:>6.0%}  {r['repeat_s']:>16.3f}")


def ssh(d: dict) -> None:
    print("\n5. trivial all_reduce on 2 ssh hosts, 1 rank each (median seconds)")
    print(f"   torchrun (local, 2 procs) {d['torchrun_s']:.2f}   skytasks ssh cold {d['cold_s']:.2f} "
          f"({d['cold_ratio']:.2f}x)   warm {d['warm_s']:.4f} ({d['warm_ratio']:.4f}x)")


def slurm(d: dict) -> None:
    print("\n5b. trivial all_reduce on 2 SLURM nodes, 1 rank each (median seconds)")
    print(f"   torchrun (srun in a running allocation) {d['torchrun_s']:.2f}   skytasks slurm cold, own "
          f"allocation {d['cold_s']:.2f} ({d['cold_ratio']:.2f}x)   warm {d['warm_s']:.4f} ({d['warm_ratio']:.4f}x)")


def kubernetes(k: dict) -> None:
    print("\n5c. Kubernetes (the test cluster's real kubelet): a pool up, a warm call, an unschedulable pod's "
          "error, a lost pod's retry (median seconds; torchrun's whole process: "
          f"{k['torchrun_s']:.2f})")
    print("   " + "   ".join(f"{n} pods up {k[f'pool_up_{n}_s']:.2f} ({k[f'pool_up_{n}_ratio']:.1f}x)"
                              for n in (2, 4, 8)))
    print(f"   warm call {k['warm_s']:.4f} ({k['warm_ratio']:.4f}x)   unschedulable -> error "
          f"{k['unschedulable_error_s']:.2f}   pod deleted -> retry's ranks ran {k['lost_pod_to_retry_s']:.2f}")


def recovery(r: dict) -> None:
    print("\n6. recovery on the local pool (median seconds)")
    print(f"   a node is lost -> replaced, and the retry's ranks running: {r['lost_node_to_retry_running_s']:.2f}")
    print(f"   hang detected -> the caller has the error: {r['hang_detected_to_error_s']:.2f}")


def preemption(p: dict) -> None:
    print("\n7. a preemption notice on an elastic local pool, 2 nodes x 2 ranks (median seconds after the notice)")
    print(f"   every rank knows {p['every_rank_s']:.3f}   the head's checkpoint on disk "
          f"{p['checkpoint_on_disk_s']:.3f}   the retry running on the node left {p['retry_running_s']:.2f}")


def load_row(flows: int, calls: int, plain: bool, tuned: bool, row: dict | None = None) -> None:
    """Before a load run (row None): what it is; after: what it found."""
    if row is None:
        print(f"\nload: {flows} flows at once x {calls} warm calls, 4 ranks each, Prefect server on PostgreSQL "
              f"({'its recorder batching' if tuned else 'its defaults'})"
              + (": Prefect's own tasks, as many task runs (the baseline)" if plain else ""))
        return
    print(f"   flows took {row['flows_took_s']:.1f}s; the record settled {row['settled_after_flows_s']:.1f}s "
          f"after the last ended; task runs {row['task_runs']} of {row['task_runs_expected']} "
          f"({row['task_runs_final']} final), logs {row['logs']} ({row['logs_per_call']:.1f} a call)")


def flow_only(w: dict, rows: list[dict], fastest: float) -> None:
    print(f"warm in flow: median {w['median_s']:.3f} ({w['median_ratio']:.3f}x fastest torchrun {fastest:.2f}), "
          f"p90 {w['p90_s']:.3f} ({w['p90_over_median']:.2f}x), max {w['max_s']:.3f}, "
          f"plain task {w['plain_task_median_s']:.3f}")
    for r in rows:
        print(f"fan-out {r['ranks']}: outside a flow {r['call_s']:.2f}, in a flow {r['call_in_flow_s']:.2f}, "
              f"Prefect part {r['prefect_s']:.2f}")


def dispatch(d: dict) -> None:
    print("\n1. trivial 2-rank all_reduce (median seconds)")
    print(f"   torchrun fastest {d['torchrun_s']:.2f} (--standalone {d['torchrun_standalone_s']:.2f})"
          f"   skytasks cold, a controller's first {d['first_cold_s']:.2f} ({d['first_cold_ratio']:.2f}x)"
          f"   cold, later {d['cold_s']:.2f} ({d['cold_ratio']:.2f}x)   warm {d['warm_s']:.4f} ({d['warm_ratio']:.4f}x)")


def in_flow(w: dict) -> None:
    print(f"\n1b. the same call, warm, {w['calls']} times inside a flow (seconds)")
    print(f"   plain Prefect task {w['plain_task_median_s']:.3f}   skytasks median {w['median_s']:.3f} "
          f"({w['median_ratio']:.3f}x fastest torchrun)   p90 {w['p90_s']:.3f} ({w['p90_over_median']:.2f}x median)"
          f"   max {w['max_s']:.3f}")


def throughput(t: dict) -> None:
    print("\n2. DDP training throughput (steps/s, same model and data)")
    print(f"   torchrun {t['torchrun_steps_per_s']:.1f}   skytasks {t['skytasks_steps_per_s']:.1f} ({t['ratio']:.3f}x)")


def fan_out(rows: list[dict]) -> None:
    print("\n3. fan-out on the local pool, init_torch=False (seconds)")
    print("   ranks  all running  call  call in flow  Prefect part")
    for r in rows:
        print(f"   {r['ranks']:>5}  {r['all_running_s']:>11.2f}  {r['call_s']:>4.2f}  {r['call_in_flow_s']:>12.2f}  "
              f"{r['prefect_s']:>12.2f}")
