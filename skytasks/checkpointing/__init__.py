"""Checkpoints of a training loop: `Checkpointer`, its two forms and what keeps them safe.

- `checkpointer`: the `Checkpointer` class users meet.
- `plain`: a state dict of plain tensors, one file written by the head.
- `sharded`, `state`, `async_writer`, `commit`: objects saved by every rank in DCP's format,
  in the background, committed whole; restored resharded.
- `safe_metadata`, `torch_gate`: loading runs no code (DCP's metadata pickle read by a restricted
  unpickler; no loading at all on a torch older than 2.6 unless trusted).
- `export`: a sharded checkpoint as one file; `preempted`: `save_if_preempted` with objects;
  `committed_event`: `skytasks.checkpoint.committed`.
"""

from skytasks.checkpointing.checkpointer import Checkpointer

__all__ = ["Checkpointer"]
