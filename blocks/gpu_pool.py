"""GPUPool: the Prefect block that says which nodes a distributed task runs on.

Configuration plus a few verbs, after prefect-aws: the fields are validated at construction (a
bad pool never launches anything), and `with pool:` / `async with pool:` keeps its nodes up
across calls and always tears them down.

Its fields are the pool's own (shape, environment, credential blocks, timings) and `settings`, one
provider's settings model (blocks/pool_settings.py says why models in a plain Union): Prefect's
form shows the common fields and a tab per provider. The contract's flat keywords and attributes
(`provider="ssh", hosts=[...]`, `pool.hosts`) map onto the settings, and so do documents saved
before the settings existed.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Annotated, Any, Optional

from prefect.blocks.core import Block
from prefect.blocks.fields import SecretDict
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, WithJsonSchema, model_validator

from skytasks.blocks.block_logo import served_logo_url
from skytasks.blocks.aws_credentials_field import UNSET, LazyAwsCredentials, default_aws_credentials
from skytasks.blocks.nested_blocks import block_class, type_block_fields
from skytasks.blocks.pool_settings import (LOADING_DOCUMENT, STALE_SECRETS, FlatSettingNames, LocalSettings,
                                           ProviderSettings, SecretEnv, aws_environment, field_errors, foreign_field,
                                           settings_from_flat)
from skytasks.errors import PoolConfigError
from skytasks.pool_spec import PoolSpec
from skytasks.preflight.fields import LIMITS_BOX, Level, PreflightLimits, fold_flat_limits
from skytasks.providers.kubernetes.spec import CredentialsBlock
from skytasks.providers.registry import plugin, readers_of_fields
from skytasks.providers.remote_fields import OptionalInt, OptionalStr

if TYPE_CHECKING:
    from skytasks.controller.pool_runtime import PoolRuntime


_SCHEMAS: dict[tuple, dict[str, Any]] = {}  # GPUPool.model_json_schema's, made once per class


# The form, in the order of the fields: the provider choice (`settings`: tabs, one per provider, with
# that provider's settings below, from its folder's skytasks/providers/<name>/spec.py), the pool's
# shape and environment, the credential blocks and the timings.
class GPUPool(FlatSettingNames, Block):
    _block_type_name = "GPU Pool"
    _block_type_slug = "gpu-pool"
    # (its logo: the icon the Prefect UI itself serves, named as the block type is registered: _to_block_type)
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

    settings: ProviderSettings = Field(
        LocalSettings(), title="Provider",  # (a default, not a factory: the form shows it chosen)
        description="Where the nodes come from, and that provider's settings: local processes, your SSH machines, "
        "EC2 instances it launches, a SLURM allocation, or pods on Kubernetes.")
    nodes: int = Field(2, ge=1, description="Number of nodes (the most, when min_nodes is set).")
    min_nodes: OptionalInt = Field(
        None, ge=1, description="Elastic: start with what can be had, at least this many; empty: exactly `nodes`.")
    procs_per_node: int = Field(1, ge=1, description="Rank processes per node (one per GPU).")
    accelerator: OptionalStr = Field(None, description='GPU model, e.g. "A100", "H100", "L4"; empty: CPU.')
    accelerators_per_node: OptionalInt = Field(None, ge=1, description="GPUs per node; empty: 1 when accelerator is set.")
    env: SecretEnv = Field(
        default_factory=lambda: SecretDict({}), description="Environment for every rank (values stored encrypted, "
        "shown obfuscated).")
    # (an AwsCredentials block: its type and default are named lazily, blocks/aws_credentials_field.py)
    aws_credentials: LazyAwsCredentials = Field(
        default_factory=default_aws_credentials, description="AWS credentials: aws launches with them, and every rank gets them "
        "as AWS variables (S3 checkpoints on any provider).")
    # A field of the pool, not of KubernetesSettings: Prefect saves a nested block as a reference
    # to a saved block (and the form offers a picker of them) only where it is the block's own field.
    kubernetes_credentials: Optional[CredentialsBlock] = Field(
        None, description="kubernetes: a KubernetesCredentials block; empty: in-cluster config or the default "
        "kubeconfig.")
    reattach_seconds: float = Field(
        60, ge=0, description="How long a node whose stream to the controller broke may take to be reached again "
        "before it is a lost node (ssh, aws, slurm, kubernetes; a local pool's streams cannot break).")
    keep_warm_minutes: float = Field(
        0, ge=0, description="A saved pool's nodes stay up after the process that holds them ends, for the next "
        "process to attach to, until nobody has held them this long; 0: they end with their process.")
    preflight: Level = Field(
        "basic", description='What every node must show before user code runs on it: "basic" (its ranks start, see '
        'the promised GPUs, one small all-reduce), "full" (compute and bandwidth compared across nodes) or "off".')
    # One JSON box in the form, not four more inputs before a provider is chosen (the form keeps to
    # about 15); values are still checked field by field as a PreflightLimits.
    preflight_limits: Annotated[PreflightLimits, WithJsonSchema(LIMITS_BOX)] = Field(
        default_factory=PreflightLimits, description='For "full": when a node is unhealthy; how long checks may take: '
        'preflight_min_ratio, preflight_min_tflops, preflight_min_gbps, preflight_timeout_seconds.')

    _runtime: Any = PrivateAttr(default=None)

    def __init__(self, **fields: Any) -> None:
        # pydantic's ValidationError is not the PoolConfigError the contract promises: a caller's
        # `except PoolConfigError` must catch every bad pool field, naming it.
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise PoolConfigError(field_errors(exc)) from None

    @classmethod
    def model_validate(cls, obj: Any, *, strict: bool | None = None, from_attributes: bool | None = None,
                       context: dict[str, Any] | None = None, **kwargs: Any) -> GPUPool:
        # How Prefect loads a saved pool (Block.load): a bad or misspelt key of a saved document is
        # the same PoolConfigError, naming it, as from Python. The validators learn that the input
        # is a document from a context variable: a model with its own __init__ is validated
        # through it, where pydantic's validation context does not reach.
        token = LOADING_DOCUMENT.set(True)
        try:
            return super().model_validate(obj, strict=strict, from_attributes=from_attributes, context=context,
                                          **kwargs)
        except ValidationError as exc:
            raise PoolConfigError(field_errors(exc)) from None
        finally:
            LOADING_DOCUMENT.reset(token)

    @model_validator(mode="before")
    @classmethod
    def _settings_and_nested_blocks(cls, data: Any) -> Any:
        # The contract's flat keywords (`provider="ssh", hosts=[...]`), and a document saved before
        # the settings existed (flat, every field at its default or value), become `settings`;
        # a key nothing takes is an error naming it and the nearest field (blocks/pool_settings.py).
        if not isinstance(data, dict):
            return data
        data = fold_flat_limits(data)  # preflight_min_ratio=... is a preflight limit
        data = settings_from_flat(data, list(cls.model_fields), document=LOADING_DOCUMENT.get())
        # A saved pool's nested blocks come back with their block type's slug, by which Prefect
        # would look their class up among every installed Prefect collection, importing them all
        # (prefect-kubernetes for a local pool): the field's type already names the class.
        for name, info in cls.model_fields.items():
            value, block = data.get(name), block_class(info.annotation)
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
        for field, readers in readers_of_fields().items():  # the pool's own fields of one provider (credentials)
            if field in type(self).model_fields and self.provider not in readers and getattr(self, field) != _default(field):
                raise ValueError(foreign_field(field, self.provider))
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
        # Made once per class and arguments: Prefect asks for the whole schema once per field as it
        # saves or loads a block (`_field_has_secrets`), 0.25 s of a pool's save. A copy is handed
        # out, since Prefect's readers edit what they get.
        type_block_fields(cls)  # first: the schema is the one the fields' real types give
        key = (cls, repr(args), repr(sorted(kwargs.items())))
        schema = _SCHEMAS.get(key)
        if schema is None:
            schema = super().model_json_schema(*args, **kwargs)
            # A pool saved over one saved before the settings existed keeps its flat keys (Prefect's
            # update merges the stored data's top level): its old key is still obfuscated in the API.
            secret = schema.get("secret_fields")
            if isinstance(secret, list):
                schema["secret_fields"] = list(dict.fromkeys([*secret, *STALE_SECRETS]))
            _SCHEMAS[key] = schema
        return copy.deepcopy(schema)

    @classmethod
    def _to_block_type(cls) -> Any:
        # A logo no network can break: blocks/block_logo.py. Read where Prefect registers the block
        # type (and compares it with the server's), never at import.
        block_type = super()._to_block_type()
        return type(block_type).model_validate({**block_type.model_dump(), "logo_url": served_logo_url()})

    @classmethod
    def register_type_and_schema(cls, *args: Any, **kwargs: Any) -> Any:
        type_block_fields(cls)  # Prefect registers the nested block types it finds on the fields' types
        return super().register_type_and_schema(*args, **kwargs)

    @classmethod
    async def aregister_type_and_schema(cls, *args: Any, **kwargs: Any) -> None:
        type_block_fields(cls)
        await super().aregister_type_and_schema(*args, **kwargs)

    def __repr_args__(self) -> Any:
        # Prefect's makes the whole schema to learn the field names (and so would import every
        # provider's block type to print a local pool): the fields are known without one.
        return [(k, v) for k, v in BaseModel.__repr_args__(self) if k is None or k in type(self).model_fields]

    # -- the contract's flat names, read through the settings (and set: FlatSettingNames) ----

    @property
    def provider(self) -> str:
        """The provider's name ("local", "ssh", "aws", "slurm", "kubernetes"): its settings' tag."""
        return str(self.settings.provider)

    def __getattribute__(self, name: str) -> Any:
        # Credentials left at their default are made (prefect-aws imported) when first read: to a
        # caller `pool.aws_credentials` is always an AwsCredentials block.
        value = super().__getattribute__(name)
        if value is UNSET and name == "aws_credentials":
            value = self.__dict__[name] = UNSET.made()
        return value

    def model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.aws_credentials  # noqa: B018 - made before a dump: the document holds the real block's fields
        return super().model_dump(*args, **kwargs)

    def model_dump_json(self, *args: Any, **kwargs: Any) -> str:
        self.aws_credentials  # noqa: B018
        return super().model_dump_json(*args, **kwargs)

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
        """The validated fields as the frozen, typed spec the runtime and providers use: the shape,
        and the provider's settings model as they are (its part), checked against the shape."""
        own = plugin(self.provider)
        env: dict[str, str] = self.env.get_secret_value()  # plain strings from here on: the ranks' environment
        # Credentials left unset stay unmade (no prefect-aws) unless the provider itself uses them.
        creds = self.__dict__["aws_credentials"]
        spec = PoolSpec(name=self.display_name, provider=self.provider, nodes=self.nodes, min_nodes=self.min_nodes,
                        procs_per_node=self.procs_per_node, accelerators_per_node=self.accelerators_per_node,
                        env={**({} if creds is UNSET else aws_environment(creds)), **env}, part=self.settings,
                        credentials=None if own.credentials is None else getattr(self, own.credentials),
                        reattach_seconds=self.reattach_seconds, keep_warm_minutes=self.keep_warm_minutes,
                        preflight=self.preflight, accelerator=self.accelerator, **self.preflight_limits.model_dump())
        self.settings.check_pool(spec)
        return spec

    def reshaped(self, **shape: int | None) -> GPUPool:
        """A copy with other `nodes`/`procs_per_node`: another shape cannot use these nodes, so
        the copy has a runtime of its own, and is never warm: it would take the saved pool's warm
        nodes for its own shape's and end them."""
        if self.min_nodes is not None and (shape.get("nodes") or self.nodes) < self.min_nodes:
            shape = {**shape, "min_nodes": None}  # a fixed count below the floor: exactly that many
        copy = self.model_copy(update={**shape, "keep_warm_minutes": 0})
        copy._runtime = None
        return copy

    # -- bringing nodes up and down: the runtime does it ------------------------------------

    def runtime(self) -> PoolRuntime:
        """This pool's runtime (skytasks.controller.pool_runtime), made from its spec on first use by
        the composition root (skytasks.wiring), which hands it Prefect's parts."""
        from skytasks.wiring import pool_runtime

        rt = self._runtime
        if rt is None or (not rt.is_up and rt.spec != (spec := self.spec())):
            rt = self._runtime = pool_runtime(self.spec() if rt is None else spec, self)
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


def _default(field: str) -> Any:
    info = GPUPool.model_fields[field]
    return info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
