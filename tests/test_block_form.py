"""The GPU Pool block's form (issue 54): the pool's common fields and a choice of provider, then that
provider's settings only; a misspelt field is an error naming the nearest one; the contract's flat
keywords stay shorthand for the settings. What Prefect's UI draws is read off the schema here (the
DOM count against a real server is scripts/ and tests of the UI's own)."""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr

from skytasks import GPUPool, PoolConfigError
from skytasks.blocks.pool_settings import FLAT, SETTINGS, LocalSettings
from skytasks.providers.registry import PROVIDERS, plugin
from skytasks.providers.ssh.spec import SSHSettings

FORM_BOUND = 15  # fields a person sees before choosing a provider


def _schema() -> dict:
    return GPUPool.model_json_schema()


def test_before_a_provider_is_chosen_the_form_shows_the_common_fields_and_the_choice():
    schema = _schema()
    common = set(schema["properties"])
    assert "settings" in common and not common & (set(FLAT) - {"kubernetes_credentials"})
    local_tab = set(schema["definitions"]["LocalSettings"]["properties"])
    assert local_tab == set(plugin("local").reads)
    assert len(common) + len(local_tab) <= FORM_BOUND, sorted(common)
    assert schema["properties"]["settings"]["default"]["provider"] == "local"  # the local tab, chosen


def test_the_provider_choice_is_a_plain_union_of_one_model_per_provider_in_table_order():
    schema = _schema()
    choice = schema["properties"]["settings"]
    refs = [option["$ref"].rsplit("/", 1)[1] for option in choice["anyOf"]]
    assert refs == [model.__name__ for model in SETTINGS.values()]
    assert [schema["definitions"][r]["title"] for r in refs] == list(PROVIDERS)  # the tabs' names
    assert "discriminator" not in json.dumps(schema)  # a discriminated union renders as a raw JSON box


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_after_choosing_a_provider_the_form_shows_its_settings_and_no_other(provider):
    shown = set(_schema()["definitions"][SETTINGS[provider].__name__]["properties"])
    reads = set(plugin(provider).reads) - set(GPUPool.model_fields)  # the credentials blocks are the pool's
    assert shown == reads  # and no "Provider" select of one choice: the tab already chose it
    assert SETTINGS[provider].model_fields["provider"].default == provider  # a saved document still says it


def test_optional_fields_show_an_input_not_a_type_or_null_toggle():
    schema = _schema()
    places = {"GPUPool": schema["properties"], **{m.__name__: schema["definitions"][m.__name__]["properties"]
                                                 for m in SETTINGS.values()}}
    toggles = [f"{where}.{name}" for where, props in places.items() for name, prop in props.items()
               if any(option.get("type") == "null" for option in prop.get("anyOf", []))]
    assert toggles == ["GPUPool.kubernetes_credentials"]  # a block picker's own "none"
    assert schema["properties"]["min_nodes"]["type"] == "integer"
    assert GPUPool(min_nodes="", accelerator=" ").min_nodes is None  # a box left empty is unset


def test_secret_fields_are_secret_in_the_schema_and_render_as_secrets():
    schema = _schema()
    assert {"settings.ssh_private_key", "env.*", "aws_credentials.aws_secret_access_key"} <= set(schema["secret_fields"])
    for model in ("SSHSettings", "AWSSettings", "SlurmSettings"):
        key = schema["definitions"][model]["properties"]["ssh_private_key"]
        assert key["format"] == "password" and key["writeOnly"] is True
    pool = GPUPool(env={"TOKEN": "marker-3f1a"}, provider="ssh", hosts=["a", "b"], ssh_private_key="KEY-9c2e")
    shown = repr(pool) + pool.model_dump_json()
    assert "marker-3f1a" not in shown and "KEY-9c2e" not in shown
    assert pool.spec().env["TOKEN"] == "marker-3f1a"  # the ranks get plain strings
    assert "marker-3f1a" not in repr(pool.spec())  # and a spec in a log or an error shows none


def _typo(field: str) -> str:
    return field + field[-1]


TYPOS = [(provider, field) for provider, model in SETTINGS.items()
         for field in [*model.model_fields, *GPUPool.model_fields] if field not in ("provider", "settings")]


@pytest.mark.parametrize("provider, field", TYPOS, ids=[f"{p}-{f}" for p, f in TYPOS])
def test_a_misspelt_field_is_an_error_naming_the_nearest_from_python_and_from_a_document(provider, field):
    typo = _typo(field)
    with pytest.raises(PoolConfigError) as caught:
        GPUPool(provider=provider, **{typo: 1})
    assert str(caught.value) == f"{typo}: no such field; did you mean {field}?"
    document = {"settings": {"provider": provider}, typo: 1}
    if field in SETTINGS[provider].model_fields:  # a saved document's key sits in its settings
        document = {"settings": {"provider": provider, typo: 1}}
    with pytest.raises(PoolConfigError) as caught:
        GPUPool.model_validate(document)
    assert str(caught.value) == f"{typo}: no such field; did you mean {field}?"


def test_the_issue_s_own_typos():
    with pytest.raises(PoolConfigError, match=r"^nodess: no such field; did you mean nodes\?$"):
        GPUPool(provider="local", nodess=3)
    with pytest.raises(PoolConfigError, match=r"^k8s_autoscalr: no such field; did you mean k8s_autoscaler\?$"):
        GPUPool(provider="kubernetes", k8s_image="reg/train:1", k8s_autoscalr="none")
    with pytest.raises(PoolConfigError, match=r"^colour: no such field; this pool takes provider, nodes, min_nodes, "):
        GPUPool(colour="blue")  # nothing near: the fields are listed


FLAT_POOLS = {
    "local": dict(nodes=3, env={"A": "1"}),
    "ssh": dict(nodes=2, hosts=["me@10.0.0.1:2222", "10.0.0.2"], ssh_user="me", ssh_private_key="KEY",
                known_hosts="kh", remote_python="/py", pip_packages=["einops"], ready_timeout_seconds=60),
    "aws": dict(accelerator="L4", instance_type="g6.xlarge", spot=True, key_name="mine", ssh_private_key="KEY",
                tags={"team": "ml"}, idle_minutes=20, max_lifetime_minutes=600, torch_version="2.5.1"),
    "slurm": dict(nodes=4, slurm_partition="gpu", slurm_gres="gpu:h100:8", slurm_extra_args=["--exclusive"],
                  remote_python="python3.11", max_lifetime_minutes=240),
    "kubernetes": dict(k8s_image="reg/train:1", k8s_namespace="ml", k8s_node_selector={"pool": "gpu"},
                       k8s_autoscaler="none", k8s_pods_per_host=2, remote_python="python3"),
}


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_flat_keywords_are_shorthand_for_the_provider_s_settings(provider):
    if provider == "kubernetes":
        pytest.importorskip("prefect_kubernetes")  # a kubernetes pool needs its extra (the Prefect-floor env has none)
    flat = FLAT_POOLS[provider]
    own = {k: v for k, v in flat.items() if k in SETTINGS[provider].model_fields}
    pool = GPUPool(provider=provider, **flat)
    nested = GPUPool(settings=SETTINGS[provider](**own), **{k: v for k, v in flat.items() if k not in own})
    assert type(pool.settings) is SETTINGS[provider] and pool.provider == provider
    assert pool.spec() == nested.spec()
    for name, value in own.items():  # read back by the flat name, as code and tests do
        got = getattr(pool, name)
        assert (got.get_secret_value() if isinstance(got, SecretStr) else got) == value
    assert GPUPool.model_validate(json.loads(pool.model_dump_json(context={"include_secrets": True}))).spec() \
        == pool.spec()


def test_another_provider_s_setting_reads_as_its_default_and_given_is_an_error_naming_it():
    local = GPUPool()
    assert (local.hosts, local.k8s_image, local.max_lifetime_minutes, local.spot) == ([], None, None, False)
    with pytest.raises(PoolConfigError, match=r"^hosts: only provider 'ssh' takes it, not provider='local'"):
        GPUPool(hosts=["a"])
    with pytest.raises(PoolConfigError, match=r"^hosts: only provider 'ssh' takes it, not provider='aws'"):
        GPUPool.model_validate({"settings": {"provider": "aws", "hosts": ["a"]}})
    with pytest.raises(PoolConfigError, match=r"^provider: 'aws', but the settings given are provider 'ssh'"):
        GPUPool(provider="aws", settings=SSHSettings(hosts=["a", "b"]))
    with pytest.raises(AttributeError):
        local.no_such_attribute  # noqa: B018


def test_what_the_form_sends_loads():
    # The form sends the chosen tab's fields, "" for a box left empty, and may leave the tag out.
    pool = GPUPool.model_validate({"settings": {"hosts": ["a", "b"], "ssh_user": "", "remote_python": ""}, "nodes": 2,
                                   "min_nodes": "", "env": {"A": "1"}})
    assert pool.provider == "ssh" and pool.ssh_user is None and pool.min_nodes is None
    assert GPUPool.model_validate({"settings": {}}).provider == "local"
    assert GPUPool.model_validate({"settings": {"slurm_partition": "gpu"}}).provider == "slurm"
    assert isinstance(GPUPool().settings, LocalSettings)


def test_a_provider_setting_set_by_its_flat_name_is_checked_and_leaves_copies_alone():
    pool = GPUPool(provider="ssh", nodes=2, hosts=["a", "b"])
    copy = pool.reshaped(nodes=2)
    pool.hosts = ["c", "d"]
    assert pool.spec().part.hosts == ["c", "d"] and copy.hosts == ["a", "b"]
    with pytest.raises(PoolConfigError, match=r"^hosts: 'two words' is not of the form"):
        pool.hosts = ["two words", "b"]
    with pytest.raises(PoolConfigError, match=r"^k8s_image: only provider 'kubernetes' takes it, not provider='ssh'"):
        pool.k8s_image = "reg/train:1"


def test_a_reshaped_copy_of_a_warm_pool_is_never_warm():
    # A call of another shape gets a copy with a runtime of its own; were it warm, it would take the
    # saved pool's warm nodes (same saved name) for its own shape's, and end them.
    pool = GPUPool(provider="local", nodes=3, keep_warm_minutes=30)
    copy = pool.reshaped(nodes=2)
    assert (copy.nodes, copy.keep_warm_minutes) == (2, 0) and pool.keep_warm_minutes == 30
