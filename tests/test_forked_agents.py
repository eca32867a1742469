"""A local node's agent is forked from one warm fork server per controller, and a forked agent is
what a fresh one was: its own session, the controller's environment and directory as they are
when the pool starts. A pool started for a call whose ranks initialise torch gets templates
that already have torch. The server leaves with its controller, however the controller ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.providers.local import forked_agents
from tests.conftest import fork_servers, gone
from tests.test_failures import wait_for_files

ROOT = Path(__file__).resolve().parent.parent


def what_the_node_is() -> dict:
    agent = psutil.Process(os.getppid())
    server = agent.parent()
    template = next((c for c in agent.children() if "skytasks.node.rank_template" in " ".join(c.cmdline())), None)
    with open(f"/proc/{template.pid}/maps") if template else open(os.devnull) as maps:
        template_has_torch = any("libtorch" in line for line in maps)
    cpu = template.cpu_times() if template else None
    return {
        "rank": rank_info().rank,
        "agent": " ".join(agent.cmdline()).split(),
        "agent_session": os.getsid(agent.pid) == agent.pid,
        "server": server.pid,
        "server_cmdline": " ".join(server.cmdline()).split(),
        "template_has_torch": template_has_torch,
        "template_cpu_s": cpu.user + cpu.system if cpu else None,
        "forked": os.environ["SKYTASKS_CTRL_FD"] == "3",
        "mark": os.environ.get("SKYTASKS_TEST_MARK"),
        "cwd": os.getcwd(),
        "threads": __import__("torch").get_num_threads(),
    }


def test_local_agents_are_forked_from_one_server_of_this_controller_and_share_its_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("SKYTASKS_TEST_MARK", "set after the server may have started")
    monkeypatch.chdir(tmp_path)
    first = distributed_task(what_the_node_is, pool=GPUPool(nodes=2, procs_per_node=2))()
    second = distributed_task(what_the_node_is, pool=GPUPool(nodes=2, procs_per_node=1))()
    for r in first + second:
        assert r["agent"][1:] == ["-m", "skytasks.node.agent"]  # `ps` shows an agent as an agent
        assert r["agent_session"]  # its own session: Ctrl-C at the terminal is the controller's alone
        assert r["server_cmdline"][1:] == ["-m", "skytasks.node.forkserver", "--controller", str(os.getpid())]
        assert r["template_has_torch"] and r["forked"]
        assert r["template_cpu_s"] < 0.5  # it never imported torch itself (seconds of CPU): it had it
        assert r["mark"] == "set after the server may have started"  # the environment of now
        assert r["cwd"] == str(tmp_path)  # and the directory
    assert len({r["server"] for r in first + second}) == 1  # one server for both pools
    assert psutil.Process(first[0]["server"]).parent().pid == os.getpid()


def test_the_ranks_thread_settings_reach_torch_in_a_forked_rank(monkeypatch):
    """torch reads OMP_NUM_THREADS as it loads: a server imports it with the ranks' own value,
    whether it comes from the pool's `env` or the controller's environment."""
    def threads(**env) -> list[dict]:
        return distributed_task(what_the_node_is, pool=GPUPool(nodes=1, procs_per_node=2, env=env))()

    from_pool = threads(OMP_NUM_THREADS="1")
    unset = threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from_controller = threads()
    assert [r["threads"] for r in from_pool] == [1, 1]
    assert [r["threads"] for r in unset] == [torch_threads_by_default()] * 2
    assert [r["threads"] for r in from_controller] == [1, 1]
    assert all(r["forked"] and r["template_has_torch"] for r in from_pool + unset + from_controller)
    assert from_pool[0]["server"] == from_controller[0]["server"] != unset[0]["server"]


def torch_threads_by_default() -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def agents_parent() -> int:
    return psutil.Process(os.getppid()).ppid()


def test_ranks_that_do_not_use_torch_never_make_their_nodes_import_it():
    pool = GPUPool(nodes=2, procs_per_node=1)
    with pool:  # a session started before any call: what its ranks import is not known
        parents = distributed_task(agents_parent, pool=pool, init_torch=False)()
        maps = distributed_task(lambda: open(f"/proc/{os.getppid()}/maps").read(), pool=pool, init_torch=False)()
    assert all("libtorch" not in m for m in maps)
    server = psutil.Process(parents[0])
    assert "skytasks.node.forkserver" in " ".join(server.cmdline())


def test_without_a_fork_server_agents_start_fresh(monkeypatch):
    monkeypatch.setenv("SKYTASKS_RANK_START", "exec")  # every process a fresh interpreter
    assert distributed_task(agents_parent, pool=GPUPool(nodes=2), init_torch=False)() == [os.getpid()] * 2
    monkeypatch.delenv("SKYTASKS_RANK_START")
    monkeypatch.setattr(forked_agents, "MAX_SERVERS", 0)  # as when no server can be had
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # a startup environment no server has yet
    assert distributed_task(agents_parent, pool=GPUPool(nodes=2), init_torch=False)() == [os.getpid()] * 2


@pytest.mark.parametrize("ending", ["ctrl-c", "sigkill"])
def test_the_server_leaves_with_its_controller(tmp_path, ending):
    program = ROOT / "tests/programs/long_call.py"
    proc = subprocess.Popen([sys.executable, str(program), str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_files(tmp_path, ["rank0.pid", "rank1.pid"], proc)
        servers = [p for p in fork_servers() if p.ppid() == proc.pid]
        assert len(servers) == 1
        if ending == "sigkill":
            proc.kill()
        else:
            proc.send_signal(signal.SIGINT)  # the controller unwinds and exits
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while not gone(servers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(servers[0])
    finally:
        proc.kill()
        proc.wait()
