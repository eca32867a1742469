"""GPUPool: the Prefect block that says which nodes a distributed task runs on.

Configuration plus a few verbs, after prefect-aws: the fields are validated at construction (a
bad pool never launches anything), and `with pool:` / `async with pool:` keeps its nodes up
across calls and always tears them down.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional, get_args

from prefect.blocks.core import Block
from prefect.plugins import load_prefect_collections
from prefect_aws import AwsCredentials
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator
from pydantic.fields import FieldInfo

import skytasks.prefect_records  # noqa: F401 - the Prefect side of pool events (flow-run logs, Prefect events)
from skytasks.errors import PoolConfigError
from skytasks.pool_spec import PoolSpec
from skytasks.providers import SHAPE_FIELDS
from skytasks.providers.aws.spec import AWSFields
from skytasks.providers.kubernetes.spec import KubernetesFields
from skytasks.providers.registry import ProviderName, block_fields, imported, plugin, readers_of_fields
from skytasks.providers.remote_fields import RemoteFields
from skytasks.providers.slurm.spec import SlurmFields
from skytasks.providers.ssh.spec import SSHFields

if TYPE_CHECKING:
    from skytasks.controller.pool_runtime import PoolRuntime


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
    for _target in block_fields().values():
        try:
            imported(_target)
        except ImportError:
            pass


class PoolShape(BaseModel):
    """The fields every provider takes (first in the block's form)."""

    provider: ProviderName = Field(
        "local", description="local: processes here; ssh: your machines; aws: EC2 it launches; slurm: a SLURM allocation; "
        "kubernetes: one pod per node")
    nodes: int = Field(2, ge=1, description="Number of nodes (the most, when min_nodes is set).")
    min_nodes: Optional[int] = Field(
        None, ge=1, description="Elastic: start with what can be had, at least this many; None: exactly `nodes`.")
    procs_per_node: int = Field(1, ge=1, description="Rank processes per node (one per GPU).")
    accelerator: Optional[str] = Field(None, description='GPU model, e.g. "A100", "H100", "L4". None means CPU.')
    accelerators_per_node: Optional[int] = Field(None, ge=1, description="GPUs per node; 1 when accelerator is set.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for every rank.")
    reattach_seconds: float = Field(
        60, ge=0, description="How long a node whose stream to the controller broke may take to be reached again "
        "before it is a lost node (ssh, aws, slurm, kubernetes; a local pool's streams cannot break).")
    keep_warm_minutes: float = Field(
        0, ge=0, description="A saved pool's nodes stay up after the process that holds them ends, for the next "
        "process to attach to, until nobody has held them this long; 0: they end with their process.")


# Each provider's own fields come from its folder (skytasks/providers/<name>/spec.py); pydantic
# lays a form out from the last base to the first, so the shape comes first.
class GPUPool(Block, KubernetesFields, AWSFields, SlurmFields, SSHFields, RemoteFields, PoolShape):
    _block_type_name = "GPU Pool"
    _block_type_slug = "gpu-pool"
    _logo_url = "https://images.ctfassets.net/gm98wzqotmnx/4HlN0GkcPMXp6TxuQtHEjt/16dd0296f4f2ccd3db3e5eb1e1b66ddc/pytorch-logo.png"  # type: ignore[assignment]  # noqa: E501
    _description = ("Nodes for multi-node PyTorch training: local processes, SSH hosts, EC2 instances or the nodes "
                    "of a SLURM allocation, or pods on Kubernetes.")
    _documentation_url = "https://github.com/skytasks/skytasks#readme"  # type: ignore[assignment]
    _code_example = """
```python
from skytasks import GPUPool
from skytasks import distributed_task

GPUPool(provider="local", nodes=2).save("two-local-nodes")

@distributed_task(pool="two-local-nodes")
def train(epochs: int = 3) -> dict:
    ...
```
"""

    aws_credentials: AwsCredentials = Field(default_factory=AwsCredentials)

    _runtime: Any = PrivateAttr(default=None)

    def __init__(self, **fields: Any) -> None:
        # pydantic's ValidationError is not the PoolConfigError the contract promises: a caller's
        # `except PoolConfigError` must catch every bad pool field, naming it.
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise PoolConfigError(pool_field_errors(exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _nested_blocks_by_their_field(cls, data: Any) -> Any:
        # A saved pool's nested blocks come back with their block type's slug, by which Prefect
        # would look their class up among every installed Prefect collection, importing them all
        # (prefect-kubernetes for a local pool): the field's type already names the class.
        if not isinstance(data, dict):
            return data
        for name, info in cls.model_fields.items():
            value, block = data.get(name), _block_class(info.annotation)
            if isinstance(value, dict) and block is not None and value.get("block_type_slug") == block.get_block_type_slug():
                data = {**data, name: {k: v for k, v in value.items() if k != "block_type_slug"}}
        return data

    @model_validator(mode="after")
    def _fields_agree(self) -> GPUPool:
        if self.accelerator is not None and self.accelerators_per_node is None:
            self.accelerators_per_node = 1
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes: {self.min_nodes} is more than nodes={self.nodes} (nodes is the most the "
                             "pool asks for, min_nodes the fewest it runs on)")
        for field, readers in readers_of_fields().items():
            if self.provider not in readers and getattr(self, field) != _default(field):
                raise ValueError(f"{field}: only provider {_either(readers)} takes it, not provider={self.provider!r} "
                                 "(a field of another provider is never ignored silently)")
        self.spec()  # the provider's own checks, naming the field
        return self

    # -- Prefect's view of the block: nested blocks get their real types for a schema -------

    @classmethod
    def __dispatch_key__(cls) -> str:
        # Prefect's own reads this slug off a whole schema, made twice as the class is defined; the
        # slug alone makes none, so defining the block imports no provider's block type.
        return cls.get_block_type_slug()

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        _type_block_fields(cls)
        return super().model_json_schema(*args, **kwargs)

    @classmethod
    def register_type_and_schema(cls, *args: Any, **kwargs: Any) -> Any:
        _type_block_fields(cls)  # Prefect registers the nested block types it finds on the fields' types
        return super().register_type_and_schema(*args, **kwargs)

    @classmethod
    async def aregister_type_and_schema(cls, *args: Any, **kwargs: Any) -> None:
        _type_block_fields(cls)
        await super().aregister_type_and_schema(*args, **kwargs)

    def __repr_args__(self) -> Any:
        # Prefect's makes the whole schema to learn the field names (and so would import every
        # provider's block type to print a local pool): the fields are known without one.
        return [(k, v) for k, v in BaseModel.__repr_args__(self) if k is None or k in type(self).model_fields]

    # -- what it is, frozen ---------------------------------------------------------------

    @property
    def saved_name(self) -> str | None:
        """The name it was saved or loaded as, if any."""
        return getattr(self, "_block_document_name", None)

    @property
    def display_name(self) -> str:
        """The saved block's name, or the provider's for an unsaved pool (tags, events)."""
        return self.saved_name or f"{self.provider}-pool"

    def spec(self) -> PoolSpec:
        """The validated fields as the frozen, typed spec the runtime and providers use."""
        own = plugin(self.provider)
        part = own.build({name: getattr(self, name) for name in (*SHAPE_FIELDS, *own.reads)})
        return PoolSpec(name=self.display_name, provider=self.provider, nodes=self.nodes, min_nodes=self.min_nodes,
                        procs_per_node=self.procs_per_node, accelerators_per_node=self.accelerators_per_node,
                        env={**aws_environment(self.aws_credentials), **self.env}, part=part,
                        reattach_seconds=self.reattach_seconds, keep_warm_minutes=self.keep_warm_minutes)

    def reshaped(self, **shape: int | None) -> GPUPool:
        """A copy with other `nodes`/`procs_per_node`: another shape cannot use these nodes, so
        the copy has a runtime of its own."""
        if self.min_nodes is not None and (shape.get("nodes") or self.nodes) < self.min_nodes:
            shape = {**shape, "min_nodes": None}  # a fixed count below the floor: exactly that many
        copy = self.model_copy(update=shape)
        copy._runtime = None
        return copy

    # -- bringing nodes up and down: the runtime does it ------------------------------------

    def runtime(self) -> PoolRuntime:
        """This pool's runtime (skytasks.controller.pool_runtime), made from its spec on first use."""
        from skytasks.controller.pool_runtime import PoolRuntime

        rt = self._runtime
        if rt is None or (not rt.is_up and rt.spec != (spec := self.spec())):
            rt = self._runtime = PoolRuntime(self.spec() if rt is None else spec, self)
        return rt

    @property
    def is_up(self) -> bool:
        return self._runtime is not None and self._runtime.is_up

    def __enter__(self) -> GPUPool:
        self.runtime().enter()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.runtime().exit()

    async def __aenter__(self) -> GPUPool:
        await self.runtime().aenter()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.runtime().aexit()


_TYPING = threading.RLock()
_TYPED: set[type] = set()


def _type_block_fields(cls: type[GPUPool]) -> None:
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
        for name, target in block_fields().items():
            try:
                block = imported(target)
            except ImportError:
                continue  # without the extra the field keeps its lazy type; its provider's pools are refused
            annotation: Any = Optional[block]  # the class itself, not wrapped: Prefect finds nested blocks only so
            cls.__pydantic_fields__[name] = FieldInfo.from_annotated_attribute(annotation, cls.model_fields[name])
            typed = True
        if typed:
            cls.model_rebuild(force=True)


def _block_class(annotation: Any) -> type[Block] | None:
    """The Prefect block class a field holds (its type, or the type in its Optional), if any."""
    for candidate in (annotation, *get_args(annotation)):
        if Block.is_block_class(candidate):
            return candidate
    return None


def _default(field: str) -> Any:
    info = GPUPool.model_fields[field]
    return info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]


def _either(names: tuple[str, ...]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def pool_field_errors(exc: ValidationError) -> str:
    """pydantic's errors as `field: what is wrong (got value)`, one per line, the field first."""
    lines = []
    for e in exc.errors():
        field = ".".join(str(part) for part in e["loc"])
        text = e["msg"].removeprefix("Value error, ")
        if field and not text.startswith((field + ":", field + ".")):  # a nested block's error names its part
            got = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
            text = f"{field}: {text}{got}"
        lines.append(text)
    return "; ".join(lines)


def aws_environment(creds: AwsCredentials) -> dict[str, str]:
    """The pool's AWS credentials as the standard variables boto3 reads on a rank (for
    `skytasks.Checkpointer("s3://...")` and the user's own boto3 calls). Only what is set: an
    unset block leaves the node's own chain (an instance profile) in charge. Never logged."""
    secret = creds.aws_secret_access_key
    values = {
        "AWS_ACCESS_KEY_ID": creds.aws_access_key_id,
        "AWS_SECRET_ACCESS_KEY": secret.get_secret_value() if secret is not None else None,
        "AWS_SESSION_TOKEN": creds.aws_session_token,
        "AWS_DEFAULT_REGION": creds.region_name,
        "AWS_ENDPOINT_URL": creds.aws_client_parameters.endpoint_url if creds.aws_client_parameters else None,
    }
    return {k: str(v) for k, v in values.items() if v}
