"""A call's payload: the function and its arguments, cloudpickled once on the controller.

The user's own modules travel by value; libraries never do. Large arguments travel as blobs of
their own, so a warm rank group that still holds the same bytes is not sent them again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import cloudpickle

from skytasks.controller.project_modules import project_modules
from skytasks.serialization import Blob, blob_size, dumps, dumps_out_of_band
from skytasks.wire import BlobRef


# Top-level arguments whose pickle is at least this large travel as blobs of their own: once per
# node, and not again while a warm rank group still holds the same bytes (see RankGroup.call_message).
BLOB_BYTES = 1 << 20


@dataclass(frozen=True)
class PackedCall:
    head: bytes  # cloudpickle of (fn, args, kwargs), large arguments replaced by BlobRef(i)
    blobs: list[Blob]  # blobs[i]: one large argument, pickled with out-of-band buffers


# cloudpickle's by-value registration is process-wide: two calls packed at once in two threads
# (`.submit()`, async flows) would unregister each other's modules half-way.
_PICKLE_LOCK = threading.Lock()


def pack_call(fn: Callable, args: tuple, kwargs: dict) -> PackedCall:
    """cloudpickle the call, or say exactly which part cannot travel, before any rank starts."""
    with _PICKLE_LOCK:
        return _pack(fn, args, kwargs)


def _pack(fn: Callable, args: tuple, kwargs: dict) -> PackedCall:
    registered = []
    for module in project_modules():
        try:
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
        except ValueError:
            pass
    try:
        blobs: list[Blob] = []
        args = tuple(_as_blob(a, blobs) for a in args)
        kwargs = {k: _as_blob(v, blobs) for k, v in kwargs.items()}
        return PackedCall(_dumps_or_explain(fn, args, kwargs), blobs)
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def _as_blob(value: Any, blobs: list[Blob]) -> Any:
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    try:
        blob = dumps_out_of_band(value)
    except Exception:  # noqa: BLE001 - left in place; _dumps_or_explain names it
        return value
    if blob_size(blob) < BLOB_BYTES:
        return value
    blobs.append(blob)
    return BlobRef(len(blobs) - 1)


def _dumps_or_explain(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return dumps((fn, args, kwargs))
    except Exception as whole:  # noqa: BLE001 - find the culprit for the message
        parts: list[tuple[str, Any]] = [(f"the function {getattr(fn, '__qualname__', fn)!r}", fn)]
        parts += [(f"positional argument {i}", a) for i, a in enumerate(args)]
        parts += [(f"argument {k!r}", v) for k, v in kwargs.items()]
        for what, obj in parts:
            try:
                dumps(obj)
            except Exception as exc:  # noqa: BLE001
                raise TypeError(
                    f"cannot send {what} (a {type(obj).__qualname__}) to the ranks: it cannot be "
                    f"pickled with cloudpickle: {exc}"
                ) from exc
        raise TypeError(f"cannot pickle the call to send it to the ranks: {whole}") from whole
