"""cloudpickle with out-of-band buffers (pickle protocol 5), for arguments and results, and a
pickler that keeps the user's file names and source lines in the functions it ships.

A numpy array (or anything else exposing PickleBuffer) is pickled as a small `meta` plus views
of its own memory: no copy on the way out, and the receiver builds the array straight on the
bytes that arrived. Used for large arguments (blobs) and for every return value.
"""

from __future__ import annotations

import io
import linecache
import marshal
import mmap
import os
import pickle
import types
from collections import ChainMap
from typing import Any

import cloudpickle

from skytasks.wire import SHARED_BYTES

Blob = tuple[bytes, list[memoryview]]


class SharedBuffer(mmap.mmap):
    """A large argument as a rank received it, in a memory file of its own (memfd). Each call
    maps it privately (`private_view`): copy-on-write, so the function may change its argument
    in place while the cached bytes stay as sent, and a function that only reads it copies
    nothing, where a copy per rank per call of a 500 MB argument costs seconds."""

    fd: int


def shared_buffer(size: int) -> SharedBuffer | None:
    """Memory for a received buffer of `size` bytes; None (an ordinary bytearray) when small
    or where memfd is missing."""
    if size < SHARED_BYTES:
        return None
    try:
        fd = os.memfd_create("skytasks-argument", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None
    try:
        os.ftruncate(fd, size)
        buf = SharedBuffer(fd, size)
    except OSError:
        os.close(fd)
        return None
    buf.fd = fd
    return buf


def mapped_buffer(fd: int, size: int) -> SharedBuffer:
    """A memory file the node's agent wrote and handed over (`node/relay.py`), mapped read-only:
    the node's ranks share its pages, and each call still maps it privately (`private_view`)."""
    buf = SharedBuffer(fd, size, prot=mmap.PROT_READ)
    buf.fd = fd
    return buf


def _shared(buf: Any) -> SharedBuffer | None:
    # pickle hands a buffer that was sent read-only back as a read-only memoryview of it
    base = buf.obj if isinstance(buf, memoryview) else buf
    return base if isinstance(base, SharedBuffer) else None


def private_view(buf: Any) -> Any:
    """A writable copy of a received buffer for one call: copy-on-write for a `SharedBuffer`."""
    shared = _shared(buf)
    if shared is not None:
        return mmap.mmap(shared.fd, len(shared), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return bytearray(buf)


def release(blob: Blob) -> None:
    """A cached blob is dropped: its memory files go (views a function still holds stay valid)."""
    for buf in blob[1]:
        shared = _shared(buf)
        if shared is not None:
            os.close(shared.fd)
            if isinstance(buf, memoryview):
                buf.release()
            try:
                shared.close()
            except BufferError:  # still viewed; unmapped when the last view goes
                pass


# Values that plain pickle writes exactly as cloudpickle would (no code, nothing by reference): a
# rank's result is most often one of these, and pickle's C writer skips building a cloudpickle
# Pickler for every rank of every call.
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes})


def dumps_out_of_band(value: Any) -> Blob:
    if type(value) in _PLAIN:
        return pickle.dumps(value, protocol=5), []
    buffers: list[pickle.PickleBuffer] = []
    meta = dumps(value, buffer_callback=buffers.append)
    return meta, [b.raw() for b in buffers]


def dumps(value: Any, buffer_callback: Any = None) -> bytes:
    """cloudpickle, except that code shipped by value keeps its file name and brings its source.

    cloudpickle 3.1 writes `co_filename = "<dynamic-code>"` into every function it ships by value
    (for deterministic payloads), so a rank's traceback, its faulthandler stack and the `was in`
    lines lost the user's file and line. Here a code object travels as marshal's bytes (the same
    bytecode, its own file name and line table intact) with the lines of its file as the caller's
    `linecache` has them: a file, a notebook cell IPython registered, or nothing for `exec` code
    ("<string>"), which Python itself shows without a source line too. The rank registers those
    lines, so `traceback` prints the source even where the file does not exist on the node."""
    out = io.BytesIO()
    _SourcePickler(out, protocol=5, buffer_callback=buffer_callback).dump(value)
    return out.getvalue()


def _reduce_code(code: types.CodeType) -> tuple[Any, tuple]:
    return _load_code, (marshal.dumps(code), code.co_filename, _source_lines(code.co_filename))


def _source_lines(filename: str) -> list[str] | None:
    lines = linecache.getlines(filename)
    return lines or None  # the same list object for every function of one file: pickled once


def _load_code(marshalled: bytes, filename: str, lines: list[str] | None) -> types.CodeType:
    """On the rank: the code object as the caller had it, and its source for tracebacks."""
    if lines:
        # mtime None: linecache.checkcache never drops it, and no file on the node replaces it.
        # Set on every call: a notebook user may have edited the module since the last one.
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return marshal.loads(marshalled)


class _SourcePickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def blob_size(blob: Blob) -> int:
    return len(blob[0]) + sum(m.nbytes for m in blob[1])


def snapshot(blob: Blob) -> Blob:
    """A copy that no later change to the original objects can reach."""
    return blob[0], [memoryview(bytes(m)) for m in blob[1]]


def same_blob(a: Blob, b: Blob) -> bool:
    """Byte equality, vectorised: memoryview's own == compares item by item (seconds for 500 MB)."""
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    import numpy as np

    for x, y in zip(a[1], b[1]):
        if x.nbytes != y.nbytes or not np.array_equal(np.frombuffer(x, np.uint8), np.frombuffer(y, np.uint8)):
            return False
    return True


def loads_out_of_band(blob: Blob, copy: bool) -> Any:
    """`copy` when the buffers must stay pristine (a cached argument the function may mutate)."""
    meta, buffers = blob
    return pickle.loads(meta, buffers=[private_view(b) if copy else b for b in buffers])
