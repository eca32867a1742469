"""Output control per rank: `@stdout(only="head")`, `@stderr(only=...)`, `@silent`.

The wrapper runs on the rank itself and points the file descriptor at /dev/null for ranks that
are not selected, so suppressed output (C extensions' included) never leaves the rank.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Union

from skytasks.rank import RankInfo, rank_info

Selector = Union[str, int, Collection[int], Callable[[RankInfo], bool], None]


def _selected(only: Selector, info: RankInfo) -> bool:
    if only is None or only == "all":
        return True
    if only == "head":
        return info.is_head
    if only == "none":
        return False
    if isinstance(only, bool):
        raise TypeError("only=: give 'head', 'all', a rank, a collection of ranks or a predicate")
    if isinstance(only, int):
        return info.rank == only
    if callable(only):
        return bool(only(info))
    if isinstance(only, Collection) and not isinstance(only, str):
        return info.rank in only
    raise TypeError(f"only=: {only!r} is not 'head', 'all', a rank, a collection of ranks or a predicate")


@contextmanager
def _muted(fd: int, stream_name: str) -> Iterator[None]:
    # Both levels: the Python stream (print, tracebacks) and the file descriptor (C code).
    stream = getattr(sys, stream_name)
    stream.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    sink = open(os.devnull, "w")
    try:
        os.dup2(devnull, fd)
        setattr(sys, stream_name, sink)
        yield
    finally:
        setattr(sys, stream_name, stream)
        sink.close()
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


def _controls(stream_name: str, fd: int, only: Selector) -> Callable[[Callable], Callable]:
    if not callable(only):  # a bad selector fails at decoration, not on every rank later
        _selected(only, RankInfo(0, 1, 0, 1, 0, 1, "", 0, ("",), 0, 1))

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def on_rank(*args: Any, **kwargs: Any) -> Any:
            if _selected(only, rank_info()):
                return fn(*args, **kwargs)
            with _muted(fd, stream_name):
                return fn(*args, **kwargs)

        return on_rank

    return decorate


def stdout(fn: Callable | None = None, *, only: Selector = "head") -> Any:
    """Keep stdout only on the selected ranks (default: the head)."""
    deco = _controls("stdout", 1, only)
    return deco(fn) if fn is not None else deco


def stderr(fn: Callable | None = None, *, only: Selector = "head") -> Any:
    """Keep stderr only on the selected ranks (default: the head)."""
    deco = _controls("stderr", 2, only)
    return deco(fn) if fn is not None else deco


def silent(fn: Callable) -> Callable:
    """No stdout or stderr from any rank."""
    return stdout(stderr(fn, only="none"), only="none")
