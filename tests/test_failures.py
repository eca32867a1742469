"""Failure semantics: a distributed call fails fast, says why, and leaves nothing running."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from skytasks import DistributedTaskError, GPUPool, RankProcessDied, RemoteRankError, distributed_task, rank_info
from tests.conftest import gone, running, skytasks_processes, wait_for_no_skytasks_processes
from tests.harness.prefect_api import settled_task_runs

ROOT = Path(__file__).resolve().parent.parent
FAIL_FAST_SECONDS = 5.0  # the target: from the failure to the caller seeing it


def call_and_time_failure(task, *args) -> tuple[DistributedTaskError, float]:
    with pytest.raises(DistributedTaskError) as caught:
        task(*args)
    seen = time.time()
    failed_at = caught.value.failures[0].at
    return caught.value, seen - failed_at


def raise_on_rank_1_while_head_sleeps() -> int:
    if rank_info().rank == 1:
        time.sleep(0.5)
        raise KeyError("no such shard on rank 1")
    time.sleep(600)
    return 0


def test_a_rank_raises_while_the_head_sleeps_ten_minutes():
    task = distributed_task(raise_on_rank_1_while_head_sleeps, pool=GPUPool(nodes=2))
    err, delay = call_and_time_failure(task)
    assert len(err.exceptions) == 1
    exc = err.exceptions[0]
    assert type(exc) is KeyError and exc.args == ("no such shard on rank 1",)
    assert exc.skytasks_rank == 1 and exc.skytasks_node == 1
    assert "raise KeyError" in str(exc.__cause__)  # the remote traceback
    assert any("rank 1 failed" in n for n in exc.__notes__)
    assert delay < FAIL_FAST_SECONDS


def raise_on_rank_1_while_rank_0_takes_sigterm_itself() -> int:
    if rank_info().rank == 1:
        time.sleep(0.5)
        raise KeyError("no such shard on rank 1")
    if rank_info().rank == 0:  # as Lightning's Trainer does: a SIGTERM handler that does not stop at once
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    time.sleep(600)
    return 0


def test_the_stop_says_where_every_other_rank_was_even_one_whose_own_code_took_sigterm(capsys):
    task = distributed_task(raise_on_rank_1_while_rank_0_takes_sigterm_itself, pool=GPUPool(nodes=2, procs_per_node=2),
                            init_torch=False)
    err, delay = call_and_time_failure(task)
    assert [type(e) for e in err.exceptions] == [KeyError]
    # Ranks 2 and 3 dumped their stacks as SIGTERM stopped them; rank 0 ignored SIGTERM, so it
    # was asked with SIGUSR1 at the grace's end, then killed. All three stood at the same line.
    console = capsys.readouterr().err
    assert "[3 ranks] were in `raise_on_rank_1_while_rank_0_takes_sigterm_itself` (test_failures.py:" in console
    assert "(stopped because rank 1 failed): ranks 0, 2-3" in console
    assert delay < FAIL_FAST_SECONDS


def exit_17_while_head_all_reduces() -> float:
    import torch
    import torch.distributed as dist

    if rank_info().rank == 1:
        time.sleep(0.5)
        os._exit(17)
    t = torch.ones(1)
    dist.all_reduce(t)  # blocks: rank 1 never joins
    return t.item()


def test_a_rank_calls_os_exit_while_the_head_is_blocked_in_all_reduce():
    err, delay = call_and_time_failure(distributed_task(exit_17_while_head_all_reduces, pool=GPUPool(nodes=2)))
    [exc] = err.exceptions  # the head's broken all_reduce is a consequence, not a member
    assert isinstance(exc, RankProcessDied) and exc.rank == 1 and exc.returncode == 17
    assert "exited with code 17" in str(exc)
    assert delay < FAIL_FAST_SECONDS


def block_forever_writing_pid(marker_dir: str) -> None:
    Path(marker_dir, f"rank{rank_info().rank}").write_text(str(os.getpid()))
    time.sleep(600)


def test_a_rank_killed_from_outside(tmp_path):
    import threading

    def kill_rank_1_when_it_runs():
        marker = tmp_path / "rank1"
        while not marker.exists() or not marker.read_text():
            time.sleep(0.05)
        os.kill(int(marker.read_text()), signal.SIGKILL)

    threading.Thread(target=kill_rank_1_when_it_runs, daemon=True).start()
    err, delay = call_and_time_failure(distributed_task(block_forever_writing_pid, pool=GPUPool(nodes=3)), str(tmp_path))
    [exc] = err.exceptions
    assert isinstance(exc, RankProcessDied) and exc.rank == 1 and exc.returncode == -signal.SIGKILL
    assert "SIGKILL" in str(exc)
    assert delay < FAIL_FAST_SECONDS


def test_a_call_times_out_and_every_rank_is_stopped(tmp_path):
    task = distributed_task(block_forever_writing_pid, pool=GPUPool(nodes=2), timeout_seconds=4)
    started = time.monotonic()
    with pytest.raises(DistributedTaskError) as caught:
        task(str(tmp_path))
    assert time.monotonic() - started < 4 + FAIL_FAST_SECONDS
    [exc] = caught.value.exceptions
    assert isinstance(exc, TimeoutError) and "timeout_seconds" in str(exc)
    assert "ranks [0, 1] were still running" in str(exc)
    assert "timed out" in str(caught.value) and "rank -1" not in str(caught.value)
    for pid_file in tmp_path.iterdir():
        assert gone(int(pid_file.read_text()))


def fail_on_first_attempt(marker_dir: str) -> dict:
    info = rank_info()
    if info.attempt == 1 and info.rank == 1:
        raise RuntimeError("transient failure on attempt 1")
    return {"rank": info.rank, "attempt": info.attempt, "pid": os.getpid()}


def test_retries_restart_the_whole_group_and_tell_the_attempt():
    pool = GPUPool(nodes=2)
    task = distributed_task(fail_on_first_attempt, pool=pool, retries=1, retry_delay_seconds=0.1)
    with pool:
        results = task("x")
    assert [(r["rank"], r["attempt"]) for r in results] == [(0, 2), (1, 2)]
    with pytest.raises(DistributedTaskError, match="1 rank"):
        distributed_task(fail_on_first_attempt, pool=GPUPool(nodes=2), retries=0)("x")


def pid_or_fail(fail: bool) -> int:
    if fail and rank_info().rank == 0:
        raise ValueError("boom")
    return os.getpid()


def test_a_warm_pool_gets_fresh_ranks_after_a_failure():
    pool = GPUPool(nodes=2)
    task = distributed_task(pid_or_fail, pool=pool)
    with pool:
        first = task(False)
        assert task(False) == first  # warm
        with pytest.raises(DistributedTaskError):
            task(True)
        after = task(False)
    assert set(after).isdisjoint(first)


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):  # unpickling calls NeedsTwoArgs(a): fails on the caller's side
        super().__init__(f"{a}/{b}")


def raise_unpicklable_exception() -> None:
    if rank_info().rank == 0:
        raise NeedsTwoArgs("left", "right")
    time.sleep(60)


def test_an_exception_that_cannot_be_unpickled_becomes_a_stand_in():
    with pytest.raises(DistributedTaskError) as caught:
        distributed_task(raise_unpicklable_exception, pool=GPUPool(nodes=2))()
    [exc] = caught.value.exceptions
    assert isinstance(exc, RemoteRankError)
    assert exc.type_name.endswith("NeedsTwoArgs") and exc.remote_message == "left/right"
    assert "raise NeedsTwoArgs" in exc.remote_traceback


def test_in_a_flow_the_parent_and_failing_rank_fail_and_the_others_say_why_they_stopped():
    task = distributed_task(raise_on_rank_1_while_head_sleeps, pool=GPUPool(nodes=3), name="fragile")

    @flow
    def fragile_flow():
        return task()

    state = fragile_flow(return_state=True)
    assert state.is_failed()

    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, expect=4)}
    assert runs["fragile"].state.is_failed()
    assert runs["fragile[rank 1/3]"].state.is_failed()
    for other in ("fragile[rank 0/3]", "fragile[rank 2/3]"):
        assert runs[other].state.is_cancelled()
        assert "rank 1 failed" in runs[other].state.message


def test_the_controller_killed_with_sigkill_leaves_no_rank_running(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/programs/long_call.py"), str(tmp_path)], cwd=ROOT)
    try:
        wait_for_files(tmp_path, ["rank0.pid", "rank1.pid"], proc)
        assert len(skytasks_processes()) >= 4  # 2 agents, 2 ranks
        proc.kill()
        proc.wait()
        assert wait_for_no_skytasks_processes(timeout=10) == []
    finally:
        proc.kill()


def test_a_frozen_controller_is_given_up_by_its_agents_after_the_heartbeat_timeout(tmp_path):
    """SIGSTOP closes nothing: only the missing heartbeats tell the agents the controller is gone."""
    env = {**os.environ, "SKYTASKS_HEARTBEAT_SECONDS": "0.5", "SKYTASKS_HEARTBEAT_TIMEOUT_SECONDS": "3"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/programs/long_call.py"), str(tmp_path)], cwd=ROOT, env=env)
    try:
        wait_for_files(tmp_path, ["rank0.pid", "rank1.pid"], proc)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(1.5)
        assert len(skytasks_processes()) >= 4, "the agents gave up before the heartbeat timeout"
        assert wait_for_no_skytasks_processes(timeout=15) == []
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_and_sigterm_of_the_controller_tear_everything_down(tmp_path, sig):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/programs/long_call.py"), str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        wait_for_files(tmp_path, ["rank0.pid", "rank1.pid"], proc)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert "TEARDOWN" in out  # the controller unwound through its finally blocks
        assert proc.returncode != 0
        assert wait_for_no_skytasks_processes(timeout=10) == []
    finally:
        proc.kill()


def wait_for_files(folder: Path, names: list[str], proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all((folder / n).exists() for n in names):
        assert proc.poll() is None, f"controller exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "ranks never started"
        time.sleep(0.1)


def test_a_peer_that_never_arrives_fails_initialisation_naming_the_missing_rank(tmp_path, monkeypatch):
    # A real slow start: rank 1's interpreter sleeps in sitecustomize, before skytasks runs.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('SKYTASKS_RANK') == '1':\n    time.sleep(120)\n"
    )
    monkeypatch.setenv("SKYTASKS_INIT_TIMEOUT_SECONDS", "4")
    monkeypatch.setenv("SKYTASKS_RANK_START", "exec")  # a fresh interpreter per rank: a forked one runs no sitecustomize
    task = distributed_task(lambda: 1, pool=GPUPool(nodes=3, env={"PYTHONPATH": str(tmp_path)}))
    with pytest.raises(DistributedTaskError) as caught:
        task()
    [exc] = caught.value.exceptions
    assert isinstance(exc, TimeoutError)
    assert "ranks [1] never joined" in str(exc) and "ranks [0, 2] were waiting" in str(exc)


def test_a_cancelled_flow_run_stops_every_rank(tmp_path):
    """Cancel from Prefect: the served flow's runner ends the flow process, the ranks go with it."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelling

    # The runner looks for scheduled runs every second, not every ten: the test waits less.
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    server = subprocess.Popen([sys.executable, str(ROOT / "tests/served_flow.py")], cwd=ROOT, env=env)
    try:
        flow_run = None
        deadline = time.monotonic() + 120
        while flow_run is None:
            assert server.poll() is None and time.monotonic() < deadline
            try:
                flow_run = run_deployment("sleepy-flow/cancel-me", timeout=0)
            except Exception:  # noqa: BLE001 - the deployment is not registered yet
                time.sleep(1)
        while len(running("skytasks.node.worker")) < 2:
            assert time.monotonic() < deadline, "ranks never started"
            time.sleep(0.2)

        async def cancel_and_wait():
            async with get_client() as client:
                await client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
                while True:
                    run = await client.read_flow_run(flow_run.id)
                    if run.state.is_final():
                        return run.state
                    assert time.monotonic() < deadline + 60
                    await asyncio.sleep(0.5)

        final = asyncio.run(cancel_and_wait())
        assert final.is_cancelled()
        assert wait_for_no_skytasks_processes(timeout=15) == []
    finally:
        server.terminate()
        server.wait(timeout=30)


def silent_for_a_while() -> int:
    time.sleep(2.5)  # no output, no report: nothing of the rank reaches the controller until the result
    return rank_info().rank + 100


def test_a_rank_silent_for_a_while_still_returns_its_result(monkeypatch):
    """Silence is not an end, with every clock armed: a deadline far off, and heartbeats whose
    timeout (1 s) the rank's silence (2.5 s) outlasts; the agent's beats keep the node alive.
    (tests/test_call_run.py drives the same machine by hand.)"""
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_SECONDS", "0.3")
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_TIMEOUT_SECONDS", "1")
    task = distributed_task(silent_for_a_while, pool=GPUPool(nodes=2), init_torch=False, timeout_seconds=60)
    assert task() == [100, 101]


def raise_on_head_return_elsewhere() -> int:
    if rank_info().rank == 0:
        raise ValueError("rank 0 gives up at once")
    return rank_info().rank


def test_a_rank_that_returned_or_was_still_starting_is_never_counted_failed():
    """Rank 0 raises at once while rank 1 returns at once (or is still starting): the stack
    request that follows the failure must not turn rank 1 into a second failure."""
    task = distributed_task(raise_on_head_return_elsewhere, init_torch=False)
    with GPUPool(nodes=2):
        for _ in range(6):  # each call starts a new group: each one races the stack request
            with pytest.raises(DistributedTaskError) as caught:
                task()
            assert [type(e) for e in caught.value.exceptions] == [ValueError], caught.value.exceptions
            assert not any(isinstance(f.exception, RankProcessDied) for f in caught.value.failures)
