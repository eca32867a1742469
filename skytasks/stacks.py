"""Rank stacks: what faulthandler wrote, and the one line a person wants from it.

A rank dumps every thread's stack, innermost frame first, when its agent sends SIGUSR1, and as the
SIGTERM that stops it arrives (it works while the rank is blocked inside a C++ collective). The
controller gets them with the stop when fail-fast stops the ranks that did not fail or a hang stops
them all, asks for them for the straggler warning, and names where each rank was: the innermost
frame of the thread running the user's function, and the user's own frame that led there.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Iterable

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_LIBRARY_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep,
                    os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep)
_SKYTASKS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _threads(stack: str) -> list[list[tuple[str, int, str]]]:
    threads: list[list[tuple[str, int, str]]] = []
    for line in stack.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif (m := _FRAME.match(line)) and threads:
            threads[-1].append((m["file"], int(m["line"]), m["func"]))
    return threads


def _is_library(path: str) -> bool:
    """Python's own modules and installed packages (`<frozen os>` included)."""
    return any(marker in path for marker in _LIBRARY_MARKERS) or path.startswith("<")


def _is_user_file(path: str) -> bool:
    return not (_is_library(path) or path.startswith(_SKYTASKS_DIR) or "/skytasks/" in path.replace(os.sep, "/"))


def _in(thread: list[tuple[str, int, str]], file: str, func: str) -> bool:
    return any(f.endswith(file) and fn == func for f, _, fn in thread)


def where(stack: str) -> str:
    """'in `barrier` (distributed_c10d.py:4807), called from train.py:42 in `train`', or ''.
    A rank the call had not reached yet: 'waiting for the call', or 'starting up, in ...' (the
    step of its start-up it was in)."""
    threads = _threads(stack)
    # The thread that runs the user's call: the one whose stack passes through skytasks.node.worker.
    main = next((t for t in threads if _in(t, "worker.py", "_run_call")), None)
    if main is None and threads:
        # No call running: the rank's main thread says why (faulthandler lists the threads newest
        # first, so the main thread is last; the first is a helper, such as the control channel's).
        main = next((t for t in threads if _in(t, "worker.py", "main")), threads[-1])
        if _in(main, "worker.py", "main") and _in(main, "wire.py", "read_frame"):
            return "waiting for the call"
        if _in(main, "worker.py", "main") or _in(main, "rank_template.py", "_become_rank"):
            # The start-up step it is in, not the library frame under it: ranks caught inside
            # `Thread.start` or `os.fdopen` of the same step share one line.
            file, line, func = next((fr for fr in main if not _is_library(fr[0])), main[0])
            return f"starting up, in `{func}` ({os.path.basename(file)}:{line})"
    if not main:
        return ""
    file, line, func = main[0]
    text = f"in `{func}` ({os.path.basename(file)}:{line})"
    user = next(((f, ln, fn) for f, ln, fn in main if _is_user_file(f)), None)
    if user is not None and user != main[0]:
        text += f", called from {os.path.basename(user[0])}:{user[1]} in `{user[2]}`"
    return text


def user_frame(stack: str) -> str:
    """The innermost frame of the user's own code, as `file:line in func`, or ''."""
    for thread in _threads(stack):
        if _in(thread, "worker.py", "_run_call"):
            for f, ln, fn in thread:
                if _is_user_file(f):
                    return f"{os.path.basename(f)}:{ln} in {fn}"
    return ""


def rank_ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
