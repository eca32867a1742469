"""Where a warm pool's record lives: Prefect Secret blocks, one per generation of the record.

What another process needs to attach to a warm pool's nodes (where they are, their doors, the
pool's key and TLS key, the provider's handle) is as sensitive as a credential: whoever has it may
drive the nodes. So it is stored the way Prefect stores secrets, never in a plain record: a
`Secret` block, its value a `SecretStr` that the server encrypts at rest. It never holds a
credential of the pool's own (SSH keys, cloud tokens stay in the pool's fields).

**Compare-and-set on a server that has none.** Generation N of a pool's record is the block
`skytasks-warm-<pool slug>--g<N>`. Writing generation N+1 is one create with `overwrite=False`:
the server's unique block name makes it atomic, so of two writers that read generation N one
wins. A writer whose generation is not the newest when it looks again (a very stale one, whose
name had been cleaned away) deletes what it made and is told it lost. Older generations are
deleted by their document id once a newer one stands: never by name, which a newer record may
have taken meanwhile. `skytasks.controller.warm_claim.WarmStore` is the protocol this implements;
the composition root (skytasks.wiring) hands it to the controller, which never imports Prefect.
"""

from __future__ import annotations

import json
import re
from typing import Any
from uuid import UUID

from prefect.blocks.system import Secret
from pydantic import SecretStr

from skytasks.controller.warm_claim import GONE

PREFIX = "skytasks-warm-"
GENERATION = "--g"  # a slug never holds two dashes in a row: the generation's mark cannot be a name's


def block_name(pool: str) -> str:
    """The stem of a pool's blocks: Prefect's block names are lower-case slugs."""
    slug = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]+", "-", pool.lower())).strip("-") or "pool"
    return PREFIX + slug


def _generation_name(pool: str, generation: int) -> str:
    return f"{block_name(pool)}{GENERATION}{generation}"


class PrefectWarmStore:
    """Warm pools' records in the Prefect API this process talks to."""

    def newest(self, pool: str) -> tuple[int, dict[str, Any] | None]:
        generations = self._generations(pool)
        if not generations:
            return 0, None
        newest = max(generations)
        record = self._read(generations[newest])
        if record is None:  # deleted as we read it (a newer one stands): read again
            return self.newest(pool)
        return newest, (None if record.get("state") == GONE else {**record, "generation": newest})

    def load(self, pool: str) -> dict[str, Any] | None:
        """The newest live record (None: none, or the pool ended)."""
        return self.newest(pool)[1]

    def write(self, pool: str, record: dict[str, Any], after: int) -> bool:
        made = after + 1
        body = {k: v for k, v in record.items() if k != "generation"}
        try:
            document = Secret(value=SecretStr(json.dumps(body, sort_keys=True))).save(  # type: ignore[call-arg]
                _generation_name(pool, made), overwrite=False, _sync=True)
        except ValueError:  # "already in use": another writer took this generation first
            return False
        generations = self._generations(pool)
        if max(generations, default=made) > made:  # a stale writer whose name had been freed
            self._delete(document if isinstance(document, UUID) else generations.get(made))
            return False
        for generation, doc_id in generations.items():
            if generation < made:
                self._delete(doc_id)
        return True

    def names(self) -> list[str]:
        """The pools that have a live record (their names as the records say them)."""
        found: dict[str, int] = {}
        newest: dict[str, UUID] = {}
        for name, doc_id in self._documents(PREFIX):
            stem, _, number = name.rpartition(GENERATION)
            if stem and number.isdigit() and int(number) > found.get(stem, -1):
                found[stem], newest[stem] = int(number), doc_id
        out = []
        for stem, doc_id in newest.items():
            record = self._read(doc_id)
            if record is not None and record.get("state") != GONE:
                out.append(str(record.get("pool", stem[len(PREFIX):])))
        return sorted(out)

    # -- the server ------------------------------------------------------------------------

    def _generations(self, pool: str) -> dict[int, UUID]:
        stem = block_name(pool) + GENERATION
        return {int(name[len(stem):]): doc_id for name, doc_id in self._documents(stem)
                if name.startswith(stem) and name[len(stem):].isdigit()}

    @staticmethod
    def _documents(like: str) -> list[tuple[str, UUID]]:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            response = client.request("POST", "/block_documents/filter", json={
                "block_documents": {"name": {"like_": like}}, "include_secrets": False, "limit": 200})
        return [(doc["name"], UUID(doc["id"])) for doc in response.json() if doc.get("name")]

    @staticmethod
    def _read(doc_id: UUID | None) -> dict[str, Any] | None:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        if doc_id is None:
            return None
        try:
            with get_client(sync_client=True) as client:
                document = client.read_block_document(doc_id, include_secrets=True)
        except ObjectNotFound:
            return None
        value = document.data.get("value")
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        try:
            parsed = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None

    @staticmethod
    def _delete(doc_id: UUID | None) -> None:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        if doc_id is None:
            return
        try:
            with get_client(sync_client=True) as client:
                client.delete_block_document(doc_id)
        except ObjectNotFound:
            pass  # gone already (another writer's clean-up)
