"""`skytasks.checkpoint.Checkpointer`: where it has always been imported from.

The implementation is the `skytasks.checkpointing` package: a plain state dict saved by the head as
one file (`plain`), and modules, optimizers and other stateful objects saved by every rank in
`torch.distributed.checkpoint`'s format, asynchronously, committed whole, restored resharded
(`sharded`). Both load without running code unless `trusted=True`.
"""

from __future__ import annotations

from skytasks.checkpointing.checkpointer import Checkpointer

__all__ = ["Checkpointer"]
