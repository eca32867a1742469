"""Reading a sharded checkpoint without running code: DCP's `.metadata` and its non-tensor values.

PyTorch writes a DCP checkpoint's `.metadata` with `pickle` and reads it with `pickle.load`, and
its default load planner reads every non-tensor value (an int, a learning rate, a data loader's
position) with `torch.load(weights_only=False)`: a file planted in the store would run code in
every rank. Here the metadata goes through an unpickler that builds only the checkpoint format's
own classes, tensor metadata (sizes, dtypes, layouts), paths, numbers, strings and containers, and
the values through torch's weights-only unpickler. Anything else raises `CheckpointError` naming
what it met; `trusted=True` reads as PyTorch does. The tensors themselves are read by DCP with
`weights_only=True` already.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from skytasks.errors import CheckpointError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_METADATA_MODULE, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name ("torch.strided")
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class MetadataRefused(Exception):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: every global a pickle names is looked up here, and
    one outside the list is refused before it is imported, let alone called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):  # torch.float32, torch.bfloat16, ...
                return value
        raise MetadataRefused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataRefused(f"a persistent id ({type(pid).__name__})")


def load_metadata(data: bytes, where: str) -> Any:
    """DCP's Metadata from the bytes of a `.metadata` file, or CheckpointError."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except MetadataRefused as refused:
        raise _refusal(refused.what, where) from None
    except Exception as exc:  # noqa: BLE001 - a truncated or garbled file: named, never a bare traceback
        raise CheckpointError(f"checkpoint metadata {where} cannot be read: {type(exc).__name__}: {exc}",
                              "", where) from None
    if not isinstance(metadata, Metadata):
        raise _refusal(type(metadata).__name__, where)
    return metadata


def _refusal(what: str, where: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint metadata {where} holds {what}, which loading would have to run code to build: a sharded "
        f"checkpoint's metadata holds only torch.distributed.checkpoint's own classes, tensor metadata, numbers, "
        f"strings and containers. Checkpointer(..., trusted=True) unpickles it fully, running whatever code it "
        f"names: only for checkpoints you wrote yourself.", what, where)


def safe_reader(path: str, trusted: bool) -> Any:
    """A FileSystemReader of the DCP checkpoint at `path` whose metadata is read by the rule above
    (by PyTorch's own `pickle.load` when `trusted`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        refused: CheckpointError | None = None  # DCP wraps what read_metadata raises: kept to raise as itself

        # No `rank=` keyword: without it DCP does not fall back to per-rank metadata files (a
        # format this writer never makes) when the global one is refused.
        def read_metadata(self, *args: Any) -> Any:
            if trusted:
                return super().read_metadata()
            where = os.fspath(self._get_metadata_path())
            with open(where, "rb") as f:
                try:
                    metadata = load_metadata(f.read(), where)
                except CheckpointError as exc:
                    self.refused = exc
                    raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)


def safe_planner(trusted: bool, where: str, base: Any = None) -> Any:
    """DCP's default load planner (or `base`), reading non-tensor values weights-only unless `trusted`."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class WeightsOnlyLoadPlanner(base or DefaultLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            if trusted:
                return super().load_bytes(read_item, value)
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                from skytasks.checkpointing.plain import what_it_met

                what = what_it_met(str(exc))
                raise CheckpointError(
                    f"checkpoint {where} holds {what} in {read_item.dest_index.fqn}, which loading would have to "
                    f"run code to build: Checkpointer loads tensors, numbers, strings and their containers only. "
                    f"Checkpointer(..., trusted=True) unpickles it fully: only for checkpoints you wrote yourself.",
                    what, where) from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element as set_in

                set_in(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded
            return None

    return WeightsOnlyLoadPlanner()
