"""A process that lost a warm pool ends nothing of it (issue 58, item 1), on the real sshd fleet.

Holder A is frozen (SIGSTOP) in the middle of a call and its SSH sessions are cut: each agent waits
its re-attach window, stops A's ranks and goes unheld, and B, waiting in line, takes the pool and
starts its own call. Then A thaws: its re-attach is refused with B's name, its call fails naming
B, and its release writes no record and stops no node. B's call returns whole, on the same
agents, and a third process attaches to them again: nothing was ended or doubled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from skytasks.prefect_records.warm_store import PrefectWarmStore
from tests.conftest import gone
from tests.test_warm_fleets import _env, save_ssh, use, wait_until

PROGRAM = Path(__file__).parent / "programs" / "warm_call.py"
ROOT = Path(__file__).resolve().parent.parent


def _call(name: str, out: Path, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PROGRAM), name, str(out), str(seconds)], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"did not end within {timeout:g}s: {out[-6000:]}") from None


def _agents_of(ready: list[Path]) -> list[int]:
    ranks = [int(p.read_text()) for p in ready]
    return sorted(next(a.pid for a in psutil.Process(r).parents() if "skytasks.node.agent" in " ".join(a.cmdline()))
                  for r in ranks)


def test_an_evicted_holders_release_leaves_the_new_holders_call_whole(sshd, pool_name, tmp_path):  # noqa: F811
    save_ssh(sshd, pool_name)  # reattach_seconds=5
    a = _call(pool_name, tmp_path / "a.json", 120)
    b = None
    try:
        wait_until(lambda: len(list(tmp_path.glob("a.json.ready*"))) == 2, 120, "A's ranks in its call")
        agents = _agents_of(sorted(tmp_path.glob("a.json.ready*")))
        a_record = PrefectWarmStore().load(pool_name)
        assert a_record is not None
        os.kill(a.pid, signal.SIGSTOP)
        for agent in agents:  # A's SSH sessions cut while A cannot notice: the agents wait, then go unheld
            for p in psutil.Process(agent).parents():
                if p.pid != sshd.proc.pid and p.name().startswith("sshd") and \
                        sshd.proc.pid in {q.pid for q in p.parents()}:
                    p.kill()
        b = _call(pool_name, tmp_path / "b.json", 25)
        wait_until(lambda: len(list(tmp_path.glob("b.json.ready*"))) == 2, 120, "B's ranks in its call")
        assert _agents_of(sorted(tmp_path.glob("b.json.ready*"))) == agents  # the same agents, B's now
        b_record = PrefectWarmStore().load(pool_name)
        assert b_record is not None and b_record["generation"] > a_record["generation"]
        assert b_record["pool_key"] != a_record["pool_key"]  # a fresh key at B's hold
        os.kill(a.pid, signal.SIGCONT)
        a_out = _finish(a, 120)
        assert a.returncode != 0, a_out[-3000:]
        assert "taken over by" in a_out and "flow run" in a_out, a_out[-3000:]
        # A wrote nothing: the record is still B's hold, and every agent runs B's call on
        after_a = PrefectWarmStore().load(pool_name)
        assert after_a is not None and after_a["generation"] == b_record["generation"]
        assert after_a["pool_key"] == b_record["pool_key"]
        assert all(not gone(p) for p in agents)
        b_out = _finish(b, 120)
        assert b.returncode == 0, b_out[-3000:]
        b_result = json.loads((tmp_path / "b.json").read_text())
        assert b_result["ranks"] == [0, 1] and sorted(b_result["pids"]) == agents
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
    third = use(pool_name, tmp_path / "third.json")
    assert sorted(third["pids"]) == agents and third["ranks"] == [0, 1]
