"""Whether a node's Python can run ranks, asked as its agent starts: before any rank does.

The agent itself needs only the standard library, so a node whose `remote_python` lacks torch or
cloudpickle would otherwise start, say HELLO, and fail the first call inside each rank with a
ModuleNotFoundError that names neither the field nor the Python. The few lines of `CHECK` run
first in the agent's own process, with its own environment (PYTHONPATH, pip_packages): they look
the modules up (`importlib.util.find_spec`, which reads no module: well under a millisecond where
they are found, against a second or more to import torch) and write one line on the stream, the
`MARK` and what they found. The provider reads that line before anything else and turns a lack
into `PoolStartError` naming `remote_python` (`cannot_import`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MARK = "skytasks-python "
NEEDED = ("torch", "cloudpickle")

# Stdlib only, and first on the node. It defines `_python_ok()`: True, or False after the line
# said what is missing (the caller then exits).
CHECK = r"""
def _python_ok():
    import importlib.util, json, os, sys
    said = {}
    for name in %(needed)r:
        try:
            if importlib.util.find_spec(name) is None:
                said[name] = "ModuleNotFoundError: No module named %%r" %% name
        except Exception as exc:  # a broken install: its own words
            said[name] = "%%s: %%s" %% (type(exc).__name__, exc)
    line = json.dumps({"executable": sys.executable, "version": sys.version.split()[0], "missing": said})
    os.write(1, (%(mark)r + line + "\n").encode())
    return not said
""" % {"needed": NEEDED, "mark": MARK}

# An SSH node's agent: `python -c AGENT_START -m skytasks.node.agent ARGS...` runs the check, then
# the agent in this same process, as `python -m` would (no second interpreter to start).
AGENT_START = CHECK + r"""
import os, sys
if not _python_ok():
    sys.exit(3)
sys.path[0] = os.getcwd()  # `python -m` puts the directory it started in first
from skytasks.node.agent import main
main(sys.argv[3:])
"""

# `skytasks check`: the check alone, in a Python of its own that ends at once (no agent after it).
PROBE = CHECK + r"""
import sys
sys.exit(0 if _python_ok() else 3)
"""


@dataclass(frozen=True)
class Found:
    """What a node's Python said of itself."""

    executable: str
    version: str
    missing: dict[str, str] = field(default_factory=dict)  # module -> what importing it says


def parse(line: bytes) -> Found | None:
    """The check's line, or None when the line is not one (the Python never got to the check)."""
    text = line.decode(errors="replace")
    if not text.startswith(MARK):
        return None
    try:
        said = json.loads(text[len(MARK):])
        return Found(str(said["executable"]), str(said["version"]), dict(said["missing"]))
    except (ValueError, KeyError, TypeError):
        return None


def ran(command: str, default_because: str | None) -> str:
    """The Python as the user can find it in the pool's fields."""
    if default_because is None:
        return f"remote_python={command!r}"
    return f"remote_python unset, so {command!r} ({default_because})"


def cannot_import(where: str, command: str, found: Found, default_because: str | None = None) -> str:
    names = ", ".join(found.missing)
    return (f"remote_python: {where}: {ran(command, default_because)} ran {found.executable} (Python "
            f"{found.version}), which cannot import {names}: {'; '.join(found.missing.values())}. Every node's "
            f"Python needs torch and cloudpickle: set remote_python to one that has them (a venv's bin/python, "
            f"say), or install them into it; no rank was started")


def did_not_start(where: str, command: str, said: str, default_because: str | None = None) -> str:
    said = said.strip()[-1500:] or "nothing"
    return (f"remote_python: {where}: {ran(command, default_because)} did not start the node agent; it said: "
            f"{said}. Set remote_python to a Python on the nodes that has torch and cloudpickle")
