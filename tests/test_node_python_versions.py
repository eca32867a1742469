"""A node's Python must be the controller's major.minor, with a cloudpickle of the controller's major
version: code travels as cloudpickle's pickle of its bytecode. The rule as a pure function, then
the check's lines on this machine's other real Pythons (/root/.pyenv), then real pools: ssh nodes
on a real OpenSSH, a SLURM step on the test cluster, and `skytasks check`'s verdict on the same.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import cloudpickle
import pytest

from skytasks import GPUPool, PoolStartError, distributed_task
from skytasks.providers import agent_args
from skytasks.providers.remote import env_in, python_check
from skytasks.providers.remote.python_check import Controller, Found
from tests.conftest import started_here
from tests.harness.ssh_pools import ssh_pool

ROOT = Path(__file__).resolve().parent.parent
HERE = Controller("3.11.7", (3, 11, 7), "3.1.3")
CONTROLLER = f"the controller runs Python {sys.version.split()[0]} with cloudpickle {cloudpickle.__version__}"


def other_python(minor: str) -> str:
    """This machine's Python 3.<minor> (pyenv's), one without torch or cloudpickle."""
    found = sorted(glob.glob(f"/root/.pyenv/versions/3.{minor}.*/bin/python3"))
    if not found:
        pytest.skip(f"no Python 3.{minor} under /root/.pyenv/versions here")
    return found[-1]


def version_of(python: str) -> str:
    return subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.fixture(scope="session")
def cloudpickle_2(tmp_path_factory) -> Path:
    """A real cloudpickle 2.2.1 in a folder of its own, for PYTHONPATH: a major version the
    controller's 3.x pickles cannot be rebuilt by."""
    # Installed by `make setup` (the Makefile), as the lowest allowed one is: tests reach no registry.
    target = ROOT / ".venv" / "cloudpickle-2"
    assert (target / "cloudpickle").is_dir(), "run `make setup`: it installs cloudpickle 2.2.1 into .venv/cloudpickle-2"
    return target


# -- the rule, without nodes ----------------------------------------------------------------------


def test_the_floors_are_pyprojects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=%d.%d" % python_check.MIN_PYTHON
    assert "cloudpickle>=%d.%d" % python_check.CLOUDPICKLE_FLOOR in project["dependencies"]


@pytest.mark.parametrize("node, fits", [
    ("3.1.3", True), ("3.0.0", True), ("3.2.0", True), ("3.0.0rc1", True),
    ("2.2.1", False), ("4.0.0", False), ("", False), ("unknown", False),
])
def test_a_cloudpickle_fits_where_its_major_is_the_controllers(node, fits):
    assert python_check.cloudpickle_fits(node, "3.1.3") is fits


def node(version: str, cloudpickle: str | None = "3.1.3", missing: dict | None = None) -> Found:
    return Found("/opt/py/bin/python3", version, missing or {}, tuple(int(n) for n in version.split(".")),
                 cloudpickle)


def test_the_python_minor_decides_then_cloudpickles_major():
    assert python_check.why_not(node("3.11.2"), HERE) == []  # another patch release reads the same bytecode
    assert python_check.why_not(node("3.11.2", "3.0.0"), HERE) == []
    assert python_check.why_not(node("3.12.1"), HERE) == [
        "code travels as bytecode, which only the same Python minor version reads"]
    assert python_check.why_not(node("3.10.13"), HERE) == [
        "code travels as bytecode, which only the same Python minor version reads",
        "the node agent needs Python 3.11 or later"]
    [why] = python_check.why_not(node("3.11.7", "2.2.1"), HERE)
    assert "only a cloudpickle of the same major version rebuilds" in why and "cloudpickle>=3.0" in why
    assert python_check.why_not(node("3.11.7", None), HERE) == []  # none at all: a lack, said as one


def test_the_error_names_remote_python_and_both_sides():
    text = python_check.wrong_python("node 1 (10.0.0.7)", "/opt/py/bin/python3", node("3.12.1"), here=HERE)
    assert text == (
        "remote_python: node 1 (10.0.0.7): the controller runs Python 3.11.7 with cloudpickle 3.1.3; node 1 "
        "(10.0.0.7) runs Python 3.12.1 with cloudpickle 3.1.3 (remote_python='/opt/py/bin/python3' ran "
        "/opt/py/bin/python3): code travels as bytecode, which only the same Python minor version reads. Set "
        "remote_python to a Python 3.11 on the nodes with torch and cloudpickle 3.x; no rank was started")
    text = python_check.wrong_python("node 1 (10.0.0.7)", "python3", node("3.11.7", "2.2.1"), here=HERE)
    assert text is not None and "runs Python 3.11.7 with cloudpickle 2.2.1 (remote_python='python3' ran" in text
    assert "Install cloudpickle 3.x (pip install 'cloudpickle>=3.0,<4') into that Python, or set" in text
    lacking = node("3.10.13", None, {"torch": "ModuleNotFoundError: No module named 'torch'"})
    text = python_check.wrong_python("node 0 (h)", "python3", lacking, "the default: python3 on the PATH", HERE)
    assert text is not None and text.startswith("remote_python: node 0 (h): the controller runs Python 3.11.7")
    assert "runs Python 3.10.13 with no cloudpickle (remote_python unset, so 'python3'" in text
    assert " (it cannot import torch either). " in text and "needs Python 3.11 or later" in text
    assert python_check.wrong_python("node 0 (h)", "python3", node("3.11.2"), here=HERE) is None


def test_the_error_in_a_pod_names_k8s_image_and_remote_python_where_it_is_set():
    text = python_check.wrong_image("node 0 (pod p-0)", "pytorch/pytorch:2.5.1", "python3", node("3.12.1"), HERE)
    assert text is not None and text.startswith(
        "k8s_image: node 0 (pod p-0): the controller runs Python 3.11.7 with cloudpickle 3.1.3; node 0 (pod p-0) "
        "runs Python 3.12.1 with cloudpickle 3.1.3 (k8s_image='pytorch/pytorch:2.5.1' ran /opt/py/bin/python3)")
    assert "Use an image with Python 3.11 with torch and cloudpickle 3.x (the docs name images" in text
    text = python_check.wrong_image("node 0 (pod p-0)", None, "/opt/py/bin/python3", node("3.12.1"), HERE)
    assert text is not None and "(k8s_image with remote_python='/opt/py/bin/python3' ran" in text
    assert python_check.wrong_image("node 0 (pod p-0)", "img", "python3", node("3.11.0"), HERE) is None


# -- the check's lines on real Pythons ----------------------------------------------------------


def bootstraps() -> dict[str, tuple[list[str], bytes]]:
    """Each provider's first lines on a node, with the arguments and stdin it gets there."""
    from skytasks.providers.kubernetes.node_agents import BOOTSTRAP as POD
    from skytasks.providers.slurm.node_steps import BOOTSTRAP as STEP

    frame = env_in.frame({"SOME_TOKEN": "x"})
    return {"ssh": (["-c", env_in.AGENT_START, *agent_args()], frame),
            "slurm": (["-c", STEP, "0123abcd", "100", "-m", "skytasks.node.agent"], frame),
            "kubernetes": (["-c", POD, "0123abcd", "100", "-m", "skytasks.node.agent"], b"")}


OLD_AND_NEW = sorted({p for p in glob.glob("/root/.pyenv/versions/3.*/bin/python3")
                      if not re.search(r"/3\.(0|1|2|3|4|5)\.|/3\.11\.", p)})


@pytest.mark.parametrize("python", OLD_AND_NEW or ["none"])
def test_every_python_from_3_6_says_its_version_and_stops_before_the_package(python, tmp_path):
    if python == "none":
        pytest.skip("no other Python under /root/.pyenv/versions here")
    version = version_of(python)
    for provider, (args, stdin) in bootstraps().items():
        done = subprocess.run([python, *args], input=stdin, capture_output=True, cwd=tmp_path, timeout=60,
                              env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
        found = python_check.parse(done.stdout)
        assert found is not None, (provider, done.stderr.decode())
        assert found.version == version and found.python[:2] == tuple(int(n) for n in version.split(".")[:2])
        # Its one line and nothing else: no "need" for the package, no agent, no traceback.
        assert done.returncode == 3 and done.stdout.count(b"\n") == 1 and done.stderr == b"", (provider, done)
        text = python_check.wrong_python("node 0 (n)", python, found)
        assert text is not None and CONTROLLER in text and f"runs Python {version} with no cloudpickle" in text


def test_a_python_with_everything_but_the_controllers_minor_stops_after_its_line(tmp_path):
    """torch and cloudpickle found (a package and a dist-info where its Python looks): the node
    itself stops on the version alone, so no agent (3.10: a SyntaxError) and no package follow."""
    from skytasks.providers.slurm.node_steps import BOOTSTRAP

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "cloudpickle").mkdir()
    (tmp_path / "cloudpickle" / "__init__.py").write_text("")
    (tmp_path / "cloudpickle-3.1.3.dist-info").mkdir()
    (tmp_path / "cloudpickle-3.1.3.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cloudpickle\nVersion: 3.1.3\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    for python, code in ((other_python("12"), 3), ("/usr/bin/python3", None)):
        done = subprocess.run([python, "-c", BOOTSTRAP, "0123abcd", "100", "-m", "skytasks.node.agent"],
                              input=env_in.frame({}), capture_output=True, env=env, timeout=60)
        found = python_check.parse(done.stdout.splitlines(keepends=True)[0])
        assert found is not None and found.missing == {} and found.cloudpickle == "3.1.3", done
        if code is not None:
            assert done.returncode == code and done.stdout.count(b"\n") == 1, done
        else:  # the controller's minor goes on: it asks for the package
            assert done.stdout.splitlines()[1] == b"need", done


def test_cloudpickle_s_version_is_read_from_the_module_where_it_has_no_metadata(tmp_path):
    vendored = tmp_path / "vendored"
    vendored.mkdir()
    (vendored / "cloudpickle").symlink_to(Path(cloudpickle.__file__).parent)  # the package, no dist-info
    found = python_check.parse(subprocess.run(
        ["/usr/bin/python3", "-c", python_check.PROBE], capture_output=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(vendored)}).stdout)
    assert found is not None and found.cloudpickle == cloudpickle.__version__ and "cloudpickle" not in found.missing
    # One whose import fails is said in its own words, as a lack.
    (tmp_path / "broken" / "cloudpickle").mkdir(parents=True)
    (tmp_path / "broken" / "cloudpickle" / "__init__.py").write_text("raise ImportError('half installed')\n")
    found = python_check.parse(subprocess.run(
        ["/usr/bin/python3", "-c", python_check.PROBE], capture_output=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "broken")}).stdout)
    assert found is not None and found.missing["cloudpickle"] == "ImportError: half installed"


# -- real pools ---------------------------------------------------------------------------------


def start_fails(pool: GPUPool) -> str:
    started = time.monotonic()
    with pytest.raises(PoolStartError) as caught:
        distributed_task(lambda: 1, pool=pool, init_torch=False)()
    assert time.monotonic() - started < 60
    # No agent is left on any node (sshd and slurmd are this test's: their sessions are ours).
    deadline = time.monotonic() + 10
    while (left := started_here()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []
    return str(caught.value)


@pytest.mark.parametrize("minor", ["12", "10"])
def test_an_ssh_node_with_another_python_fails_the_start_naming_both_versions(sshd, minor):
    python = other_python(minor)
    version = version_of(python)
    text = start_fails(ssh_pool(sshd, remote_python=python))
    # The version is what to fix: said before the lack of torch, which that Python has too.
    assert re.match(rf"remote_python: node \d \(127\.0\.0\.\d\): {re.escape(CONTROLLER)}; node \d "
                    rf"\(127\.0\.0\.\d\) runs Python {re.escape(version)} with no cloudpickle "
                    rf"\(remote_python='{re.escape(python)}' ran ", text), text
    assert "code travels as bytecode, which only the same Python minor version reads" in text
    assert ("needs Python 3.11 or later" in text) is (minor == "10")
    assert "(it cannot import torch, cloudpickle either)" in text and text.endswith("no rank was started"), text


def test_an_ssh_node_with_another_cloudpickle_major_fails_the_start_naming_both(sshd, cloudpickle_2):
    # The controller's own Python (torch and all), with cloudpickle 2.2.1 first on the nodes' path.
    text = start_fails(ssh_pool(sshd, env={"PYTHONPATH": str(cloudpickle_2)}))
    assert re.match(rf"remote_python: node \d \(127\.0\.0\.\d\): {re.escape(CONTROLLER)}; node \d "
                    rf"\(127\.0\.0\.\d\) runs Python {re.escape(sys.version.split()[0])} with cloudpickle 2\.2\.1 ",
                    text), text
    assert "only a cloudpickle of the same major version rebuilds" in text and "either" not in text


def test_skytasks_check_gives_the_starts_verdict(sshd):
    from skytasks.providers.checks import checks_for

    python = other_python("12")
    checks = [c for c in checks_for(ssh_pool(sshd, remote_python=python).spec()) if "remote_python" in c.name]
    assert len(checks) == 2 and all(c.passed is False for c in checks), checks
    for c in checks:
        assert c.detail.startswith(f"{CONTROLLER}; node "), c.detail
        assert f"runs Python {version_of(python)} with no cloudpickle" in c.detail
    passing = [c for c in checks_for(ssh_pool(sshd).spec()) if "remote_python" in c.name]
    assert [c.passed for c in passing] == [True, True], passing
    assert all(f"with cloudpickle {cloudpickle.__version__}" in c.detail for c in passing), passing


def test_a_slurm_node_with_another_python_fails_the_start_and_cancels_the_job(cluster):
    python = other_python("12")
    text = start_fails(GPUPool(provider="slurm", nodes=2, remote_python=python, ready_timeout_seconds=60))
    assert re.match(rf"remote_python: node \d \(n\d, job \d+\): {re.escape(CONTROLLER)}; node \d \(n\d, job \d+\) "
                    rf"runs Python {re.escape(version_of(python))} with no cloudpickle", text), text
    assert "only the same Python minor version reads" in text
    assert cluster.wait_queue_empty(timeout=30) == []  # the allocation was cancelled
