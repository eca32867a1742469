"""`Checkpointer(path, keep=3, trusted=False)`: save on the head, resume on every rank, never a
half-written file, and never code run by loading one.

`path` is a directory or `s3://bucket/prefix`. A checkpoint is one object named by its step,
`step-000000000042.pt`, holding what `torch.save` wrote:
- in a directory it is written under a temporary name, flushed to disk, then renamed into place,
  so a save killed mid-write leaves only a temporary file, which is never read;
- on S3 it is one PutObject (S3 shows an object whole or not at all), with boto3's default
  credential chain: the node's instance profile, or the environment a pool gives its ranks.

The resume pattern, with `retries=` on the task: on attempt 1 nothing is found and training starts
at step 0; on a later attempt every rank gets the newest checkpoint and goes on from the step after.

    ckpt = Checkpointer("s3://my-bucket/runs/gpt", keep=3)
    found = ckpt.load_latest()
    start = 0 if found is None else found[0] + 1
    if found: model.load_state_dict(found[1]["model"])
    for step in range(start, steps):
        ...
        ckpt.save({"model": model.state_dict()}, step)
        ckpt.save_if_preempted({"model": model.state_dict()}, step)  # a spot or SLURM notice: save, end

A checkpoint holds what the user gives it: a model's `state_dict` is the same for any world size,
so an attempt with fewer ranks (an elastic pool that lost a node) resumes from it as well.

A checkpoint runs no code: whoever can write the store (a shared bucket, a shared file system)
must not be able to run code in every rank. `load_latest` reads with torch's weights-only
unpickler (tensors, numbers, strings and their containers: a model's and an optimizer's state
dicts), and the head sends the other ranks the file's bytes as tensors, never a pickle, so each
rank's own weights-only load decides. A checkpoint holding anything else raises `CheckpointError`;
`trusted=True` unpickles fully, for checkpoints one wrote oneself. Directories made here are 0700
and files 0600: weights on shared storage are their owner's alone.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

from skytasks.checkpoint_stores import DirectoryStore, S3Store, Store
from skytasks.errors import CheckpointError

_NAME = re.compile(r"^step-(\d{12})\.pt$")
_CHUNK = 64 << 20  # bytes per broadcast: what a rank holds at once beyond the checkpoint itself
_NONE, _HEAD_FAILED = -1, -2  # the header's step when the head has no checkpoint, or could not read it


def _name(step: int) -> str:
    return f"step-{step:012d}.pt"


class Checkpointer:
    """Checkpoints of a training loop, for retries, node recoveries and preemptions to resume from.

    `path` is a directory (on the head's node, or shared storage) or `s3://bucket/prefix`.
    `save(state, step)` writes on the head only, atomically, keeping the newest `keep`;
    `load_latest()` gives every rank the newest `(step, state)`, or None;
    `save_if_preempted(state, step)` saves and ends the attempt once a preemption notice came.
    `trusted=False` (the default) loads tensors, numbers, strings and their containers only, and
    raises `CheckpointError` on anything else; `trusted=True` unpickles fully (it runs whatever
    code the file names), for checkpoints you wrote yourself.

        ckpt = Checkpointer("/data/ckpt")
        found = ckpt.load_latest()
        start = 0 if found is None else found[0] + 1
        for step in range(start, steps):
            ...
            ckpt.save({"model": model.state_dict()}, step)
    """

    def __init__(self, path: str | os.PathLike, keep: int = 3, trusted: bool = False):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: must be an integer ≥ 1, got {keep!r}")
        if not isinstance(trusted, bool):
            raise ValueError(f"trusted: must be True or False, got {trusted!r}")
        self.trusted = trusted
        text = os.fspath(path)
        if not text:
            raise ValueError("path: give a directory or s3://bucket/prefix")
        self.path, self.keep = text, keep
        self._last_saved: tuple[int, str] | None = None  # (step, where) of this object's last save
        if text.startswith("s3://"):
            bucket, _, prefix = text[len("s3://"):].partition("/")
            if not bucket:
                raise ValueError(f"path: {text!r} names no bucket (s3://bucket/prefix)")
            self._store: Store = S3Store(bucket, prefix.strip("/"))
        else:
            self._store = DirectoryStore(os.path.abspath(os.path.expanduser(text)))

    def save(self, state: Any, step: int) -> str | None:
        """On the head: write atomically and keep the newest `keep`. Elsewhere: nothing (None).
        A state that `load_latest` would refuse (see `trusted`) is saved, with a warning naming
        what it holds: better told at the first save than at the resume."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step: must be an integer ≥ 0, got {step!r}")
        if not _is_head():
            return None
        import torch

        buf = io.BytesIO()
        torch.save(state, buf)
        if not self.trusted:
            _warn_if_refused(buf, step)
        where = self._store.put(_name(step), buf.getbuffer())
        self._last_saved = (step, where)
        for old in sorted(self.steps())[:-self.keep]:
            self._store.delete(_name(old))
        return where

    def save_if_preempted(self, state: Any, step: int) -> None:
        """Where `save` would go in the loop, called every step: nothing, until a node of the pool
        has a preemption notice (`rank_info().preempted`). Then the head saves `state` as `step`
        and ends the attempt with `Preempted`, so the retry starts at once on the nodes that are
        left (or a replacement) and resumes from this checkpoint with `load_latest`. The other
        ranks go on until the controller stops them: none may end the attempt before the head's
        save is on disk."""
        import time

        from skytasks.preemption import Preempted, preemption

        notice = preemption()
        if notice is None or not _is_head():
            return
        # Saved already by `save` just before (a per-epoch checkpoint): not written twice.
        last = self._last_saved
        where = last[1] if last is not None and last[0] == step else self.save(state, step)
        raise Preempted(f"{notice.describe()}; checkpoint of step {step} saved at {where} "
                        f"{time.time() - notice.at:.2f}s after the notice; Checkpointer.load_latest() resumes "
                        f"from it")

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints there, oldest first."""
        return sorted(int(m.group(1)) for n in self._store.names() if (m := _NAME.match(n)))

    def load_latest(self, map_location: Any = "cpu") -> tuple[int, Any] | None:
        """`(step, state)` of the newest complete checkpoint, or None; the same on every rank
        (inside a process group the head reads the file and broadcasts its bytes, so a directory
        on the head's node alone serves every node; each rank then loads them itself).
        Raises `CheckpointError` where the checkpoint holds more than a state dict's kinds of
        objects and `trusted` is False."""
        in_group = _process_group_world() is not None
        found: tuple[int, bytes | bytearray] | None = None
        if not in_group:
            steps = self.steps()
            found = (steps[-1], self._store.get(_name(steps[-1]))) if steps else None
        else:
            found = _broadcast_newest(self if _is_head() else None)
        if found is None:
            return None
        step, data = found
        return step, self._load(data, step, map_location)

    def _load(self, data: bytes | bytearray, step: int, map_location: Any) -> Any:
        import torch

        try:
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=not self.trusted)
        except pickle.UnpicklingError as exc:
            if self.trusted or "Weights only load failed" not in str(exc):
                raise
            where = f"{self.path.rstrip('/')}/{_name(step)}"
            what = _what_it_met(str(exc))
            raise CheckpointError(
                f"checkpoint {where} holds {what}, which loading would have to run code to build: "
                f"Checkpointer loads tensors, numbers, strings and their containers only (a model's and an "
                f"optimizer's state dicts). Checkpointer(..., trusted=True) unpickles it fully, running "
                f"whatever code it names: only for checkpoints you wrote yourself.", what, where) from None

    def __repr__(self) -> str:
        trusted = ", trusted=True" if self.trusted else ""
        return f"Checkpointer({self.path!r}, keep={self.keep}{trusted})"


def _warn_if_refused(buf: io.BytesIO, step: int) -> None:
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


def _what_it_met(torch_message: str) -> str:
    """What torch's weights-only unpickler refused, from its error's text: the global it met
    ("GLOBAL posix.system ..."), else its own words ("Unsupported operand 149")."""
    named = re.search(r"GLOBAL ([\w.]+)", torch_message)
    if named:
        return named.group(1)
    said = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", torch_message)
    return said.group(1).strip() if said else "an object that weights-only loading does not accept"


def _broadcast_newest(head: Checkpointer | None) -> tuple[int, bytes | bytearray] | None:
    """The head's newest `(step, file bytes)` on every rank, as tensors: a header (step, length),
    then the bytes in chunks. Plain bytes, never a pickle: each rank's own weights-only load
    judges them. `head` is the head's Checkpointer, None on the other ranks."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data: bytes | bytearray = b""
    step, failure = _NONE, None
    if head is not None:
        try:
            steps = head.steps()
            if steps:
                step, data = steps[-1], head._store.get(_name(steps[-1]))
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


def _is_head() -> bool:
    from skytasks.rank import in_rank, rank_info

    return not in_rank() or rank_info().is_head


def _process_group_world() -> int | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size()
    return None
