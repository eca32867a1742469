"""Warm pools on local (issue 52, part 3): a saved pool with keep_warm_minutes outlives the process
that holds it, and the next process attaches to its running agents.

Every controller here is a process of its own (tests/programs/warm_call.py, a Prefect flow run),
as deployments' runs are; the records, logs and events are read back from the test Prefect API.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from skytasks import GPUPool
from skytasks.errors import PoolConfigError
from skytasks.prefect_records.warm_store import PrefectWarmStore, block_name
from tests.conftest import gone
from tests.harness.prefect_api import logs_when
from tests.harness.warm import api_env as _env

PROGRAM = Path(__file__).parent / "programs" / "warm_call.py"
ROOT = Path(__file__).resolve().parent.parent


def _save(name: str, **fields) -> None:
    GPUPool(provider="local", nodes=2, **{"keep_warm_minutes": 1.0, **fields}).save(name, overwrite=True)


def _start(name: str, out: Path, seconds: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PROGRAM), name, str(out), str(seconds)], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _use(name: str, out: Path, seconds: float = 0.0, timeout: float = 120) -> dict:
    proc = _start(name, out, seconds)
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-4000:]
    return json.loads(out.read_text())


def _run_logs(flow_run_id: str, text: str, timeout: float = 20) -> list[str]:
    logs = logs_when(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])),
                     lambda found: any(text in log.message for log in found), timeout=timeout)
    return [log.message for log in logs]


def _events(name: str, since: datetime, flow_run_id: str | None = None, timeout: float = 20) -> list[dict]:
    async def read():
        async with get_client() as client:
            resp = await client._client.post("/events/filter", json={
                "filter": {"event": {"prefix": ["skytasks.pool."]}, "occurred": {"since": since.isoformat()}},
                "limit": 50})
            resp.raise_for_status()
            return resp.json()["events"]

    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in asyncio.run(read()) if e["resource"]["prefect.resource.id"] == f"skytasks.pool.{name}"
                 and (flow_run_id is None or any(r["prefect.resource.id"] == f"prefect.flow-run.{flow_run_id}"
                                                 for r in e["related"]))]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


def _wait_for(path_glob: Path, count: int, timeout: float = 60) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(found := sorted(path_glob.parent.glob(path_glob.name))) < count:
        assert time.monotonic() < deadline, f"{count} of {path_glob} never appeared"
        time.sleep(0.1)
    return found


def test_an_unsaved_pool_cannot_keep_warm():
    with pytest.raises(PoolConfigError, match="keep_warm_minutes: save the pool first"):
        with GPUPool(provider="local", nodes=1, keep_warm_minutes=1):
            pass


def test_the_next_process_attaches_to_the_same_agents_and_its_first_call_is_fast(pool_name, tmp_path):
    _save(pool_name)
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    first = _use(pool_name, tmp_path / "first.json")
    assert all(not gone(pid) for pid in first["pids"]), "the agents ended with their process"
    second = _use(pool_name, tmp_path / "second.json")
    assert second["pids"] == first["pids"]
    assert second["ranks"] == [0, 1]
    # Attach and first call (ranks forked anew from each agent's warm template) within a second on
    # an idle machine. This 2-core machine is shared with other tests: the best of up to three
    # attached processes, and the second stretched by how oversubscribed the CPUs are right now.
    bound = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    fastest = second["first_call_seconds"]
    for again in range(2):
        if fastest < bound and fastest < first["first_call_seconds"] / 2:
            break
        later = _use(pool_name, tmp_path / f"again{again}.json")
        assert later["pids"] == first["pids"]
        fastest = min(fastest, later["first_call_seconds"])
        bound = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert fastest < bound, (second, bound)
    assert fastest < first["first_call_seconds"] / 2, (first, second)  # and far below starting the pool
    logs = _run_logs(second["flow_run_id"], "attached to warm pool")
    assert f"attached to warm pool {pool_name} (2 nodes, up 0 min, 1 call)" in logs
    attached = _events(pool_name, since, second["flow_run_id"])
    assert "skytasks.pool.attached" in {e["event"] for e in attached}
    released = _events(pool_name, since, first["flow_run_id"])
    assert "skytasks.pool.released" in {e["event"] for e in released}


def test_skytasks_run_twice_on_a_warm_pool_attaches_the_second_time(pool_name, tmp_path):
    _save(pool_name)
    (tmp_path / "train.py").write_text("import os\nprint('RANK', os.environ['RANK'], flush=True)\n")
    said = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "skytasks.cli", "run", "--pool", pool_name, "train.py"],
                              cwd=tmp_path, env={**_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "[rank 0] RANK 0" in done.stdout and "[rank 1] RANK 1" in done.stdout
        said.append(done.stdout + done.stderr)
    assert "attached to warm pool" not in said[0]
    assert f"attached to warm pool {pool_name} (2 nodes, up 0 min, 1 call)" in said[1], said[1][-3000:]


def test_one_holder_at_a_time_and_the_next_waits_in_line_naming_it(pool_name, tmp_path):
    _save(pool_name)
    holder = _start(pool_name, tmp_path / "holder.json", seconds=120)
    _wait_for(tmp_path / "holder.json.ready*", 2)
    said = tmp_path / "waiting.out"
    with open(said, "w") as out:  # the holder holds until the waiter has said it waits, however slow it starts
        waiter = subprocess.Popen([sys.executable, str(PROGRAM), pool_name, str(tmp_path / "waiting.json")],
                                  env=_env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "waiting for warm pool" not in said.read_text() and waiter.poll() is None:
        assert time.monotonic() < deadline, said.read_text()[-3000:]
        time.sleep(0.2)
    (tmp_path / "holder.json.release").touch()
    assert waiter.wait(timeout=120) == 0, said.read_text()[-4000:]
    waiting = json.loads((tmp_path / "waiting.json").read_text())
    output, _ = holder.communicate(timeout=60)
    assert holder.returncode == 0, output[-3000:]
    held = json.loads((tmp_path / "holder.json").read_text())
    assert waiting["pids"] == held["pids"]  # it waited, then attached: no second pool
    logs = _run_logs(waiting["flow_run_id"], "waiting for warm pool")
    assert any(f"waiting for warm pool {pool_name}, held by flow run {held['flow_run_name']!r}" in line
               for line in logs), logs


def test_a_waiting_process_gives_up_after_ready_timeout_naming_the_holder(pool_name, tmp_path):
    _save(pool_name, ready_timeout_seconds=3)
    holder = _start(pool_name, tmp_path / "holder.json", seconds=20)
    try:
        _wait_for(tmp_path / "holder.json.ready*", 2)
        started = time.monotonic()
        late = _start(pool_name, tmp_path / "late.json")
        output, _ = late.communicate(timeout=60)
        assert late.returncode != 0
        assert "PoolStartError" in output and f"warm pool {pool_name} is held by flow run" in output, output[-3000:]
        assert "ready_timeout_seconds" in output
        assert time.monotonic() - started < 20
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holder_frees_the_pool(pool_name, tmp_path):
    _save(pool_name)
    holder = _start(pool_name, tmp_path / "holder.json", seconds=120)
    markers = _wait_for(tmp_path / "holder.json.ready*", 2)
    ranks = [int(m.read_text()) for m in markers]
    agents = [psutil.Process(r).parent().pid for r in ranks]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    started = time.monotonic()
    after = _use(pool_name, tmp_path / "after.json")
    assert time.monotonic() - started < 15
    assert all(gone(r) for r in ranks), "the dead holder's ranks run on"
    logs = _run_logs(after["flow_run_id"], "attached to warm pool")
    assert any(f"attached to warm pool {pool_name}" in line for line in logs), logs
    assert sorted(after["pids"]) == sorted(agents), "the next process did not get the dead holder's agents"


def test_a_node_lost_while_unheld_is_replaced_before_the_next_holders_first_call(pool_name, tmp_path):
    _save(pool_name)
    first = _use(pool_name, tmp_path / "first.json")
    os.kill(first["pids"][1], signal.SIGKILL)
    second = _use(pool_name, tmp_path / "second.json")
    assert second["ranks"] == [0, 1]
    assert second["pids"][0] == first["pids"][0] and second["pids"][1] != first["pids"][1]
    logs = _run_logs(second["flow_run_id"], "replaced")
    assert any("node 1" in line and "replaced" in line for line in logs), logs


def test_an_expired_pool_leaves_nothing_and_the_next_process_starts_afresh_quietly(pool_name, tmp_path):
    _save(pool_name, keep_warm_minutes=0.05)  # 3 s unheld
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    first = _use(pool_name, tmp_path / "first.json")
    assert first["log_dir"].startswith(os.path.join(tempfile.gettempdir(), "skytasks-warm-"))
    deadline = time.monotonic() + 30
    while not all(gone(pid) for pid in first["pids"]):
        assert time.monotonic() < deadline, "the unheld agents outlived keep_warm_minutes"
        time.sleep(0.2)
    assert not os.path.exists(first["log_dir"])  # the expired agents took their logs' folder with them
    second = _use(pool_name, tmp_path / "second.json")
    assert set(second["pids"]).isdisjoint(first["pids"])
    logs = _run_logs(second["flow_run_id"], "has ended")
    assert any(f"warm pool {pool_name} has ended" in line for line in logs), logs
    assert "skytasks.pool.expired" in {e["event"] for e in _events(pool_name, since, second["flow_run_id"])}


def test_pools_lists_a_warm_pool_and_down_ends_it(pool_name, tmp_path):
    _save(pool_name)
    first = _use(pool_name, tmp_path / "first.json")
    listed = subprocess.run([sys.executable, "-m", "skytasks.cli", "pools"], env=_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-3000:]
    row = next(line for line in listed.stdout.splitlines() if line.startswith(pool_name))
    assert " local " in row and " 2 " in row and "idle since" in row, listed.stdout
    down = subprocess.run([sys.executable, "-m", "skytasks.cli", "pools", "down", pool_name], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "ended" in down.stdout, down.stdout + down.stderr[-3000:]
    deadline = time.monotonic() + 15
    while not all(gone(pid) for pid in first["pids"]):
        assert time.monotonic() < deadline, "pools down left the agents running"
        time.sleep(0.1)
    assert PrefectWarmStore().load(pool_name) is None
    unknown = subprocess.run([sys.executable, "-m", "skytasks.cli", "pools", "down", f"{pool_name}-never-saved"],
                             env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 1 and unknown.stderr.startswith(
        f"skytasks pools down: {pool_name}-never-saved: no GPUPool block is saved under that name"), unknown.stderr


def test_what_attaching_needs_is_a_secret_and_no_plain_record_holds_it(pool_name, tmp_path):
    _save(pool_name)
    first = _use(pool_name, tmp_path / "first.json")
    record = PrefectWarmStore().load(pool_name)
    assert record is not None and len(record["pool_key"]) == 64 and "PRIVATE KEY" in record["tls_key"]

    async def documents():
        async with get_client() as client:
            return await client.read_block_documents(include_secrets=False)

    plain = json.dumps([d.model_dump(mode="json") for d in asyncio.run(documents())])
    assert block_name(pool_name) in plain  # the Secret block is there, and its value is hidden
    assert record["pool_key"] not in plain and "PRIVATE KEY" not in plain
    logs = _run_logs(first["flow_run_id"], "released warm pool")
    assert not any(record["pool_key"] in line for line in logs)


def test_a_pools_record_is_named_by_a_slug_of_its_name():
    assert block_name("Nightly Fine_Tune") == "skytasks-warm-nightly-fine-tune"
    assert block_name("warm-1") == "skytasks-warm-warm-1"


def test_nodes_of_another_shape_are_not_attached_to():
    from skytasks.controller.warm import spec_digest

    base = GPUPool(provider="local", nodes=2, keep_warm_minutes=1).spec()
    assert spec_digest(base) == spec_digest(GPUPool(provider="local", nodes=2, keep_warm_minutes=5).spec())
    for other in (dict(nodes=3), dict(procs_per_node=2), dict(env={"A": "1"})):
        assert spec_digest(GPUPool(provider="local", **{"nodes": 2, **other}).spec()) != spec_digest(base), other
