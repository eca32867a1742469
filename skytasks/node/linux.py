"""The one Linux call a node's processes make through libc: prctl(2), for PDEATHSIG (a rank or a
template dies with its agent) and the agent's subreaper flag. Standard library only."""

from __future__ import annotations

import ctypes
from typing import Any

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36

_prctl: Any = None  # looked up once: a template's lookup is every forked rank's (0.2 ms each)


def prctl(option: int, value: int) -> bool:
    """libc's prctl(2); False where it failed or there is none (not Linux)."""
    global _prctl
    try:
        if _prctl is None:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        return _prctl(option, value) == 0
    except (OSError, AttributeError):
        return False
