"""Where a warm pool's record lives: one Prefect Secret block per saved pool.

What another process needs to attach to a warm pool's nodes (where they are, their doors, the
pool's key and TLS key, the provider's handle) is as sensitive as a credential: whoever has it may
drive the nodes. So it is stored the way Prefect stores secrets, never in a plain record: a
`Secret` block (`skytasks-warm-<pool slug>`), its value a `SecretStr` that the server encrypts at
rest and the UI and API show obfuscated. It never holds a credential of the pool's own (SSH keys,
cloud tokens stay in the pool's fields).

Claiming a pool that nobody started yet is one create with `overwrite=False`: the server's unique
block name makes it atomic, so of two processes starting at once one starts the pool and the other
waits in line. `skytasks.controller.warm.WarmStore` is the protocol this implements (the
controller never imports Prefect).
"""

from __future__ import annotations

import json
import re
from typing import Any

from prefect.blocks.system import Secret
from pydantic import SecretStr

from skytasks.controller.warm import register_store

PREFIX = "skytasks-warm-"


def block_name(pool: str) -> str:
    """The Secret block's name for a pool: Prefect's block names are lower-case slugs."""
    slug = re.sub(r"[^a-z0-9-]+", "-", pool.lower()).strip("-") or "pool"
    return PREFIX + slug


class PrefectWarmStore:
    """Warm pools' records in the Prefect API this process talks to."""

    def load(self, pool: str) -> dict[str, Any] | None:
        try:
            block: Secret = Secret.load(block_name(pool), _sync=True)  # type: ignore[call-arg, assignment]
            value = block.get()
        except ValueError:  # no such block
            return None
        return value if isinstance(value, dict) else None

    def claim(self, pool: str, record: dict[str, Any]) -> bool:
        """Create the pool's record if none exists; False when another process has one."""
        try:
            _secret(record).save(block_name(pool), overwrite=False, _sync=True)  # type: ignore[call-arg]
        except ValueError:  # "already in use": the server's unique name decided
            return False
        return True

    def save(self, pool: str, record: dict[str, Any]) -> None:
        _secret(record).save(block_name(pool), overwrite=True, _sync=True)  # type: ignore[call-arg]

    def delete(self, pool: str) -> None:
        try:
            Secret.delete(block_name(pool), _sync=True)  # type: ignore[call-arg]
        except ValueError:
            pass  # gone already

    def names(self) -> list[str]:
        """The pools that have a record (their names as the records say them)."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            documents = client.read_block_documents_by_type(block_type_slug="secret", include_secrets=False)
        found = []
        for doc in documents:
            if doc.name and doc.name.startswith(PREFIX):
                record = self.load(doc.name[len(PREFIX):])
                found.append(str(record.get("pool", doc.name[len(PREFIX):])) if record else doc.name[len(PREFIX):])
        return sorted(found)


def _secret(record: dict[str, Any]) -> Secret:
    return Secret(value=SecretStr(json.dumps(record, sort_keys=True)))


register_store(PrefectWarmStore())
