"""A rank's traceback names the user's own file and line, with the source line, whatever
cloudpickle version the range in pyproject.toml gives: the lowest and the newest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests/programs/user_frames.py"
LOWEST = ROOT / ".venv/cloudpickle-lowest"  # installed by `make setup`


def run_user_script(extra_path: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if extra_path is not None:
        assert (extra_path / "cloudpickle").is_dir(), f"{extra_path} is missing: run `make setup`"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, str(PROGRAM)], cwd=PROGRAM.parent, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    sections = dict(re.findall(r"=== (\w+)\n(.*?)(?==== |cloudpickle )", out.stdout, re.S))
    sections["version"] = out.stdout.rsplit("cloudpickle ", 1)[1].strip()
    return sections


@pytest.mark.parametrize("which", ["newest", "lowest"])
def test_every_remote_frame_shows_the_callers_file_line_and_source(which):
    tb = run_user_script(LOWEST if which == "lowest" else None)
    assert tb["version"].startswith("3.0.") if which == "lowest" else tb["version"] >= "3.1"
    assert f'File "{PROGRAM}", line 20, in main_fails\n    return numbers[5]  # the line a person wants to see' \
        in tb["main_fails"]
    helper = PROGRAM.parent / "user_frames_helper.py"
    assert f'File "{helper}", line 6, in helper_fails\n    return config["epochs"]  # the helper\'s own line' \
        in tb["helper_fails"]
    # A cell's source exists only in the caller's linecache: the rank shows it all the same.
    assert 'File "/tmp/ipykernel_4242/3153214815.py", line 3, in cell_fails\n' \
           "    return x['missing']  # from a cell" in tb["cell_fails"]
    # exec'd code has no source anywhere: shown as Python shows it, with no line under it.
    assert re.search(r'File "<string>", line 2, in exec_fails\nZeroDivisionError', tb["exec_fails"])
    assert "<dynamic-code>" not in "".join(tb.values())
