"""The base of every provider's settings model: one pydantic model per provider, in its folder's
`spec.py`, that is at once the block's `settings` (the provider's tab of the form) and, unchanged,
the provider's part of the `PoolSpec` (`spec.own(SSHSettings)`). A setting is thus spelled once:
its field, with its type, default, description and checks; the provider reads it by that name.

Frozen, because the spec is: `GPUPool` makes a new model when a setting is set (`pool.hosts = ...`),
so the one a running pool's spec holds never changes under it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec

Name = TypeVar("Name")

# A settings model's `provider` tag (`provider: ProviderTag[Literal["ssh"]] = "ssh"`), kept out of
# the form: the tab already says which provider (a select of one choice under it would only repeat
# it), and the form sends a field left at its default not at all. The tag is for a saved document,
# which says so itself; one the form sent without it is told by its keys (blocks/pool_settings.py).
ProviderTag = Annotated[Name, SkipJsonSchema(), Field(description="The provider these settings are for.")]


class ProviderSettingsModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def check_pool(self, pool: PoolSpec) -> None:
        """How these settings agree with the rest of the pool (its shape: nodes, accelerator),
        checked as the block makes its spec: a ValueError whose text starts with the field's name
        ("hosts: ..."). Each field's own checks are its validators."""
