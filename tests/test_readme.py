"""The README's first example runs exactly as written, as a user would run it.

Its first ```python block is written to a file in an empty directory and run there with this
environment's Python, so nothing but the installed package is importable (not the repository's
tests or flows). It uses the session's Prefect API instead of starting a server of its own.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def first_python_block(text: str) -> str:
    found = re.search(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert found, "the README has no ```python block"
    return found.group(1)


def test_the_readme_example_runs_as_written(tmp_path, prefect_api):
    from prefect.settings import PREFECT_API_URL

    code = first_python_block(README.read_text())
    assert 'if __name__ == "__main__":' in code, "the example must call its flow, not only define it"
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    env.pop("PYTHONPATH", None)  # the installed package only, as on a user's machine
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]

    results = [ast.literal_eval(line) for line in done.stdout.splitlines() if line.startswith("{'rank'")]
    assert [r["rank"] for r in results] == [0, 1], out[-4000:]
    for r in results:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["samples"] == 256, r
        assert abs(r["w"] - 3.0) < 0.05 and abs(r["b"] - 0.5) < 0.05, r  # DDP found the line
    assert "[rank 0] step 0: loss" in out  # the head's prints reach the log ...
    assert "[rank 1] step" not in out  # ... and @stdout(only="head") keeps rank 1's behind
