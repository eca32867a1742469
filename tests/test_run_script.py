"""Bring your own training code: a torchrun script runs unchanged, with torchrun's environment, in
a workdir every node gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

from skytasks import DistributedTaskError, GPUPool, distributed_task
from skytasks.errors import PoolConfigError, ScriptFailed
from skytasks.script import ScriptResult, run_script
from tests.conftest import skytasks_processes, started_here
from tests.harness.ssh_pools import ssh_pool
from tests.harness.sshd import free_port

ROOT = Path(__file__).resolve().parent.parent

# A script as people write them for torchrun: argparse, a sibling module, its own process group.
TRAIN = """
import argparse, json, os, sys
import torch
import torch.distributed as dist
from helpers import double

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--exit-rank", type=int, default=-1)
args = parser.parse_args()
dist.init_process_group("gloo")  # env://, as under torchrun
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum={t.item()} lr={args.lr} double={double(2)}")
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"{dist.get_rank()}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "cwd": os.getcwd(), "sum": t.item()}, f)
if dist.get_rank() == args.exit_rank:
    print("giving up on purpose", file=sys.stderr, flush=True)
    # Gone at once, group and all: its peer, waiting in the barrier below, only fails once this
    # process is dead, so the 3 is the first failure. (`destroy_process_group(); sys.exit(3)` lets
    # the peer fail first while this interpreter is still tearing torch down, and `sys.exit(3)`
    # with the group alive can end in SIGABRT from gloo's threads, under torchrun too.)
    os._exit(3)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    (root / "train.py").write_text(TRAIN)
    (root / "helpers.py").write_text("def double(x):\n    return 2 * x\n")
    return root


def read_outputs(out: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


def run_torchrun(project: Path, out: Path) -> dict[int, dict]:
    """torchrun itself, 2 nodes x 2 procs on this machine, for the environment it gives."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port,
                               "train.py", "--lr", "0.5", "--out", str(out)],
                              cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    for p in procs:
        output = p.communicate(timeout=180)[0]
        assert p.returncode == 0, output[-3000:]
    return read_outputs(out)


TERMINAL = {"_", "COLUMNS", "LINES"}  # the launching shell's, not torchrun's


def test_an_unchanged_torchrun_script_gets_exactly_torchruns_environment(project, tmp_path):
    results = run_script("train.py", ["--lr", "0.5", "--out", str(tmp_path / "sky")], workdir=project,
                         pool=GPUPool(nodes=2, procs_per_node=2))
    assert results == [ScriptResult(rank=r, exit_code=0) for r in range(4)]
    ours = read_outputs(tmp_path / "sky")
    theirs = run_torchrun(project, tmp_path / "torchrun")
    assert sorted(ours) == sorted(theirs) == [0, 1, 2, 3]
    # What torchrun adds to the environment, every variable, compared rank by rank.
    added = {k for r in theirs.values() for k, v in r["env"].items() if os.environ.get(k) != v} - TERMINAL
    assert {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "ROLE_WORLD_SIZE"} <= added
    differ_by_nature = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
    for rank in range(4):
        mine, torchrun = ours[rank]["env"], theirs[rank]["env"]
        assert added <= set(mine), f"rank {rank} lacks {sorted(added - set(mine))}"
        assert {k: mine[k] for k in added - differ_by_nature} == {k: torchrun[k] for k in added - differ_by_nature}
        # As under torchrun, the store is hosted for the script (bound to the peers' interface) and
        # every script rank, rank 0's too, connects to it as a client.
        assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "True" and mine["TORCHELASTIC_RUN_ID"]
        assert mine["NODE_RANK"] == torchrun["GROUP_RANK"] and "SKYTASKS_RANK" in mine
        assert ours[rank]["sum"] == 6.0 and Path(ours[rank]["cwd"]) == project


def test_a_rank_exiting_3_fails_the_call_fast_naming_rank_and_code(project, tmp_path):
    with pytest.raises(DistributedTaskError) as caught:
        run_script("train.py", ["--lr", "1", "--out", str(tmp_path / "o"), "--exit-rank", "1"], workdir=project,
                   pool=GPUPool(nodes=2))
    (failed,) = caught.value.exceptions
    assert isinstance(failed, ScriptFailed) and (failed.rank, failed.exit_code) == (1, 3)
    assert "giving up on purpose" in failed.stderr_tail
    assert "rank 1: the script exited with code 3" in str(failed)


def test_the_cli_is_a_drop_in_for_torchrun(project, tmp_path):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    cli = [sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", "--workdir", str(project), "train.py",
           "--lr", "0.25", "--out", str(tmp_path / "cli")]
    ok = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "[rank 0] rank 0/2 sum=1.0 lr=0.25 double=4" in ok.stdout
    assert "[rank 1] rank 1/2 sum=1.0 lr=0.25 double=4" in ok.stdout
    assert ok.stdout.count("sum=1.0") == 2  # printed once each, not again by Prefect's console log
    bad = subprocess.run([*cli, "--exit-rank", "1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert bad.returncode == 3
    assert "root cause: rank 1: the script exited with code 3" in bad.stderr
    assert "giving up on purpose" in bad.stderr


def test_run_script_in_a_flow_records_rank_runs_with_their_logs(project, tmp_path):
    @flow
    def scripted():
        return run_script("train.py", ["--lr", "2", "--out", str(tmp_path / "f")], workdir=project,
                          pool=GPUPool(nodes=2), name="train-script")

    state = scripted(return_state=True)
    assert state.result() == [ScriptResult(0, 0), ScriptResult(1, 0)]

    from tests.harness.prefect_api import logs_when, settled_task_runs

    by_name = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, expect=3)}
    assert {"train-script", "train-script[rank 0/2]", "train-script[rank 1/2]"} <= set(by_name)
    assert all(by_name[n].state.is_completed() for n in by_name)
    logs = logs_when(LogFilter(task_run_id=LogFilterTaskRunId(any_=[by_name["train-script[rank 1/2]"].id])),
                     lambda found: any("rank 1/2 sum=1.0 lr=2.0" in log.message for log in found))
    messages = [log.message for log in logs]
    assert any("rank 1/2 sum=1.0 lr=2.0" in m for m in messages), messages


@pytest.mark.parametrize("case", ["missing script", "workdir not a dir", "workdir missing", "over the limit",
                                  "module name"])
def test_bad_input_names_the_argument_before_anything_starts(case, project, tmp_path, monkeypatch):
    pool = GPUPool(nodes=2)
    if case == "missing script":
        call, match = lambda: run_script("nope.py", workdir=project, pool=pool), r"^script: 'nope.py' not found in workdir"
    elif case == "workdir not a dir":
        call, match = lambda: run_script("train.py", workdir=project / "train.py", pool=pool), r"^workdir: .* is not a directory"
    elif case == "workdir missing":
        call, match = lambda: distributed_task(print, pool=pool, workdir=tmp_path / "gone")(), r"^workdir: .* does not exist"
    elif case == "module name":
        call, match = lambda: run_script("not a module", module=True, pool=pool), r"^script: 'not a module' is not a module"
    else:
        monkeypatch.setenv("SKYTASKS_WORKDIR_LIMIT_MB", "1")
        (project / "data").mkdir()
        (project / "data" / "big.bin").write_bytes(os.urandom(1_500_000))
        ssh = GPUPool(provider="ssh", nodes=1, hosts=["127.0.0.1:1"], known_hosts="x")  # never reached
        call, match = (lambda: run_script("train.py", workdir=project, pool=ssh),
                       r"^workdir: .* over the 1 MB limit .* Largest entries: data/ \(1\.5 MB\)")
    with pytest.raises(PoolConfigError, match=match):
        call()
    assert started_here() == []


def test_gitignored_files_and_dot_git_stay_behind(project):
    from skytasks.workdir import read_workdir

    (project / ".git").mkdir()
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / ".gitignore").write_text("*.ckpt\nlogs/\n!keep.ckpt\n")
    (project / "model.ckpt").write_text("x")
    (project / "keep.ckpt").write_text("x")
    (project / "logs").mkdir()
    (project / "logs" / "run.txt").write_text("x")
    (project / "pkg").mkdir()
    (project / "pkg" / ".gitignore").write_text("local.cfg\n")
    (project / "pkg" / "local.cfg").write_text("x")
    (project / "pkg" / "mod.py").write_text("x = 1\n")
    assert [f.path for f in read_workdir(project).files] == [
        ".gitignore", "helpers.py", "keep.ckpt", "pkg/.gitignore", "pkg/mod.py", "train.py"]


# -- workdir on ssh nodes (a real OpenSSH server on two loopback "hosts") ------------------------

def _home() -> str:
    return os.path.expanduser("~")


def test_workdir_travels_to_ssh_nodes_content_addressed(sshd, project, tmp_path, capsys):
    token = uuid.uuid4().hex  # new contents each test run: the nodes' cache never had them
    for name in ("train.py", "helpers.py"):
        (project / name).write_text((project / name).read_text() + f"\n# {token}\n")
    (project / "notes.txt").write_text(token)

    def call() -> str:
        results = run_script("train.py", ["--lr", "1", "--out", "out"], workdir=project, pool=ssh_pool(sshd))
        assert results == [ScriptResult(0, 0), ScriptResult(1, 0)]
        return capsys.readouterr().err

    def one_node_got(files: int, said: str) -> None:
        # Both nodes are this machine, with one cache, and sync at once: whichever asks first
        # is sent the files; the other finds them there, or (asking at the same moment) is sent
        # them too. Never fewer files, never more.
        got = [f"node {n} (127.0.0.{n + 1}) got {files} file(s)" in said for n in (0, 1)]
        had = [f"node {n} (127.0.0.{n + 1}) had it already" in said for n in (0, 1)]
        assert any(got) and all(g or h for g, h in zip(got, had)), said

    one_node_got(3, call())
    second = call()
    assert "node 0 (127.0.0.1) had it already" in second and "node 1 (127.0.0.2) had it already" in second
    (project / "helpers.py").write_text("def double(x):\n    return 2 * x  # changed\n" + f"# {token}\n")
    one_node_got(1, call())
    # Where the node keeps its cache: its own home, as its login gives it (not this process's HOME).
    node_home = distributed_task(_home, pool=ssh_pool(sshd), init_torch=False)()[0]
    landed = [p for p in Path(node_home).glob(".cache/skytasks/work-*") if (p / "notes.txt").exists()
              and (p / "notes.txt").read_text() == token]
    assert len(landed) == 2  # two trees: before and after the change, each built once


def test_a_function_imports_a_helper_from_the_workdir_on_ssh_nodes(sshd, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    module = f"helper_{uuid.uuid4().hex[:8]}"  # no such module anywhere but in the workdir
    (work / f"{module}.py").write_text("def greet(rank):\n    return f'hello from rank {rank}'\n")

    def uses_helper(name: str) -> tuple[str, str]:
        import importlib
        import os

        from skytasks import rank_info

        return importlib.import_module(name).greet(rank_info().rank), os.getcwd()

    results = distributed_task(uses_helper, pool=ssh_pool(sshd), workdir=work, init_torch=False)(module)
    assert [r[0] for r in results] == ["hello from rank 0", "hello from rank 1"]
    assert all("/.cache/skytasks/work-" in r[1] for r in results)
    with pytest.raises(DistributedTaskError):  # without the workdir, the nodes never had it
        distributed_task(uses_helper, pool=ssh_pool(sshd), init_torch=False)(module)


def test_ctrl_c_on_the_cli_stops_every_rank(tmp_path):
    import signal
    import time

    from prefect.settings import PREFECT_API_URL

    (tmp_path / "wait.py").write_text(
        "import os, time\nprint('waiting', os.environ['RANK'], flush=True)\ntime.sleep(600)\n")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    cli = subprocess.Popen([sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", "wait.py"], cwd=tmp_path,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while len(seen) < 2 and time.monotonic() < deadline:
            line = cli.stdout.readline()
            if line.startswith("[rank ") and "waiting" in line:
                seen.append(line)
        assert len(seen) == 2, seen
        assert len(skytasks_processes()) >= 4  # 2 agents, 2 ranks (and the scripts under them)
        cli.send_signal(signal.SIGINT)  # what Ctrl-C at the terminal does
        _, err = cli.communicate(timeout=60)
        assert cli.returncode == 130, err[-3000:]
        assert "interrupted; every rank was stopped" in err
    finally:
        if cli.poll() is None:  # a failed assertion above must not leave the CLI and its ranks running
            cli.kill()
            cli.communicate()
    from tests.conftest import wait_for_no_skytasks_processes

    assert wait_for_no_skytasks_processes() == []
    assert not [p for p in __import__("psutil").process_iter(["cmdline"])
                if "wait.py" in " ".join(p.info["cmdline"] or [])]
