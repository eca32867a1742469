"""A pool saved before the provider settings had models of their own (a flat document: every field of
every provider at the top) still loads, and gives the pool it gave. The documents in
tests/data/gpu_pool_v1.json were saved to a real Prefect API by the block as it was at the commit
they name (tests/data/save_gpu_pool_v1.py, run with that commit's code), with the block schema
they were saved under and the PoolSpec repr that code made of each."""

from __future__ import annotations

import ast
import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import BlockDocumentCreate, BlockSchemaCreate
from prefect.exceptions import ObjectAlreadyExists

from skytasks import GPUPool, PoolConfigError
from skytasks.blocks.pool_settings import SETTINGS
from skytasks.pool_spec import PoolSpec

SAVED = json.loads((Path(__file__).parent / "data" / "gpu_pool_v1.json").read_text())
POOLS = sorted(SAVED["pools"])


def _comparable(spec: PoolSpec) -> PoolSpec:
    """A spec whose nested credential blocks compare by their fields (a loaded block carries
    Prefect's private bookkeeping a made one lacks, and, under an older prefect-aws than saved
    the document, the newer one's fields as extras)."""
    creds = spec.credentials
    if creds is not None:
        creds = creds.model_dump(include=set(type(creds).model_fields))
    return dataclasses.replace(spec, credentials=creds, name="pool")


# The released spec's part was a dataclass of its own, some of whose names the settings spell with
# their provider's prefix (slurm's `partition` is `slurm_partition`), and a few values it derived
# from the pool's shape: how today's spec says each (the settings model is the part now).
PREFIXES = {"slurm": "slurm_", "kubernetes": "k8s_"}
DERIVED: dict[str, Callable[[PoolSpec], Any]] = {
    "accelerator": lambda spec: spec.accelerator,
    "accelerators_per_node": lambda spec: spec.accelerators_per_node,
    "nodes": lambda spec: spec.nodes,
    "login": lambda spec: spec.part.slurm_login,  # type: ignore[attr-defined]
    "gres": lambda spec: spec.part.gres_for(spec),  # type: ignore[attr-defined]
    "gpus": lambda spec: spec.part.gpus_for(spec),  # type: ignore[attr-defined]
}


def _today(spec: PoolSpec, name: str) -> Any:
    """What today's spec says for a field of the released spec's part."""
    if spec.provider == "kubernetes" and name == "remote_python":
        return spec.part.python  # type: ignore[attr-defined]  # (the released part held the default)
    if name in DERIVED:
        return DERIVED[name](spec)
    own = name if name in type(spec.part).model_fields else PREFIXES[spec.provider] + name  # type: ignore[attr-defined]
    return getattr(spec.part, own)


def _as_released(value: Any) -> Any:
    """A value as the released part held it: its sequences as tuples."""
    if isinstance(value, list):
        return tuple(_as_released(v) for v in value)
    return value


def _part_matches(spec: PoolSpec, before: ast.Call) -> None:
    for kw in before.keywords:
        assert kw.arg is not None
        if kw.arg == "credentials":  # compared as blocks by the tests below (their fields differ by version)
            continue
        today = _today(spec, kw.arg)
        if isinstance(kw.value, ast.Call):  # a secret, shown masked
            assert repr(today) == ast.unparse(kw.value), kw.arg
            continue
        released = ast.literal_eval(kw.value)
        if isinstance(today, dict) and isinstance(released, tuple):  # the node selector, as sorted pairs
            today = tuple(sorted(today.items()))
        assert _as_released(today) == released, kw.arg


def _needs_its_extra(name: str) -> None:
    if name == "kubernetes":
        pytest.importorskip("prefect_kubernetes")  # a kubernetes pool needs its extra (the Prefect-floor env has none)


def _made_today(name: str) -> GPUPool:
    return GPUPool(**SAVED["pools"][name]["kwargs"])


@pytest.mark.parametrize("name", POOLS)
def test_the_contract_s_keywords_make_the_spec_they_made_before(name):
    _needs_its_extra(name)
    spec, before = _made_today(name).spec(), SAVED["pools"][name]["spec_repr"]
    call = ast.parse(before, mode="eval").body
    assert isinstance(call, ast.Call)
    for kw in call.keywords:  # the pool's shape, as it was (fields added since are left out)
        if kw.arg == "part":
            if isinstance(kw.value, ast.Call):  # (a local pool's own part came after these were saved)
                _part_matches(spec, kw.value)
        else:
            assert getattr(spec, str(kw.arg)) == ast.literal_eval(kw.value), kw.arg
    assert type(spec.part) is SETTINGS[name]  # the pool's settings are its part


@pytest.mark.parametrize("name", POOLS)
def test_a_flat_document_saved_before_the_change_validates_to_the_same_pool(name):
    _needs_its_extra(name)
    data = SAVED["pools"][name]["data"]
    assert "settings" not in data and "provider" in data  # the old form, not one made today
    loaded = GPUPool.model_validate(data)
    assert loaded.provider == SAVED["pools"][name]["kwargs"]["provider"]
    assert _comparable(loaded.spec()) == _comparable(_made_today(name).spec())


def _old_schema_id(client, block_type_id):
    schema = SAVED["schema"]
    try:
        return client.create_block_schema(BlockSchemaCreate(
            fields=schema["fields"], block_type_id=block_type_id, capabilities=schema["capabilities"],
            version=schema["version"])).id
    except ObjectAlreadyExists:
        return client.read_block_schema_by_checksum(schema["checksum"], version=schema["version"]).id


def _store(name: str, data: dict, schema_id=None) -> str:
    """A block document of the gpu-pool type, stored as Prefect stores one (under the old schema,
    or today's), returned by the name it was stored as."""
    GPUPool.register_type_and_schema()
    stored = f"{name}-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        block_type = client.read_block_type_by_slug("gpu-pool")
        schema_id = schema_id or _old_schema_id(client, block_type.id)
        client.create_block_document(BlockDocumentCreate(name=stored, data=data, block_schema_id=schema_id,
                                                         block_type_id=block_type.id))
    return stored


@pytest.mark.parametrize("name", POOLS)
def test_a_pool_saved_before_the_change_loads_from_the_api_and_saves_in_today_s_form(name):
    _needs_its_extra(name)
    stored = _store(name, SAVED["pools"][name]["data"])
    loaded = GPUPool.load(stored)
    assert loaded.saved_name == stored
    assert _comparable(loaded.spec()) == _comparable(_made_today(name).spec())
    kwargs = SAVED["pools"][name]["kwargs"]
    if "ssh_private_key" in kwargs:  # its secrets came back whole
        assert loaded.ssh_private_key.get_secret_value() == kwargs["ssh_private_key"]
    assert loaded.spec().env == {**_made_today(name).spec().env}

    loaded.save(stored, overwrite=True)  # saved again: today's form, its secrets secret
    with get_client(sync_client=True) as client:
        shown = client.read_block_document_by_name(stored, "gpu-pool", include_secrets=False).data
    assert shown["settings"]["provider"] == kwargs["provider"]
    for value in kwargs.get("env", {}).values():  # env values obfuscated, now that env is secret
        assert json.dumps(value) not in json.dumps(shown["env"]), shown["env"]
    if "ssh_private_key" in kwargs:
        assert kwargs["ssh_private_key"] not in json.dumps(shown)
    assert _comparable(GPUPool.load(stored).spec()) == _comparable(loaded.spec())


def test_a_misspelt_key_in_a_saved_document_is_an_error_naming_it():
    flat = {**SAVED["pools"]["local"]["data"], "nodess": 3}
    with pytest.raises(PoolConfigError, match=r"^nodess: no such field; did you mean nodes\?$"):
        GPUPool.load(_store("typo-flat", flat))
    GPUPool.register_type_and_schema()
    today = GPUPool._block_schema_id
    nested = {"settings": {"provider": "slurm", "slurm_partitio": "gpu"}}
    with pytest.raises(PoolConfigError, match=r"^slurm_partitio: no such field; did you mean slurm_partition\?$"):
        GPUPool.load(_store("typo-nested", nested, schema_id=today))


def test_a_pool_saved_over_a_flat_one_is_what_its_settings_say():
    # Prefect's update merges the stored data's top level: the flat document's keys stay beside
    # the new settings, and must neither win over them nor show a secret.
    old = SAVED["pools"]["aws"]
    stored = _store("over", old["data"])
    GPUPool(provider="ssh", nodes=2, hosts=["a", "b"], ssh_private_key="NEW-KEY").save(stored, overwrite=True)
    with get_client(sync_client=True) as client:
        shown = client.read_block_document_by_name(stored, "gpu-pool", include_secrets=False).data
    assert shown["provider"] == "aws" and shown["instance_type"] == "g5.xlarge"  # the merge this is about
    assert old["kwargs"]["ssh_private_key"] not in json.dumps(shown) and "NEW-KEY" not in json.dumps(shown)
    loaded = GPUPool.load(stored)
    assert loaded.provider == "ssh" and loaded.hosts == ["a", "b"]
    assert loaded.ssh_private_key.get_secret_value() == "NEW-KEY" and loaded.instance_type is None
