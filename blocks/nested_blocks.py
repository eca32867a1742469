"""The GPU Pool's nested blocks whose type a provider names lazily (`kubernetes_credentials`:
prefect-kubernetes' block): given their real class where Prefect reads nested blocks (a schema,
registration), and imported first where Prefect imports every collection anyway."""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any, Optional, get_args

from prefect.blocks.core import Block
from prefect.plugins import load_prefect_collections
from pydantic.fields import FieldInfo

from skytasks.blocks.aws_credentials_field import AWS_CREDENTIALS
from skytasks.providers.registry import block_fields, imported

# The pool's own block fields named lazily, with their "module:Class": required (never None),
# unlike a provider's Optional ones (`block_fields()`).
POOL_BLOCK_FIELDS = {"aws_credentials": AWS_CREDENTIALS}


def _loaded_with_every_collection() -> bool:
    """Whether Prefect is importing every installed collection now (as a server does before it
    registers the block types it has, and `Block.load("gpu-pool/NAME")`): this module is one."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not load_prefect_collections.__code__:
        frame = frame.f_back
    return frame is not None


if _loaded_with_every_collection():
    # A server registers block types in the order they were defined, and a nested block's type
    # must be there before a schema that refers to it: here the nested blocks' packages are
    # imported anyway, so they come first (elsewhere only when a value or a schema needs them).
    for _target in (*POOL_BLOCK_FIELDS.values(), *block_fields().values()):
        try:
            imported(_target)
        except ImportError:
            pass


_TYPING = threading.RLock()
_TYPED: set[type] = set()


def type_block_fields(cls: type[Block]) -> None:
    """Each block field whose type a provider names lazily (`ProviderPlugin.block_fields`) given
    its block class where that is installed, the model rebuilt once: Prefect reads nested blocks
    off the fields' types (a schema's references and secret fields, the block types it registers
    with the pool's), so the schema is the one the real type gives. Done when a schema is first
    made or the block registered, never as the class is defined: until then a pool imports no
    provider's package (a field's own validator imports it when a value is given)."""
    with _TYPING:
        if cls in _TYPED:
            return
        _TYPED.add(cls)
        typed = False
        lazy = [(name, target, False) for name, target in POOL_BLOCK_FIELDS.items()]
        lazy += [(name, target, True) for name, target in block_fields().items()]
        for name, target, optional in lazy:
            try:
                block = imported(target)
            except ImportError:
                continue  # without the extra the field keeps its lazy type; its provider's pools are refused
            # the class itself, not wrapped: Prefect finds nested blocks only so
            annotation: Any = Optional[block] if optional else block
            cls.__pydantic_fields__[name] = FieldInfo.from_annotated_attribute(annotation, cls.model_fields[name])
            typed = True
        if typed:
            cls.model_rebuild(force=True)


def block_class(annotation: Any) -> type[Block] | None:
    """The Prefect block class a field holds (its type, or the type in its Optional), if any."""
    for candidate in (annotation, *get_args(annotation)):
        if Block.is_block_class(candidate):
            return candidate
    return None
