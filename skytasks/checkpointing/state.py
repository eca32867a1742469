"""The user's `state` mapping as DCP's state dict, and back into the same objects.

`{"model": m, "optim": opt, "loader": stateful, "epoch": 3}`: a module's state (plain, DDP,
FSDP2, TP) through `get_model_state_dict`, an optimizer's through `get_optimizer_state_dict` with
the module that owns its parameters (so its state is keyed by parameter names, and reshards with
them), any other object with `state_dict()`/`load_state_dict()` as it gives it, and plain values
as they are. `restore` builds the same dict from the freshly made objects (their shards say what
this rank needs), loads into it, and puts it back with `set_model_state_dict` and friends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skytasks.errors import CheckpointError


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def holds_stateful(state: Any) -> bool:
    """The sharded form: a mapping with at least one module, optimizer or other stateful object."""
    return isinstance(state, Mapping) and any(is_stateful(v) for v in state.values())


def refuse_sharded_tensors(state: Any) -> None:
    """A plain state dict holding DTensors or sharded tensors: the head would save its own shards
    and every rank would load them, silently. Refused, naming the form that works."""
    found = _first_sharded(state, "state")
    if found is not None:
        path, kind = found
        raise CheckpointError(
            f"Checkpointer.save: {path} is a {kind}, one rank's shard of a sharded model: a plain state dict is "
            f"saved by the head alone, so every rank would restore the head's shards. Give the objects themselves, "
            f"on every rank: save({{\"model\": model, \"optim\": optimizer, ...}}, step), and restore them with "
            f"restore({{\"model\": model, \"optim\": optimizer, ...}}).", kind, path)


def _first_sharded(value: Any, path: str) -> tuple[str, str] | None:
    kind = type(value).__name__
    if kind in ("DTensor", "ShardedTensor") and type(value).__module__.startswith("torch.distributed"):
        return path, kind
    if isinstance(value, Mapping):
        for k, v in value.items():
            if (hit := _first_sharded(v, f"{path}[{k!r}]")) is not None:
                return hit
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if (hit := _first_sharded(v, f"{path}[{i}]")) is not None:
                return hit
    return None


def _owner(state: Mapping[str, Any], optimizer: Any, key: str) -> Any:
    """The module of `state` whose parameters `optimizer` steps (several: one ModuleDict of them)."""
    import torch.nn as nn

    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)
               and wanted & {id(p) for p in v.parameters()}}
    if not modules:
        raise CheckpointError(
            f"Checkpointer: state[{key!r}] is an optimizer whose parameters belong to no module in the state: save "
            f"it beside its model, save({{\"model\": model, {key!r}: optimizer}}, step), so its state is keyed by "
            f"parameter names and reshards with them.", type(optimizer).__name__, key)
    if len(modules) == 1:
        return next(iter(modules.values()))
    return nn.ModuleDict(modules)


def to_dcp(state: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's state dict of `state`: what every rank saves (its own shards of it)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ValueError(f"state: keys must be strings, got {key!r}")
        if isinstance(value, torch.nn.Module):
            out[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            out[key] = get_optimizer_state_dict(_owner(state, value, key), value)
        elif is_stateful(value):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def from_dcp(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Put what was loaded into `state`'s objects, in place (plain values: the mapping's entries)."""
    import torch
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for key, value in state.items():
        if key not in loaded:
            continue
        if isinstance(value, torch.nn.Module):
            set_model_state_dict(value, loaded[key])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_owner(state, value, key), value, loaded[key])
        elif is_stateful(value):
            value.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]
