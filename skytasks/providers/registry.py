"""Every provider, by the name a pool's `provider` field takes: adding one is a folder under
`skytasks/providers/` with a `PLUGIN` in its `__init__`, and one line in this table. A folder's
`__init__` is light, and so is this table: a provider's settings model (`spec.py`) is imported when a pool
is checked, its client or SDK (asyncssh, the EC2 code) when a pool of it starts, and kubernetes with
prefect-kubernetes when a kubernetes pool is made or loaded. `skytasks run` on a local pool imports
none of them (nor the block: its aws_credentials field brings prefect-aws and boto3 to any pool)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Literal

from skytasks.errors import PoolConfigError
from skytasks.providers import NodeProvider, ProviderClass, ProviderPlugin, aws, imported, kubernetes, local, slurm, ssh
from skytasks.event_bus import PoolReporter

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec

PROVIDERS: dict[str, ProviderPlugin] = {p.name: p for p in (
    local.PLUGIN,
    ssh.PLUGIN,
    aws.PLUGIN,
    slurm.PLUGIN,
    kubernetes.PLUGIN,
)}
# The `provider` field's type, from the table: the names are written once.
if TYPE_CHECKING:
    ProviderName = str
else:
    ProviderName = Literal[tuple(PROVIDERS)]


def plugin(name: str) -> ProviderPlugin:
    found = PROVIDERS.get(name)
    if found is None:
        raise PoolConfigError(f"provider: unknown provider {name!r}; known: {', '.join(PROVIDERS)}")
    return found


@functools.cache
def readers_of_fields() -> dict[str, tuple[str, ...]]:
    """Each provider-specific block field and the providers that read it (from the table: made
    once, not at every GPUPool)."""
    readers: dict[str, tuple[str, ...]] = {}
    for p in PROVIDERS.values():
        for name in p.reads:
            readers[name] = (*readers.get(name, ()), p.name)
    return readers


@functools.cache
def block_fields() -> dict[str, str]:
    """Each block field whose block type a provider names lazily, and its "module:Class"."""
    return {name: target for p in PROVIDERS.values() for name, target in p.block_fields.items()}


def provider_class(name: str) -> ProviderClass:
    return imported(plugin(name).provider)


def provider_for(spec: PoolSpec, reporter: PoolReporter | None = None) -> NodeProvider:
    return provider_class(spec.provider)(spec, reporter=reporter or PoolReporter(spec.name, spec.provider))
