"""The plain path: a state dict of plain tensors, saved by the head as one file, loaded by every rank.

A checkpoint is one object named by its step, `step-000000000042.pt`, holding what `torch.save`
wrote (atomically: a directory's temporary name renamed into place, or one S3 object). Loading is
weights-only unless `trusted`, and inside a process group the head sends the other ranks the file's
bytes as tensors, never a pickle, so each rank's own weights-only load decides.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

from skytasks.errors import CheckpointError

NAME = re.compile(r"^step-(\d{12})\.pt$")
_CHUNK = 64 << 20  # bytes per broadcast: what a rank holds at once beyond the checkpoint itself
_NONE, _HEAD_FAILED = -1, -2  # the header's step when the head has no checkpoint, or could not read it


def name(step: int) -> str:
    return f"step-{step:012d}.pt"


def load(data: bytes | bytearray, where: str, trusted: bool, map_location: Any) -> Any:
    """torch.load of a plain checkpoint's bytes, weights-only unless `trusted`."""
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        if trusted or "Weights only load failed" not in str(exc):
            raise
        what = what_it_met(str(exc))
        raise CheckpointError(
            f"checkpoint {where} holds {what}, which loading would have to run code to build: "
            f"Checkpointer loads tensors, numbers, strings and their containers only (a model's and an "
            f"optimizer's state dicts). Checkpointer(..., trusted=True) unpickles it fully, running "
            f"whatever code it names: only for checkpoints you wrote yourself.", what, where) from None


def warn_if_refused(buf: io.BytesIO, step: int) -> None:
    import warnings

    from torch import serialization

    unsafe_globals = getattr(serialization, "get_unsafe_globals_in_checkpoint", None)  # torch 2.6 on
    if unsafe_globals is None:
        return
    buf.seek(0)
    unsafe = unsafe_globals(buf)
    if unsafe:
        warnings.warn(f"Checkpointer.save: step {step} holds {', '.join(unsafe)}, which load_latest() will refuse "
                      f"(CheckpointError): save tensors, numbers, strings and their containers, or use "
                      f"Checkpointer(..., trusted=True) for checkpoints only you can write", stacklevel=3)


def what_it_met(torch_message: str) -> str:
    """What torch's weights-only unpickler refused, from its error's text: the global it met
    ("GLOBAL posix.system ..."), else its own words ("Unsupported operand 149")."""
    named = re.search(r"GLOBAL ([\w.]+)", torch_message)
    if named:
        return named.group(1)
    said = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", torch_message)
    return said.group(1).strip() if said else "an object that weights-only loading does not accept"


def broadcast_newest(head: Any) -> tuple[int, bytes | bytearray] | None:
    """The head's newest `(step, file bytes)` on every rank, as tensors: a header (step, length),
    then the bytes in chunks. Plain bytes, never a pickle: each rank's own weights-only load
    judges them. `head` is the head's Checkpointer, None on the other ranks."""
    import torch
    import torch.distributed as dist

    # CPU tensors where the group has a CPU backend (gloo, or "cpu:gloo,cuda:nccl"); NCCL alone needs CUDA ones.
    cpu_capable = torch.device("cpu") in getattr(dist.group.WORLD, "_device_types", [torch.device("cpu")])
    device = torch.device("cpu") if cpu_capable else torch.device("cuda", torch.cuda.current_device())
    data: bytes | bytearray = b""
    step, failure = _NONE, None
    if head is not None:
        try:
            steps = head.steps()
            if steps:
                step, data = steps[-1], head._store.get(name(steps[-1]))
        except Exception as exc:  # noqa: BLE001 - said to the other ranks, then raised here
            step, failure = _HEAD_FAILED, exc
    header = torch.tensor([step, len(data)], dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    if failure is not None:
        raise failure
    step, size = (int(v) for v in header.tolist())
    if step == _HEAD_FAILED:
        raise RuntimeError("Checkpointer.load_latest: the head could not read the newest checkpoint (its error is "
                           "rank 0's)")
    if step == _NONE:
        return None
    received = bytearray(size) if head is None else data
    view = memoryview(received)
    for start in range(0, size, _CHUNK):
        n = min(_CHUNK, size - start)
        if head is not None:
            chunk = torch.frombuffer(bytearray(view[start:start + n]), dtype=torch.uint8).to(device)
        else:
            chunk = torch.empty(n, dtype=torch.uint8, device=device)
        dist.broadcast(chunk, src=0)
        if head is None:
            torch.frombuffer(view[start:start + n], dtype=torch.uint8).copy_(chunk)
    return step, received


def is_head() -> bool:
    from skytasks.rank import in_rank, rank_info

    return not in_rank() or rank_info().is_head


def process_group_world() -> int | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size()
    return None
