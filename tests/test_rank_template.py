"""A node forks its ranks from one warm template (milliseconds each), and a forked rank is what a
cold one is: the agent's child, in a session of its own, with its own environment and random
state. Where forking would not be faithful, the rank starts cold."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import psutil
import pytest

from skytasks import DistributedTaskError, GPUPool, distributed_task

FORKED_CTRL_FD = "3"  # a forked rank finds its channel on fd 3; a cold one on whatever the agent had


def what_a_rank_is() -> dict:
    me = psutil.Process()
    parent = me.parent()
    return {
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "pid": me.pid,
        "parent": " ".join(parent.cmdline()),
        "parent_children": [" ".join(c.cmdline()) for c in parent.children()],
        "cmdline": " ".join(me.cmdline()).split(),
        "own_session": os.getsid(0) == me.pid,
        "ctrl_fd": os.environ["SKYTASKS_CTRL_FD"],
        "random": random.random(),
        "stdin": sys.stdin.read(),
        "hash": hash("skytasks"),
        "frozen": __import__("gc").get_freeze_count(),  # the template's objects, frozen before the fork
        "template_has_torch": template_has_torch(parent),
    }


def template_has_torch(agent: psutil.Process) -> bool | None:
    template = next((c for c in agent.children() if "skytasks.node.rank_template" in " ".join(c.cmdline())), None)
    if template is None:
        return None
    with open(f"/proc/{template.pid}/maps") as maps:
        return any("libtorch" in line for line in maps)


def test_ranks_are_forked_from_a_warm_template_and_are_still_the_agents_children():
    pool = GPUPool(nodes=2, procs_per_node=2)
    with pool:
        ranks = distributed_task(what_a_rank_is, pool=pool, init_torch=False)()
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    for r in ranks:
        assert r["ctrl_fd"] == FORKED_CTRL_FD  # forked, not a fresh interpreter
        assert "skytasks.node.agent" in r["parent"]  # os.getppid() is the node agent, as before
        templates = [c for c in r["parent_children"] if "skytasks.node.rank_template" in c]
        assert len(templates) == 1  # one template per node, beside the ranks
        assert r["cmdline"][1:] == ["-m", "skytasks.node.worker"]  # `ps` shows a rank as a rank
        assert r["own_session"] and r["stdin"] == ""
        assert r["frozen"] > 1000  # a rank's collections leave the template's objects (and pages) alone
        assert r["template_has_torch"] is False  # ranks that do not initialise torch never pay for importing it
    assert len({r["random"] for r in ranks}) == 4  # each rank's random state is its own


def ask_my_own_stack() -> dict:
    import signal

    path = os.environ["SKYTASKS_STACK_FILE"]
    os.kill(os.getpid(), signal.SIGUSR1)  # as the agent asks: faulthandler writes, the rank goes on
    deadline = time.monotonic() + 5
    while "ask_my_own_stack" not in open(path).read() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"rank": int(os.environ["RANK"]), "file": path, "stack": open(path).read(),
            "ctrl_fd": os.environ["SKYTASKS_CTRL_FD"]}


def test_a_forked_rank_can_be_asked_where_it_is_from_birth_and_says_it_in_its_own_file():
    """The template registers faulthandler once for every rank it forks (a registration per rank
    cost each 0.5 ms of CPU); each rank points it at its own stack file as it starts."""
    pool = GPUPool(nodes=1, procs_per_node=3)
    with pool:
        ranks = distributed_task(ask_my_own_stack, pool=pool, init_torch=False)()
    assert [r["ctrl_fd"] for r in ranks] == [FORKED_CTRL_FD] * 3  # forked ones
    assert len({r["file"] for r in ranks}) == 3
    for r in ranks:
        assert "ask_my_own_stack" in r["stack"] and "test_rank_template.py" in r["stack"], r["stack"]
        assert r["stack"].count("ask_my_own_stack") == 1  # its own dump only, none of its siblings'


def torch_in_a_rank() -> dict:
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return {"ctrl_fd": os.environ["SKYTASKS_CTRL_FD"], "threads": torch.get_num_threads(), "sum": total.item(),
            "template_has_torch": template_has_torch(psutil.Process().parent())}


def test_a_nodes_torch_ranks_are_forked_from_one_import_of_torch_made_with_their_own_thread_settings():
    """8 ranks importing torch each cost 8 imports of CPU and memory; forked after the template's
    one import, they share it. Its thread pools read the rank's settings, not the agent's."""
    pool = GPUPool(nodes=2, procs_per_node=2, env={"OMP_NUM_THREADS": "1"})  # 2 cores here: not the default
    with pool:
        ranks = distributed_task(torch_in_a_rank, pool=pool)()
    assert [r["sum"] for r in ranks] == [4.0] * 4  # a real gloo group of forked ranks
    for r in ranks:
        assert r["ctrl_fd"] == FORKED_CTRL_FD and r["template_has_torch"] is True
        assert r["threads"] == 1


def routes_seen() -> dict:
    from skytasks.node import socket_interface

    return {"routes": dict(socket_interface._ROUTES), "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
            "head": os.environ["MASTER_ADDR"]}


def test_forked_ranks_take_the_interface_towards_the_head_that_their_template_found():
    """gloo's interface is the one that reaches the head (test_multihost: eth0 in a namespace).
    A node's template finds it as it forks a group, so its ranks do not each probe again."""
    pool = GPUPool(nodes=2, procs_per_node=2)
    with pool:
        ranks = distributed_task(routes_seen, pool=pool, init_torch=False)()
    for r in ranks:
        assert r["routes"] == {r["head"]: "lo"} and r["gloo"] == "lo"


def test_a_rank_whose_thread_settings_differ_from_the_templates_torch_starts_cold():
    from skytasks.node.rank_starter import RankStarter

    starter = RankStarter(None, None, {"PATH": "/bin"})
    starter._torch_env = {"OMP_NUM_THREADS": "1"}
    assert not starter._changes_startup({"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "3"})
    assert starter._changes_startup({"PATH": "/bin", "OMP_NUM_THREADS": "4"})
    assert starter._changes_startup({"PATH": "/bin"})  # the import saw 1; this rank's pools would take the default
    assert starter._changes_startup({"PATH": "/bin", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"})


def test_an_environment_read_only_at_interpreter_start_starts_the_rank_cold():
    pool = GPUPool(nodes=1, procs_per_node=2, env={"PYTHONHASHSEED": "7"})
    with pool:
        ranks = distributed_task(what_a_rank_is, pool=pool, init_torch=False)()
    expected = subprocess.run([sys.executable, "-c", "print(hash('skytasks'))"], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": "7"}).stdout.strip()
    for r in ranks:
        assert r["ctrl_fd"] != FORKED_CTRL_FD
        assert str(r["hash"]) == expected  # the seed took effect: a forked rank could not have it
        assert "skytasks.node.agent" in r["parent"]


def test_rank_start_exec_starts_every_rank_as_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv("SKYTASKS_RANK_START", "exec")
    pool = GPUPool(nodes=1, procs_per_node=2)
    with pool:
        ranks = distributed_task(what_a_rank_is, pool=pool, init_torch=False)()
    for r in ranks:
        assert r["ctrl_fd"] != FORKED_CTRL_FD
        assert not any("skytasks.node.rank_template" in c for c in r["parent_children"])
        assert r["frozen"] == 0


def fail_once(flag: str) -> None:
    if not os.path.exists(flag):
        open(flag, "w").close()
        raise RuntimeError("a failed call: the next one starts a new group")


def test_a_node_whose_template_died_keeps_its_ranks_and_starts_new_ones_cold(tmp_path):
    pool = GPUPool(nodes=1, procs_per_node=2)
    task = distributed_task(what_a_rank_is, pool=pool, init_torch=False)
    with pool:
        first = task()
        agent = psutil.Process(psutil.Process(first[0]["pid"]).ppid())
        template = next(c for c in agent.children() if "skytasks.node.rank_template" in " ".join(c.cmdline()))
        template.kill()
        template.wait(5)
        # The ranks are the agent's, not the template's: the warm group goes on.
        assert [r["pid"] for r in task()] == [r["pid"] for r in first]
        with pytest.raises(DistributedTaskError):
            distributed_task(fail_once, pool=pool, init_torch=False)(str(tmp_path / "flag"))
        after = task()  # a new group, started cold
    assert {r["ctrl_fd"] for r in after} != {FORKED_CTRL_FD}
    assert not {r["pid"] for r in after} & {r["pid"] for r in first}


def leave_an_orphan() -> tuple[int, int]:
    """A daemon made the classic way (fork twice): its parent is gone, so it is the agent's now.
    It ends at once; unreaped, it would stay a zombie child of the agent for the pool's life."""
    read, write = os.pipe()
    if os.fork() == 0:
        orphan = os.fork()
        if orphan == 0:
            time.sleep(3)  # by then its parent is gone and the agent has it; the test sees it first
            os._exit(0)
        os.write(write, str(orphan).encode())
        os._exit(0)
    os.close(write)
    os.wait()
    return psutil.Process().ppid(), int(os.read(read, 64))


def test_orphans_that_the_agent_inherits_are_reaped():
    pool = GPUPool(nodes=1, procs_per_node=1)
    with pool:
        agent_pid, orphan = distributed_task(leave_an_orphan, pool=pool, init_torch=False)()[0]
        agent = psutil.Process(agent_pid)
        assert orphan in [c.pid for c in agent.children()]  # the agent (a subreaper) inherited it
        deadline = time.monotonic() + 10
        while orphan in [c.pid for c in agent.children()] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert orphan not in [c.pid for c in agent.children()]  # it ended, and was reaped


def test_a_template_that_does_not_answer_in_time_is_never_asked_again(monkeypatch):
    """Its answer may still come, and must not be read as the next request's (another batch's
    pids): the agent drops the template, whose end of the socket then closes, and starts cold."""
    import socket

    from skytasks.node import rank_starter

    monkeypatch.setattr(rank_starter, "TEMPLATE_ANSWER_SECONDS", 0.2)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    starter = rank_starter.RankStarter(ours, None, dict(os.environ))
    read_end, ctrl_write = os.pipe()
    try:
        assert starter._fork([(dict(os.environ), ctrl_write)]) is None  # timed out: the caller starts it cold
        data, fds, _, _ = socket.recv_fds(theirs, 1 << 20, 8)  # the request did reach the template
        assert b"envs" in data and len(fds) == 4
        for fd in fds:
            os.close(fd)
        assert starter._sock is None  # not asked again
        theirs.settimeout(5)
        assert theirs.recv(1) == b""  # and told to leave: its socket closed
    finally:
        for fd in (read_end, ctrl_write):
            os.close(fd)
        theirs.close()
