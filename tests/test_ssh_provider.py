"""provider="ssh" against a real OpenSSH server on two loopback addresses (two "hosts")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skytasks import DistributedTaskError, PoolStartError, RankProcessDied, distributed_task, rank_info
from tests.conftest import skytasks_processes, wait_for_no_skytasks_processes
from tests.harness.ssh_pools import LOOPBACK_HOSTS, ssh_pool
from tests.harness.sshd import keygen

ROOT = Path(__file__).resolve().parent.parent
HOSTS = LOOPBACK_HOSTS


def where() -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank_info().rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank_info().rank, "addr": rank_info().peers[rank_info().node_rank], "sum": t.item(),
            "skytasks_from": __import__("skytasks").__file__}


def test_a_two_node_gloo_job_across_two_ssh_hosts(sshd):
    results = distributed_task(where, pool=ssh_pool(sshd))()
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["addr"] for r in results] == list(HOSTS)
    assert {r["sum"] for r in results} == {3.0}
    # The node ran the controller's own skytasks, shipped and cached by content hash.
    assert all("/.cache/skytasks/" in r["skytasks_from"] for r in results)


def test_a_wrong_host_key_is_refused_naming_the_host(sshd, tmp_path):
    other = keygen(tmp_path / "other_host_key")
    wrong = "".join(f"[{h}]:{sshd.port} {' '.join(other.split()[:2])}\n" for h in HOSTS)
    with pytest.raises(PoolStartError, match=r"node \d \(127\.0\.0\.\d:\d+\): host key of 127\.0\.0\.\d"):
        distributed_task(where, pool=ssh_pool(sshd, known_hosts=wrong))()


def test_an_unknown_host_is_refused(sshd):
    only_first = sshd.known_hosts().splitlines()[0] + "\n"
    with pytest.raises(PoolStartError, match=r"node 1 \(127\.0\.0\.2:\d+\): host key of 127\.0\.0\.2"):
        distributed_task(where, pool=ssh_pool(sshd, known_hosts=only_first))()


def kill_rank_1() -> int:
    if rank_info().rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
    return 0


def test_a_killed_remote_rank_fails_fast(sshd):
    started = time.monotonic()
    with pytest.raises(DistributedTaskError) as caught:
        distributed_task(kill_rank_1, pool=ssh_pool(sshd), init_torch=False)()
    [exc] = caught.value.exceptions
    assert isinstance(exc, RankProcessDied) and exc.rank == 1
    assert time.monotonic() - started < 60  # bounded: not the 600 s sleep of rank 0


def test_the_controller_disappearing_kills_the_remote_ranks(sshd, tmp_path):
    """The agents wait reattach_seconds (+2 s) for their controller to come back, then end their
    ranks: with a window of 5 s, everything is gone well within 30 s."""
    script = tmp_path / "controller.py"
    script.write_text(f"""
import sys, time, os
sys.path.insert(0, {str(ROOT)!r})
from skytasks import GPUPool
from skytasks import distributed_task, rank_info
def forever():
    open(os.path.join({str(tmp_path)!r}, f"rank{{rank_info().rank}}"), "w").write(str(os.getpid()))
    time.sleep(3600)
pool = GPUPool(provider="ssh", nodes=2, hosts={[f"root@{h}:{sshd.port}" for h in HOSTS]!r},
               ssh_private_key={sshd.client_key!r}, known_hosts={sshd.known_hosts()!r}, remote_python={sys.executable!r},
               reattach_seconds=5)
distributed_task(forever, pool=pool, init_torch=False)()
""")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert len(skytasks_processes()) >= 4
        proc.kill()
        proc.wait()
        assert wait_for_no_skytasks_processes(timeout=30) == []
    finally:
        proc.kill()


def make_wheel(folder: Path, name: str, value: int) -> Path:
    """A real, minimal wheel on disk, so installing it needs no package index (no network)."""
    import base64
    import hashlib
    import zipfile

    files = {
        f"{name}/__init__.py": f"VALUE = {value}\n",
        f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{name}-1.0.dist-info/RECORD,,")
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in {**files, f"{name}-1.0.dist-info/RECORD": "\n".join(record) + "\n"}.items():
            z.writestr(path, text)
    return wheel


def test_pip_packages_and_env_apply_on_the_ssh_nodes(sshd, tmp_path):
    wheel = make_wheel(tmp_path, "skytasks_probe_pkg", 42)

    def probe() -> tuple:
        import skytasks_probe_pkg

        return skytasks_probe_pkg.VALUE, os.environ["PROBE_SETTING"], skytasks_probe_pkg.__file__

    # PIP_NO_INDEX is an env entry like any other: it reaches pip on the node too.
    pool = ssh_pool(sshd, pip_packages=[str(wheel)], env={"PROBE_SETTING": "on", "PIP_NO_INDEX": "1"})
    results = distributed_task(probe, pool=pool, init_torch=False)()
    assert [r[:2] for r in results] == [(42, "on"), (42, "on")]
    assert all("/.cache/skytasks/pip-" in r[2] for r in results)


def test_a_package_that_cannot_be_installed_fails_the_start_naming_pip_packages(sshd):
    pool = ssh_pool(sshd, pip_packages=["/nonexistent/skytasks_missing-1.0-py3-none-any.whl"], env={"PIP_NO_INDEX": "1"})
    with pytest.raises(PoolStartError, match="pip_packages"):
        distributed_task(lambda: 1, pool=pool, init_torch=False)()


def test_a_function_that_imports_a_helper_from_a_sibling_module_runs_on_nodes_without_the_project(
        sshd, tmp_path, monkeypatch):
    project = tmp_path / "my_project"
    project.mkdir()
    (project / "helpers.py").write_text("def scale(x):\n    return 10 * x\n")
    (project / "train.py").write_text(
        "from helpers import scale\nfrom skytasks import rank_info\n\n"
        "def job():\n    import sys\n    return scale(rank_info().rank), any('my_project' in p for p in sys.path)\n"
    )
    monkeypatch.syspath_prepend(str(project))
    import train  # noqa: the user's own module, importable here only

    results = distributed_task(train.job, pool=ssh_pool(sshd), init_torch=False)()
    # The nodes never had the project on their path; the helper travelled by value.
    assert results == [(0, False), (10, False)]


SYSTEM_PYTHON = "/usr/bin/python3"  # the system's own Python: no torch, no cloudpickle


def test_a_python_without_torch_fails_the_start_naming_remote_python_before_any_rank(sshd):
    lacks = subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True, text=True)
    assert lacks.returncode != 0, "this test needs a Python without torch"
    started = time.monotonic()
    with pytest.raises(PoolStartError) as caught:
        distributed_task(lambda: 1, pool=ssh_pool(sshd, remote_python=SYSTEM_PYTHON), init_torch=False)()
    text = str(caught.value)
    assert text.startswith("remote_python: node ") and f"remote_python={SYSTEM_PYTHON!r}" in text, text
    assert "ModuleNotFoundError: No module named 'torch'" in text, text
    assert "No module named 'cloudpickle'" in text, text
    assert "no rank was started" in text and time.monotonic() - started < 30
    assert wait_for_no_skytasks_processes() == []  # no agent is left on either host


def test_a_remote_python_that_does_not_exist_fails_the_start_naming_it(sshd):
    with pytest.raises(PoolStartError, match=r"remote_python: node \d .*'/nonexistent/python3' did not start.*"
                                             r"/nonexistent/python3"):
        distributed_task(lambda: 1, pool=ssh_pool(sshd, remote_python="/nonexistent/python3"), init_torch=False)()


def test_the_env_reaches_the_node_s_python_on_stdin_and_the_stream_after_it_is_untouched():
    """The bootstrap's half of env_in, in a local Python: the env arrives, a startup variable
    (PYTHONOPTIMIZE) restarts the interpreter with it in the same process, the bytes after the
    env line are left for the agent, and nothing of the env is on the command line."""
    from skytasks.providers.remote import env_in

    code = env_in.ENV_IN + "\n_env_in()\n" + (
        "import os, sys\n"
        "print(os.getpid(), os.environ['MY_TOKEN'], sys.flags.optimize, 'SKYTASKS_ENV_READ' in os.environ,\n"
        "      sys.stdin.read(), flush=True)\n")
    secret = "tok-' \"$HOME\n\u00e9"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)
    out, _ = proc.communicate(env_in.frame({"MY_TOKEN": secret, "PYTHONOPTIMIZE": "1", "PYTHONPATH": "/x"}) + b"rest",
                              timeout=30)
    pid, rest = out.decode().split(" ", 1)
    assert int(pid) == proc.pid and rest == f"{secret} 1 False rest\n"
    assert secret not in env_in.command(sys.executable, env_in.AGENT_START, "-m x", "$HOME/a")
    assert b"/x" not in env_in.frame({"PYTHONPATH": "/x"})  # PYTHONPATH stays the command line's
