"""`Checkpointer(path, keep=3, trusted=False, async_save=True)`: one object for both forms.

- Objects (`{"model": m, "optim": opt, ...}`): `save` on every rank, sharded in DCP's format,
  asynchronous, committed whole (`sharded`, `async_writer`, `commit`); `restore` on every rank,
  resharded to this world size; `export` to one file.
- A plain state dict of plain tensors: the head writes one file (`plain`), `load_latest` gives
  every rank the newest. One holding DTensors or sharded tensors is refused at `save`.

Nothing loaded runs code unless `trusted=True` (`safe_metadata`, `plain`), and nothing loads at
all on a torch older than 2.6 then (`torch_gate`).
"""

from __future__ import annotations

import io
import os
from typing import Any

from skytasks.checkpoint_stores import DirectoryStore, S3Store, Store
from skytasks.checkpointing import plain
from skytasks.checkpointing.async_writer import SaveInFlight
from skytasks.checkpointing.commit import DirectoryLayout, S3Layout
from skytasks.checkpointing.state import holds_stateful, refuse_sharded_tensors
from skytasks.checkpointing.torch_gate import check_torch_can_load_safely


class Checkpointer:
    """Checkpoints of a training loop, for retries, node recoveries and preemptions to resume from.

    `path` is a directory (shared by every node for sharded checkpoints; the head's own suffices
    for plain ones) or `s3://bucket/prefix`. With objects, on every rank:

        ckpt = Checkpointer("s3://bucket/runs/gpt", keep=3)
        state = {"model": model, "optim": optimizer, "epoch": 0}
        start = (ckpt.restore(state) or -1) + 1       # in place, resharded to this world size
        for step in range(start, steps):
            ...
            if step % 100 == 0:
                ckpt.save(state, step)                # returns once staged; writes in the background

    With a plain state dict of plain tensors: `save(model.state_dict(), step)` on the head,
    `load_latest()` → `(step, state)` or None on every rank. `trusted=False` (the default) loads
    tensors, numbers, strings and their containers only and raises `CheckpointError` on anything
    else; `trusted=True` unpickles fully (it runs whatever code the files name).
    """

    def __init__(self, path: str | os.PathLike, keep: int = 3, trusted: bool = False, async_save: bool = True):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep: must be an integer ≥ 1, got {keep!r}")
        if not isinstance(trusted, bool):
            raise ValueError(f"trusted: must be True or False, got {trusted!r}")
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save: must be True or False, got {async_save!r}")
        self.trusted, self.async_save = trusted, async_save
        text = os.fspath(path)
        if not text:
            raise ValueError("path: give a directory or s3://bucket/prefix")
        self.path, self.keep = text, keep
        self._last_saved: tuple[int, str] | None = None  # (step, where) of this object's last plain save
        self._in_flight: SaveInFlight | None = None  # the sharded save being written, or last written
        if text.startswith("s3://"):
            bucket, _, prefix = text[len("s3://"):].partition("/")
            if not bucket:
                raise ValueError(f"path: {text!r} names no bucket (s3://bucket/prefix)")
            self._store: Store = S3Store(bucket, prefix.strip("/"))
            self._layout: DirectoryLayout | S3Layout = S3Layout(self._store)
        else:
            root = os.path.abspath(os.path.expanduser(text))
            self._store = DirectoryStore(root)
            self._layout = DirectoryLayout(root)

    # -- saving ------------------------------------------------------------------------------

    def save(self, state: Any, step: int) -> str | None:
        """Objects: on every rank, this rank's shards, committed whole once every rank's are
        written; returns where (with `async_save`, once the state is staged). A plain state
        dict: on the head, one file written atomically (None elsewhere). Keeps the newest `keep`."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step: must be an integer ≥ 0, got {step!r}")
        if holds_stateful(state):
            from skytasks.checkpointing import sharded

            flight = self._in_flight = sharded.save(self, state, step)
            if not self.async_save:
                self.wait()
            return flight.where
        refuse_sharded_tensors(state)
        if not plain.is_head():
            return None
        import torch

        buf = io.BytesIO()
        torch.save(state, buf)
        if not self.trusted:
            plain.warn_if_refused(buf, step)
        where = self._store.put(plain.name(step), buf.getbuffer())
        self._last_saved = (step, where)
        for old in sorted(self.steps())[:-self.keep]:
            self._store.delete(plain.name(old))
        return where

    def wait(self) -> None:
        """Block until the save in flight is committed; CheckpointError if it failed."""
        flight = self._in_flight
        if flight is not None:
            try:
                flight.wait()
            finally:
                if flight.future.done():
                    self._in_flight = None

    def save_if_preempted(self, state: Any, step: int) -> None:
        """Where `save` would go in the loop, called every step: nothing, until a node of the pool
        has a preemption notice. Then the state is saved as `step` (unless it was just saved),
        the save is waited for within the notice's grace, and the attempt ends with `Preempted`,
        so the retry resumes from this checkpoint. Plain state: the head saves, the others go on
        until stopped. Objects: every rank, at the same step (the ranks agree on it with one
        small all-reduce per call, since a notice reaches them at slightly different times)."""
        if holds_stateful(state):
            from skytasks.checkpointing.preempted import save_sharded_if_preempted

            return save_sharded_if_preempted(self, state, step)
        import time

        from skytasks.preemption import Preempted, preemption

        notice = preemption()
        if notice is None or not plain.is_head():
            return None
        # Saved already by `save` just before (a per-epoch checkpoint): not written twice.
        last = self._last_saved
        where = last[1] if last is not None and last[0] == step else self.save(state, step)
        raise Preempted(f"{notice.describe()}; checkpoint of step {step} saved at {where} "
                        f"{time.time() - notice.at:.2f}s after the notice; Checkpointer.load_latest() resumes "
                        f"from it")

    # -- loading -----------------------------------------------------------------------------

    def restore(self, state: Any) -> int | None:
        """On every rank: the newest committed sharded checkpoint into `state`'s objects, in
        place (plain values: the mapping's entries), resharded to this world size; its step, or
        None when there is none."""
        if not holds_stateful(state):
            raise ValueError("restore: give the objects to load into, e.g. restore({\"model\": model, \"optim\": opt})")
        from skytasks.checkpointing import sharded

        return sharded.restore(self, state)

    def steps(self) -> list[int]:
        """Steps of the complete plain checkpoints there, oldest first."""
        return sorted(int(m.group(1)) for n in self._store.names() if (m := plain.NAME.match(n)))

    def committed_steps(self) -> list[int]:
        """Steps of the committed sharded checkpoints there, oldest first."""
        return self._layout.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step (sharded, else plain), or None."""
        found = self.committed_steps() or self.steps()
        return found[-1] if found else None

    def load_latest(self, map_location: Any = "cpu") -> tuple[int, Any] | None:
        """`(step, state)` of the newest complete plain checkpoint, or None; the same on every rank
        (inside a process group the head reads the file and broadcasts its bytes, so a directory
        on the head's node alone serves every node; each rank then loads them itself).
        Raises `CheckpointError` where the checkpoint holds more than a state dict's kinds of
        objects and `trusted` is False, or where this node's torch is older than 2.6."""
        check_torch_can_load_safely(self.trusted, self.path)
        in_group = plain.process_group_world() is not None
        found: tuple[int, bytes | bytearray] | None = None
        if not in_group:
            steps = self.steps()
            found = (steps[-1], self._store.get(plain.name(steps[-1]))) if steps else None
        else:
            found = plain.broadcast_newest(self if plain.is_head() else None)
        if found is None:
            return None
        step, data = found
        return step, plain.load(data, f"{self.path.rstrip('/')}/{plain.name(step)}", self.trusted, map_location)

    def export(self, dest: str | os.PathLike, step: int | None = None) -> str:
        """One consolidated file of a committed sharded checkpoint (the newest, or `step`): the
        full state dict, as safetensors when `dest` ends in `.safetensors`, else torch.save.
        Run it in one process (outside the ranks, or on the head alone)."""
        from skytasks.checkpointing.async_writer import wait_for_saves
        from skytasks.checkpointing.export import export

        self.wait()
        wait_for_saves()
        return export(self, os.fspath(dest), step)

    def __repr__(self) -> str:
        trusted = ", trusted=True" if self.trusted else ""
        sync = ", async_save=False" if not self.async_save else ""
        return f"Checkpointer({self.path!r}, keep={self.keep}{trusted}{sync})"
