"""What each rank uses, where people look: the rank table's columns, the live resources table,
the warnings in a rank's own log, and `skytasks.rank.resources` events.

End to end on CPU (a rank that allocates 500 MB shows it; a busy rank shows its CPU); the GPU side
from recorded `nvidia-smi` outputs; the warnings from scripted samples.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.controller.usage import MB, RankUsage
from skytasks.node.resources import Sampler, parse_compute_apps, parse_gpu_query

# `nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits`
# as drivers print it: a 535 data-centre driver (H100), a 550 with a GPU that reports no utilisation
# (MIG), and a 470 on a consumer card.
GPU_QUERY = {
    "535": "0, GPU-3f6a0c1e-1111-2222-3333-444455556666, 87, 61234, 81559\n"
           "1, GPU-9a8b7c6d-1111-2222-3333-444455556666, 3, 1024, 81559\n",
    "550-mig": "0, GPU-aaaaaaaa-1111-2222-3333-444455556666, [N/A], 20480, 40960\n",
    "470": "0, GPU-bbbbbbbb-1111-2222-3333-444455556666, 100, 7900, 8192\n",
}
APPS = ("4242, GPU-3f6a0c1e-1111-2222-3333-444455556666, 61000\n"
        "4343, GPU-9a8b7c6d-1111-2222-3333-444455556666, 900\n"
        "bad line\n")


def of_flow_run(state):
    """The artifacts of this flow run only: an unfiltered read returns the API's first 200."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    return ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))


@pytest.mark.parametrize("driver", list(GPU_QUERY))
def test_gpu_figures_are_read_from_nvidia_smi_query_output(driver):
    devices = parse_gpu_query(GPU_QUERY[driver])
    assert devices and all(d.memory_total > d.memory_used > 0 for d in devices)
    if driver == "535":
        assert [(d.index, d.utilization) for d in devices] == [("0", 87.0), ("1", 3.0)]
        assert devices[0].memory_total == 81559 * MB
    if driver == "550-mig":
        assert devices[0].utilization is None  # not reported: absent, never 0
    assert parse_compute_apps(APPS) == {4242: ("GPU-3f6a0c1e-1111-2222-3333-444455556666", 61000 * MB),
                                        4343: ("GPU-9a8b7c6d-1111-2222-3333-444455556666", 900 * MB)}


def test_an_idle_gpu_warns_once_after_a_minute_and_full_memory_warns_once():
    usage = RankUsage(rank=3)
    idle = {"rss": 100 * MB, "host_memory": 1000 * MB, "cpu": 5.0, "gpu_util": 2.0, "gpu_memory": 10 * MB,
            "gpu_memory_total": 1000 * MB}
    said = [line for t in range(0, 60, 5) for line in usage.add(idle, now=float(t))]
    assert said == []  # 55 s of idle GPU: not yet
    said = usage.add(idle, now=61.0) + usage.add(idle, now=70.0)
    assert len(said) == 1 and "rank 3: its GPU has been under 10% busy for 61s" in said[0]
    busy = {**idle, "gpu_util": 95.0, "gpu_memory": 950 * MB, "rss": 950 * MB}
    said = usage.add(busy, now=75.0) + usage.add(busy, now=80.0)
    assert len(said) == 2 and any("GPU memory at 950 of 1000 MB" in s for s in said)
    assert any("host memory at 950 of 1000 MB" in s for s in said)
    cols = usage.columns()
    assert cols["peak RSS MB"] == "950" and cols["peak GPU MB"] == "950" and "mean GPU %" in cols


def test_a_cpu_rank_has_no_gpu_columns_at_all():
    usage = RankUsage(rank=0)
    usage.add({"rss": 200 * MB, "host_memory": 8000 * MB, "cpu": 50.0}, now=0.0)
    assert set(usage.columns()) == {"peak RSS MB", "mean RSS MB", "mean CPU %"}


def test_sampling_a_rank_is_cheap_and_sees_its_memory():
    import subprocess
    import sys

    # A rank of its own, holding 64 MB: this test process's own tree holds the session's servers.
    rank = subprocess.Popen([sys.executable, "-c", "import sys, time; held = b'x' * (64 << 20); "
                             "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"\n"
        sampler = Sampler()
        sampler.sample({0: (rank.pid, None)})
        started, cpu_before = time.perf_counter(), time.thread_time()  # this thread's CPU only
        for _ in range(200):
            figures = sampler.sample({0: (rank.pid, None)})[0]
        per_sample = (time.thread_time() - cpu_before) / 200
    finally:
        rank.kill()
        rank.wait()
    assert figures["rss"] > 64 * MB and "cpu" in figures and "gpu_util" not in figures
    # one sample every 5 s: under 1% of a core means under 50 ms a sample; it is far less
    print(f"one sample of one rank: {per_sample * 1e6:.0f} µs of CPU ({time.perf_counter() - started:.3f}s for 200)")
    assert per_sample < 0.005


def hold_memory_and_spin(seconds: float) -> str:
    info = rank_info()
    if info.rank == 0:
        block = bytearray(500 * MB)  # touched: resident, not just reserved
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(seconds)
        return "held"
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "spun"


def quick() -> int:
    return rank_info().rank


def test_a_call_over_before_its_ranks_were_sampled_leaves_the_rank_table_and_no_live_one():
    """A warm pool's quick calls: the rank table says what each rank used; a live table of
    figures sampled while the call ran would be empty, so none is written (one artifact, and one
    round trip to the server, less per call)."""
    pool = GPUPool(nodes=2)
    task = distributed_task(quick, pool=pool, init_torch=False, name="quickly")

    @flow
    def quick_calls():
        with pool:
            return [task(), task()]

    state = quick_calls(return_state=True)
    assert state.result() == [[0, 1], [0, 1]]

    async def keys():
        async with get_client() as client:
            return [a.key for a in await client.read_artifacts(artifact_filter=of_flow_run(state))]

    found = asyncio.run(keys())
    assert found.count("quickly-ranks") == 2, found  # one per call, each with what the ranks used
    assert "quickly-resources" not in found, found


def called_in_a_flow(fn, name: str, seconds: float):
    """`fn(seconds)` as a distributed task named `name` on a 2-node local pool, called once
    inside a flow: the flow run's final state."""
    task = distributed_task(fn, pool=GPUPool(nodes=2), init_torch=False, name=name)

    @flow
    def measured():
        return task(seconds)

    return measured(return_state=True)


def test_the_rank_table_shows_what_each_rank_used(monkeypatch):
    from datetime import datetime, timedelta, timezone

    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    monkeypatch.setenv("SKYTASKS_RESOURCE_SAMPLE_SECONDS", "0.5")
    state = called_in_a_flow(hold_memory_and_spin, "usage", 4.0)
    assert state.result() == ["held", "spun"]

    async def tables():
        async with get_client() as client:
            found = {}
            for a in sorted(await client.read_artifacts(artifact_filter=of_flow_run(state)), key=lambda a: a.created):
                if a.key in ("usage-ranks", "usage-resources"):
                    found[a.key] = a.data  # the newest version of each key wins
            return found

    found = asyncio.run(tables())
    import json

    rows = {r["rank"]: r for r in json.loads(found["usage-ranks"])}
    assert float(rows[0]["peak RSS MB"]) >= 500 > float(rows[1]["peak RSS MB"]), rows
    # A spinning rank keeps about one core busy when it has one; on a shared machine (the suite in
    # 4 workers on 2 cores), it got 23%: what the table must show is that it used the most.
    spun, held = float(rows[1]["mean CPU %"]), float(rows[0]["mean CPU %"])
    assert spun >= 10 and spun > held, rows
    assert "peak GPU MB" not in rows[0]  # no GPU here: the columns are absent, not zero
    live = json.loads(found["usage-resources"])
    assert [r["rank"] for r in live] == [0, 1] and "RSS" in live[0]["latest"]
    from tests.test_prefect_native import _wait_for_events

    deadline = time.monotonic() + 20
    while True:  # events reach the API a moment after they are emitted
        events = _wait_for_events("skytasks.rank.resources", since, {"skytasks.rank.resources"},
                                  str(state.state_details.flow_run_id))
        ranks = {e["payload"]["rank"]: e["payload"] for e in events}
        if set(ranks) == {0, 1} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(ranks) == {0, 1} and ranks[0]["latest"]["rss"] > 0


def test_skytasks_run_shows_each_ranks_figures_on_request(tmp_path):
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    (tmp_path / "work.py").write_text("import time\nblock = bytearray(200 * 1024 * 1024)\ntime.sleep(2.5)\n")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "SKYTASKS_RESOURCE_SAMPLE_SECONDS": "0.5"}
    run = subprocess.run([sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", "--resources",
                          "--workdir", str(tmp_path), "work.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    # the script is a child of the rank process: its 200 MB count as the rank's
    import re

    seen = [int(mb) for mb in re.findall(r"\[rank 0\] uses RSS (\d+) MB", run.stderr)]
    assert seen and max(seen) >= 200, run.stderr[-3000:]
    assert "[rank 1] uses RSS" in run.stderr


def report_steps_for(seconds: float) -> str:
    from skytasks import report

    steps = int(seconds / 0.05)
    buf = bytearray(64 * MB)  # a figure worth seeing on the rank's page
    for step in range(1, steps + 1):
        report(step=step, total_steps=steps, loss=1.0 / step)
        time.sleep(0.05)
    return f"{len(buf)}"


def test_a_long_reporting_call_leaves_at_most_five_artifacts_updated_in_place(monkeypatch):
    """Live tables are rewritten every 0.2 s here (every 5 s normally), so a 4 s call writes
    them about 20 times each: still one artifact per kind, the newest figures in it."""
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    import skytasks.prefect_records.observer as observer

    monkeypatch.setattr(observer, "METRICS_ARTIFACT_EVERY_SECONDS", 0.2)
    monkeypatch.setattr(observer, "RESOURCES_ARTIFACT_EVERY_SECONDS", 0.2)
    monkeypatch.setenv("SKYTASKS_RESOURCE_SAMPLE_SECONDS", "0.3")
    state = called_in_a_flow(report_steps_for, "long", 4.0)
    assert state.is_completed()
    flow_run_id = state.state_details.flow_run_id
    from tests.harness.prefect_api import logs_when, settled_task_runs

    runs = {r.name: r for r in settled_task_runs(flow_run_id, expect=3)}

    async def read():
        async with get_client() as client:
            arts = await client.read_artifacts(artifact_filter=of_flow_run(state))
            return arts

    arts = asyncio.run(read())
    logs = logs_when(LogFilter(task_run_id=LogFilterTaskRunId(any_=[runs["long[rank 1/2]"].id])),
                     lambda found: any("used over the call" in log.message for log in found))
    keys = sorted(a.key for a in arts)
    assert len(arts) <= 5 and len(keys) == len(set(keys)), keys  # one artifact per kind, never a version each
    assert {"long-progress", "long-metrics", "long-resources", "long-ranks"} <= set(keys)
    by_key = {a.key: a for a in arts}
    assert by_key["long-progress"].type == "progress" and float(by_key["long-progress"].data) == 100.0
    import json

    metrics = json.loads(by_key["long-metrics"].data)
    assert metrics[-1]["step"] == metrics[-1]["total_steps"] == 80  # the newest report, in place
    # What the rank used, on its own task-run page (its log), not only in the parent's table.
    used = [log.message for log in logs if "used over the call" in log.message]
    assert used and re.search(r"peak RSS \d+ MB, mean RSS \d+ MB, mean CPU \d+%", used[0]), used
    columns = list(json.loads(by_key["long-ranks"].data)[0])
    assert columns.index("mean CPU %") < columns.index("summary") and columns[:3] == ["rank", "outcome", "seconds"]


@pytest.mark.parametrize("metrics, percent", [
    ({"epoch": 3, "epochs": 10}, 30.0),
    ({"step": 50, "total_steps": 200, "loss": 0.1}, 25.0),
    ({"step": 5, "steps": 10}, 50.0),
    ({"iteration": 1, "iterations": 4}, 25.0),
    ({"batch": 9, "batches": 10}, 90.0),
    ({"progress": 0.4}, 40.0),
    ({"progress": 55}, 55.0),
    ({"epoch": 12, "epochs": 10}, 100.0),  # never past the end
    ({"epoch": 3}, None),  # a position with no total says nothing
    ({"step": 3, "total_steps": 0}, None),
    ({"step": True, "total_steps": 2}, None),
    ({"loss": 0.3}, None),
])
def test_a_report_with_a_position_and_its_total_drives_the_progress_bar(metrics, percent):
    from skytasks.metrics import progress_percent

    assert progress_percent(metrics) == percent


def test_a_call_shorter_than_the_sampling_interval_still_says_what_the_rank_used():
    usage = RankUsage(0)
    assert usage.summary() == "" and usage.columns() == {}
    usage.add_own({"peak_rss": 345 * MB, "cpu_seconds": 1.8}, seconds=2.0)
    assert usage.summary() == "peak RSS 345 MB, mean CPU 90%"
    assert usage.columns() == {"peak RSS MB": "345", "mean RSS MB": "n/a", "mean CPU %": "90"}


def test_a_table_cell_that_is_nan_is_written_as_null_and_a_row_without_one_as_it_is():
    import json

    from skytasks.prefect_records.artifacts import table_data

    rows = [{"rank": 0, "mean CPU %": float("nan"), "figures": [1.0, float("nan")]}, {"rank": 1, "mean CPU %": 2.5}]
    assert json.loads(table_data(rows)) == [{"rank": 0, "mean CPU %": None, "figures": [1.0, None]},
                                            {"rank": 1, "mean CPU %": 2.5}]
    assert table_data([{"rank": 1, "mean CPU %": 2.5}]) == '[{"rank": 1, "mean CPU %": 2.5}]'


@pytest.mark.parametrize("last_said, now, expected", [
    ({0: None, 1: None}, 10.0, [0, 1]),  # never said: both
    ({0: 8.0, 1: 4.0}, 10.0, [1]),  # rank 0 was said 2 s ago: not yet again
    ({0: 9.0, 1: None, 2: 1.0, 3: 2.0}, 10.0, [1, 2, 3]),  # never said first, then the longest ago
    ({r: None for r in range(1024)}, 10.0, list(range(64))),  # at most 64 a write, whatever the size
    ({**{r: 10.0 for r in range(64)}, **{r: None for r in range(64, 1024)}}, 15.0, list(range(64, 128))),
], ids=["never said", "said recently", "stalest first", "64 at most", "the next 64"])
def test_resource_events_go_out_for_the_ranks_said_longest_ago_at_most_64_a_time(last_said, now, expected):
    from skytasks.prefect_records.observer import ranks_to_announce

    assert ranks_to_announce(last_said, now) == expected
