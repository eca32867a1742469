"""The package as a user installs it: the wheel built from this checkout, in a venv of its own, used
from a folder where the repository is not on the path.

The venv reuses the dependencies the suite's own venv already has (a path entry after its own
site-packages, whose .pth files, the editable install's among them, are never read), so the test
costs seconds while the wheel is installed as pip installs it: `skytasks` can only come from it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The sdist, and the wheel built from that sdist (as `python -m build` does): a file the sdist
    leaves out is missing from the wheel too. Nothing is built inside the checkout."""
    out = tmp_path_factory.mktemp("dist")
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([str(uv), "build", "--no-build-isolation", "-q", "-o", str(out), "--python", sys.executable,
                    str(REPO)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def wheel(built: Path) -> Path:
    (found,) = built.glob("skytasks-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory) -> Path:
    """A venv holding the wheel; its bin/ folder."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv / "bin"


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HOME"] = str(home)
    return env


def test_the_wheel_holds_every_package(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    folders = {os.path.dirname(n) for n in names if n.endswith("/__init__.py")}
    on_disk = {str(p.parent.relative_to(REPO)) for p in (REPO / "skytasks").rglob("__init__.py")}
    assert on_disk <= folders, f"packages missing from the wheel: {sorted(on_disk - folders)}"
    assert "skytasks/blocks" in folders and not any(n.startswith("blocks/") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/", "flows/")) for n in names)


def test_the_sdist_holds_the_sources(built: Path):
    (sdist,) = built.glob("skytasks-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    on_disk = {str(p.relative_to(REPO)) for p in [*(REPO / "skytasks").rglob("*.py"), *(REPO / "blocks").glob("*.py")]}
    assert on_disk <= names, f"sources missing from the sdist: {sorted(on_disk - names)}"


def test_a_two_node_call_from_the_installed_wheel(installed: Path, tmp_path: Path):
    program = tmp_path / "two_nodes.py"
    program.write_text(textwrap.dedent("""
        import skytasks
        from skytasks import GPUPool, distributed_task, rank_info

        @distributed_task(pool=GPUPool(provider="local", nodes=2))
        def where():
            import torch.distributed as dist
            info = rank_info()
            return (info.rank, dist.get_world_size(), skytasks.__file__)

        print(where())
    """))
    done = subprocess.run([str(installed / "python"), str(program)], cwd=tmp_path, env=_clean_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = eval(done.stdout.strip().splitlines()[-1])
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    assert all(r[2].startswith(str(installed.parent)) for r in results), results


def test_a_large_argument_goes_down_the_relay_tree_from_the_installed_wheel(installed: Path, tmp_path: Path):
    """Three nodes and a 4 MB argument: node to node over TLS (the pool's key made with the
    wheel's own dependencies), leaving the controller once."""
    program = tmp_path / "relay.py"
    program.write_text(textwrap.dedent("""
        import hashlib, os
        from skytasks import GPUPool, distributed_task
        from skytasks.controller.channel import bytes_sent

        def digest(blob):
            return hashlib.sha256(blob).hexdigest()

        blob = os.urandom(4 << 20)
        with GPUPool(provider="local", nodes=3) as pool:
            task = distributed_task(digest, pool=pool, init_torch=False)
            task(b"")
            before = bytes_sent()
            out = task(blob)
            print(repr((out == [hashlib.sha256(blob).hexdigest()] * 3, (bytes_sent() - before) / len(blob))))
    """))
    done = subprocess.run([str(installed / "python"), str(program)], cwd=tmp_path, env=_clean_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    same, sent_per_byte = eval(done.stdout.strip().splitlines()[-1])
    assert same
    assert 1.0 <= sent_per_byte < 1.5, sent_per_byte  # once, not once per node


def test_the_command_line_and_the_block_from_the_installed_wheel(installed: Path, tmp_path: Path):
    helped = subprocess.run([str(installed / "skytasks"), "--help"], cwd=tmp_path, env=_clean_env(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "run" in helped.stdout and "gc" in helped.stdout

    from prefect.settings import PREFECT_API_URL

    env = {**_clean_env(tmp_path), "PREFECT_API_URL": PREFECT_API_URL.value()}  # the session's server (conftest)
    registered = subprocess.run([str(installed / "python"), "-m", "prefect", "block", "register", "-m", "skytasks.blocks"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert registered.returncode == 0, registered.stdout[-2000:] + registered.stderr[-2000:]
    assert "registered 1 block" in registered.stdout and "GPU Pool" in registered.stdout, registered.stdout
