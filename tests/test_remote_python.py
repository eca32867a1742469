"""The check of a node's Python that every remote provider (ssh, aws, slurm) runs first, as the
agent starts: here against real interpreters on this machine. Against real nodes, each provider's
own tests (test_ssh_provider, test_aws_provider, test_slurm_provider) show the PoolStartError."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skytasks.providers import agent_args
from skytasks.providers.remote import python_check

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"  # the system's own Python: no torch, no cloudpickle


def check(python: str, env: dict | None = None) -> bytes:
    done = subprocess.run([python, "-c", python_check.CHECK + "import sys\nsys.exit(0 if _python_ok() else 3)"],
                          capture_output=True, env=env, timeout=60)
    return done.stdout


def test_the_check_names_each_module_the_python_lacks_in_pythons_own_words():
    if subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has torch here")
    found = python_check.parse(check(SYSTEM_PYTHON))
    assert found is not None and found.executable == SYSTEM_PYTHON
    assert found.missing["torch"] == "ModuleNotFoundError: No module named 'torch'"
    text = python_check.cannot_import("node 1 (10.0.0.7)", "python3", found, "the default: python3 on the PATH")
    assert text.startswith("remote_python: node 1 (10.0.0.7): remote_python unset, so 'python3'")
    assert f"ran {SYSTEM_PYTHON} (Python {found.version})" in text and "No module named 'torch'" in text


def test_a_python_with_torch_and_cloudpickle_passes():
    import cloudpickle

    found = python_check.parse(check(sys.executable))
    assert found is not None and found.missing == {} and found.executable == sys.executable
    assert found.python == tuple(sys.version_info[:3]) and found.cloudpickle == cloudpickle.__version__
    assert python_check.wrong_python("node 0 (h)", sys.executable, found) is None


def test_modules_are_looked_up_not_imported_and_a_failed_lookup_is_said_in_its_own_words(tmp_path):
    # Found, so passed: the check reads no module (importing torch takes a second or more), and
    # cloudpickle's version comes from its metadata, as an installed one has it.
    (tmp_path / "torch.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "cloudpickle.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "cloudpickle-3.1.0.dist-info").mkdir()
    (tmp_path / "cloudpickle-3.1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cloudpickle\nVersion: 3.1.0\n")
    found = python_check.parse(check(SYSTEM_PYTHON, env={**os.environ, "PYTHONPATH": str(tmp_path)}))
    assert found is not None and found.missing == {} and found.cloudpickle == "3.1.0"
    # A lookup that raises (a half-imported torch, left without its spec) is said as it was raised.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, types\nm = types.ModuleType('torch')\nm.__spec__ = None\nsys.modules['torch'] = m\n")
    found = python_check.parse(check(SYSTEM_PYTHON, env={**os.environ, "PYTHONPATH": str(tmp_path)}))
    assert found is not None and found.missing == {"torch": "ValueError: torch.__spec__ is None"}


def test_a_line_that_is_not_the_checks_is_not_taken_for_it():
    assert python_check.parse(b"") is None
    assert python_check.parse(b"Welcome to the cluster!\n") is None
    assert python_check.parse(python_check.MARK.encode() + b"{not json\n") is None


def test_the_agent_starts_behind_the_check_in_the_same_process_and_says_hello():
    from skytasks.protocol import Op
    from skytasks.wire import read_frame

    started = time.perf_counter()
    agent = subprocess.Popen([sys.executable, "-c", python_check.AGENT_START, *agent_args()], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        found = python_check.parse(agent.stdout.readline())
        assert found is not None and found.missing == {}
        hello = read_frame(agent.stdout)
        assert hello["op"] == Op.HELLO and hello["pid"] == agent.pid  # no second interpreter
        assert time.perf_counter() - started < 30
    finally:
        agent.stdin.close()
        agent.wait(timeout=20)


def test_the_agent_does_not_start_behind_a_failed_check():
    if subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has torch here")
    done = subprocess.run([SYSTEM_PYTHON, "-c", python_check.AGENT_START, *agent_args()], cwd=ROOT,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    found = python_check.parse(done.stdout)
    assert done.returncode == 3 and found is not None and set(found.missing) == {"torch", "cloudpickle"}
    assert done.stdout.count(b"\n") == 1  # the check's line, and nothing of an agent
