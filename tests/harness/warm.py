"""What the warm pool tests share: the environment a controller process of their own runs in
(this session's Prefect API), and `skytasks pools down` for a saved pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def api_env() -> dict[str, str]:
    """This process's environment with the session's Prefect API: where a controller process
    started by a test finds the pools the test saved."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


def pools_down(name: str) -> None:
    """`skytasks pools down NAME`: whatever is left of the saved pool ends (nothing left is fine)."""
    subprocess.run([sys.executable, "-m", "skytasks.cli", "pools", "down", name], env=api_env(), cwd=ROOT,
                   capture_output=True, timeout=180)
