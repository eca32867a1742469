"""Code nobody wrote for skytasks: pytorch/examples' FSDP2 example (tests/programs/fsdp2_example,
copied verbatim) through `skytasks run`, as torchrun would launch it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent / "programs" / "fsdp2_example"


def test_pytorchs_fsdp2_example_runs_unchanged_through_skytasks_run(tmp_path):
    from prefect.settings import PREFECT_API_URL

    for name in ("example.py", "model.py", "checkpoint.py", "utils.py"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = subprocess.run([sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", "--procs-per-node", "1",
                           "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    if torch.cuda.device_count() >= 2:  # each node has the 2 accelerators it asks for: it trains and saves
        assert (tmp_path / "checkpoints").is_dir(), out[-3000:]
    else:  # its own check for 2 accelerators ends it on every rank, cleanly (a CPU pool)
        assert out.count("Unable to locate sufficient 2 gpus to run this example. Exiting.") == 2, out[-3000:]
