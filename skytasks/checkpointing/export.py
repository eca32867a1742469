"""`Checkpointer.export(dest, step=None)`: a sharded checkpoint as one file, for serving or for
another PyTorch version (DCP's format is not promised across versions).

As `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` does, in one process: the full
state dict is loaded from every rank's shards (no process group), read by the same no-code rule
as `restore`, then written as safetensors (tensors by their dotted names; other values as JSON in
the file's metadata) or by `torch.save`, under a temporary name renamed into place.
"""

from __future__ import annotations

import json
import os
from typing import Any

from skytasks.errors import CheckpointError


def load_full(ckpt: Any, step: int | None) -> tuple[int, dict[str, Any]]:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from skytasks.checkpointing.safe_metadata import safe_planner, safe_reader
    from skytasks.checkpointing.sharded import plain_error
    from skytasks.checkpointing.torch_gate import check_torch_can_load_safely

    layout = ckpt._layout
    check_torch_can_load_safely(ckpt.trusted, layout.where)
    committed = layout.committed_steps()
    if step is None:
        if not committed:
            raise CheckpointError(f"export: {layout.where} holds no committed sharded checkpoint", "", layout.where)
        step = committed[-1]
    elif step not in committed:
        raise ValueError(f"step: {step} is not a committed checkpoint at {layout.where} (committed: {committed})")
    local = layout.reading_folder(step)
    state: dict[str, Any] = {}
    reader = safe_reader(local, ckpt.trusted)
    try:
        _load_state_dict(state, storage_reader=reader,
                         planner=safe_planner(ckpt.trusted, layout.describe(step), _EmptyStateDictLoadPlanner),
                         no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - DCP's gathered failure, as the error it holds
        raise (reader.refused or plain_error(exc)) from None
    finally:
        layout.done_reading(local)
    return step, state


def export(ckpt: Any, dest: str, step: int | None) -> str:
    import torch

    _, state = load_full(ckpt, step)
    from skytasks.checkpoint_stores import _create_private, _make_private_dirs

    dest = os.path.abspath(os.path.expanduser(dest))
    _make_private_dirs(os.path.dirname(dest))  # the folders it makes are 0700, as every Checkpointer's
    tmp = f"{dest}.{os.getpid()}.partial"
    # Made 0600 before a byte is written (never through a link planted there); both writers below
    # open it again by name, which keeps its mode.
    os.close(_create_private(tmp))
    try:
        if dest.endswith(".safetensors"):
            from safetensors.torch import save_file

            tensors, values = flatten(state)
            save_file(tensors, tmp, metadata={"skytasks.values": json.dumps(values, default=str)})
        else:
            torch.save(state, tmp)
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return dest


def flatten(state: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors by dotted name (contiguous, each its own storage, as safetensors wants), and the
    other values by dotted name."""
    import torch

    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            tensors[name] = value.detach().contiguous().clone()
        elif isinstance(value, (dict, list, tuple)) and value and _holds_tensors(value):
            more_tensors, more_values = flatten(value, f"{name}.")
            tensors.update(more_tensors)
            values.update(more_values)
        else:
            values[name] = value
    return tensors, values


def _holds_tensors(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False
