"""Whether a node's Python can run ranks, asked as its agent starts: before any rank does.

The agent itself needs only the standard library, so a node whose `remote_python` lacks torch or
cloudpickle would otherwise start, say HELLO, and fail the first call inside each rank with a
ModuleNotFoundError that names neither the field nor the Python. The few lines of `CHECK` run
first in the agent's own process, with its own environment (PYTHONPATH, pip_packages): they look
the modules up (`importlib.util.find_spec`, which reads no module: well under a millisecond where
they are found, against a second or more to import torch) and write one line on the stream, the
`MARK` and what they found. The provider reads that line before anything else and turns a lack
into `PoolStartError` naming `remote_python` (`cannot_import`).

The line also says which Python it is and which cloudpickle it holds: a user's function travels as
cloudpickle's pickle of its bytecode, which only the same Python minor version reads, and only a
cloudpickle of the same major version rebuilds. `mismatch` compares them with the controller's, on
the controller, before the package is sent and before any rank: a 3.12 node against a 3.11
controller would otherwise start and fail only at the first call, a 3.10 one at the agent's import.
Since a wrong Python is the thing to fix (torch and cloudpickle are installed into it), the
version's verdict comes before the missing modules'. The check's lines must run, and say the
version, on any Python 3.6 or later: no f-string, walrus or other late syntax in them.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field

MARK = "skytasks-python "
NEEDED = ("torch", "cloudpickle")
# The agent's floor, pyproject.toml's requires-python (tests/test_node_python_versions.py reads it).
MIN_PYTHON = (3, 11)
# pyproject.toml's "cloudpickle>=3.0". A function is rebuilt on the node by calling cloudpickle's own
# reconstructors by their module path (cloudpickle.cloudpickle._function_setstate, ...), and a
# rank's result comes back the same way: a 2.x node cannot load a 3.x pickle (AttributeError on
# those names). Within a major version cloudpickle keeps the old names loadable (3.0 kept a
# cloudpickle_fast shim for 2.x pickles), and tests/test_user_frames.py runs the lowest 3.x
# against the newest. So: the controller's major version, and at least the floor.
CLOUDPICKLE_FLOOR = (3, 0)

# Stdlib only, first on the node, and any Python 3.6+ must get through it (3.6 is what old images
# hold): it defines `_python_ok()`: True, or False after the line said what is wrong (the caller
# then exits) -- a missing module, or a Python other than the controller's major.minor, which
# could not even import the agent. The controller's `mismatch` decides what that line means.
# cloudpickle's version is read from its metadata (no import); only where that is missing (a
# vendored copy, a Python before 3.8) from the module itself, whose failure is then said.
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
    pickler = None
    if "cloudpickle" not in said:
        try:
            from importlib.metadata import version
            pickler = version("cloudpickle")
        except Exception:
            try:
                import cloudpickle
                pickler = str(cloudpickle.__version__)
            except Exception as exc:
                said["cloudpickle"] = "%%s: %%s" %% (type(exc).__name__, exc)
    line = json.dumps({"executable": sys.executable, "version": sys.version.split()[0],
                       "python": list(sys.version_info[:3]), "cloudpickle": pickler, "missing": said})
    os.write(1, (%(mark)r + line + "\n").encode())
    return not said and tuple(sys.version_info[:2]) == %(want)r
""" % {"needed": NEEDED, "mark": MARK, "want": tuple(sys.version_info[:2])}

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
    version: str  # as the Python writes it, "3.12.1"
    missing: dict[str, str] = field(default_factory=dict)  # module -> what importing it says
    python: tuple[int, ...] = ()  # sys.version_info[:3]
    cloudpickle: str | None = None  # its version; None where it has none


@dataclass(frozen=True)
class Controller:
    """The controller's side of the comparison: the Python and cloudpickle that pickle the code."""

    version: str
    python: tuple[int, ...]
    cloudpickle: str


def this_controller() -> Controller:
    import cloudpickle

    return Controller(sys.version.split()[0], tuple(sys.version_info[:3]), str(cloudpickle.__version__))


def parse(line: bytes) -> Found | None:
    """The check's line, or None when the line is not one (the Python never got to the check)."""
    text = line.decode(errors="replace")
    if not text.startswith(MARK):
        return None
    try:
        said = json.loads(text[len(MARK):])
        pickler = said["cloudpickle"]
        return Found(str(said["executable"]), str(said["version"]), dict(said["missing"]),
                     tuple(int(n) for n in said["python"]), None if pickler is None else str(pickler))
    except (ValueError, KeyError, TypeError):
        return None


def release(version: str) -> tuple[int, ...]:
    """A version's leading numbers: "3.1.0rc1" -> (3, 1, 0)."""
    head = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(n) for n in head.group().split(".")) if head else ()


def cloudpickle_fits(node: str, controller: str) -> bool:
    """Whether a node's cloudpickle rebuilds what the controller's pickles (and the reverse): the
    same major version, and at least the floor (CLOUDPICKLE_FLOOR says why)."""
    have, want = release(node), release(controller)
    return bool(have) and have[:1] == want[:1] and (have + (0,))[:2] >= CLOUDPICKLE_FLOOR


def why_not(found: Found, here: Controller) -> list[str]:
    """Why code pickled by `here` cannot run on the node's Python (empty: it can)."""
    why = []
    if found.python[:2] != here.python[:2]:
        why.append("code travels as bytecode, which only the same Python minor version reads")
        if found.python[:2] < MIN_PYTHON:
            why.append("the node agent needs Python %d.%d or later" % MIN_PYTHON)
    if found.cloudpickle is not None and not cloudpickle_fits(found.cloudpickle, here.cloudpickle):
        why.append("a function and its result travel as cloudpickle's pickles, which only a cloudpickle of the "
                   "same major version rebuilds (skytasks needs cloudpickle>=%d.%d)" % CLOUDPICKLE_FLOOR)
    return why


def _runs(version: str, cloudpickle: str | None) -> str:
    return f"Python {version} with " + (f"cloudpickle {cloudpickle}" if cloudpickle else "no cloudpickle")


def mismatch(field_name: str, where: str, found: Found, ran_as: str, fix: str, here: Controller) -> str | None:
    """The start's error for a node whose Python or cloudpickle is not the controller's, naming
    the field the user fixes and both sides' versions; None where they fit."""
    why = why_not(found, here)
    if not why:
        return None
    also = f" (it cannot import {', '.join(found.missing)} either)" if found.missing else ""
    return (f"{field_name}: {where}: the controller runs {_runs(here.version, here.cloudpickle)}; {where} runs "
            f"{_runs(found.version, found.cloudpickle)} ({ran_as} ran {found.executable}): "
            f"{'; and '.join(why)}{also}. {fix}; no rank was started")


def _fix(here: Controller, found: Found, on_node: str) -> tuple[str, str]:
    """What to install where only cloudpickle is wrong ("" otherwise), and the Python the node needs."""
    major = release(here.cloudpickle)[0]
    python = f"Python {here.python[0]}.{here.python[1]}{on_node} with torch and cloudpickle {major}.x"
    if found.python[:2] != here.python[:2]:
        return "", python
    return f"cloudpickle {major}.x (pip install 'cloudpickle>={major}.0,<{major + 1}')", python


def wrong_python(where: str, command: str, found: Found, default_because: str | None = None,
                 here: Controller | None = None) -> str | None:
    """ssh, aws and slurm nodes: the error naming remote_python, or None where the node fits."""
    here = here or this_controller()
    install, python = _fix(here, found, " on the nodes")
    fix = f"Set remote_python to a {python}"
    if install:
        fix = f"Install {install} into that Python, or set remote_python to a {python}"
    return mismatch("remote_python", where, found, ran(command, default_because), fix, here)


def wrong_image(where: str, image: str | None, command: str, found: Found,
                here: Controller | None = None) -> str | None:
    """A pod: the error naming k8s_image (the Python inside it; `image` None where it could not be
    read), and remote_python where that is set (`command` other than the default python3), or None
    where the pod fits."""
    here = here or this_controller()
    ran_as = ("k8s_image" + (f"={image!r}" if image else "")
              + ("" if command == "python3" else f" with remote_python={command!r}"))
    install, python = _fix(here, found, "")
    fix = (f"Use an image whose Python has {install}" if install else f"Use an image with {python} (the docs "
           f"name images that work)") + ", or set remote_python to such a Python in the image"
    return mismatch("k8s_image", where, found, ran_as, fix, here)


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
