"""Every provider, by the name a pool's `provider` field takes: adding one is a folder under
`skytasks/providers/` with a `PLUGIN` in its `__init__`, and one line in this table. A folder's
`__init__` is light; its provider class (and boto3, asyncssh) is imported when a pool starts."""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Literal

from skytasks.errors import PoolConfigError
from skytasks.providers import NodeProvider, ProviderClass, ProviderPlugin, aws, kubernetes, local, slurm, ssh
from skytasks.providers.reporting import PoolReporter

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


def provider_class(name: str) -> ProviderClass:
    module, _, cls = plugin(name).provider.partition(":")
    return getattr(importlib.import_module(module), cls)


def provider_for(spec: PoolSpec, reporter: PoolReporter | None = None) -> NodeProvider:
    return provider_class(spec.provider)(spec, reporter=reporter or PoolReporter(spec.name, spec.provider))
