"""One provider seam: each provider is a folder with a spec (its settings model: its block fields,
their checks, and as it is its part of the PoolSpec) and a class that declares `NodeProvider`; the
registry is one table."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from skytasks import GPUPool, PoolConfigError
from skytasks.providers import SHAPE_FIELDS, NodeProvider
from skytasks.providers.settings_model import ProviderSettingsModel
from skytasks.providers.registry import PROVIDERS, provider_class, readers_of_fields

# A value other than the block's default, for every provider-specific field.
SET = {"hosts": ["a", "b"], "ssh_user": "me", "ssh_private_key": "k", "known_hosts": "kh", "remote_python": "py",
       "pip_packages": ["x"], "ready_timeout_seconds": 5, "idle_minutes": 3, "max_lifetime_minutes": 9,
       "slurm_login": "login", "slurm_partition": "gpu", "slurm_account": "a", "slurm_qos": "q",
       "slurm_constraint": "c", "slurm_gres": "gpu:1", "slurm_extra_args": ["--exclusive"], "torch_version": "2.5",
       "torch_cuda": "cu121", "torchvision": "0.20", "torchaudio": "2.5", "instance_type": "t3.micro",
       "image_id": "ami-1", "subnet_id": "subnet-1", "security_group_ids": ["sg-1"], "key_name": "mine", "spot": True,
       "root_volume_gb": 50, "iam_instance_profile": "role", "tags": {"team": "x"}, "ssh_ingress_cidr": "10.0.0.0/8",
       "k8s_namespace": "ml", "k8s_image": "reg/train:1", "k8s_service_account": "trainer",
       "k8s_image_pull_secrets": ["regcred"], "k8s_node_selector": {"pool": "gpu"},
       "k8s_tolerations": [{"key": "gpu", "operator": "Exists"}], "k8s_cpu": "8", "k8s_memory": "64Gi",
       "k8s_shm_size": "8Gi", "k8s_pod_template": {"metadata": {"labels": {"team": "x"}}}, "k8s_autoscaler": "none",
       "k8s_gpu_label": "example.com/gpu", "k8s_pods_per_host": 2, "k8s_queue": "team-a",
       "k8s_priority_class": "training"}


def _credentials():
    from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

    return KubernetesCredentials(cluster_config=KubernetesClusterConfig(config={"clusters": []}, context_name="c"))


SET["kubernetes_credentials"] = _credentials()
FOREIGN = [(field, name) for field, readers in readers_of_fields().items() for name in PROVIDERS if name not in readers]


def test_the_table_names_every_provider_once_and_each_class_declares_the_protocol():
    assert list(PROVIDERS) == ["local", "ssh", "aws", "slurm", "kubernetes"]
    for name in PROVIDERS:
        cls = provider_class(name)
        assert NodeProvider in cls.__mro__, name  # declared, so a type checker holds it to the protocol
        assert isinstance(cls.reshape_is_cheap, bool) and isinstance(cls.runs_on_this_machine, bool)


def test_every_block_field_is_the_shape_or_read_by_some_provider():
    readers = readers_of_fields()
    # The provider's own fields sit in the block's `settings`; each keeps its flat keyword.
    from skytasks.blocks.pool_settings import FLAT

    assert (set(GPUPool.model_fields) - {"settings"}) | set(FLAT) | {"provider"} == set(SHAPE_FIELDS) | set(readers)
    assert not set(SHAPE_FIELDS) & set(readers)
    assert set(SET) == set(readers)  # the table below covers every provider-specific field


@pytest.mark.parametrize("field, provider", FOREIGN, ids=[f"{f}-on-{p}" for f, p in FOREIGN])
def test_a_field_of_another_provider_is_a_pool_config_error_naming_it(field, provider):
    fields = {"provider": provider, field: SET[field]}
    if provider == "ssh":
        fields["hosts"] = ["a", "b"]
    if provider == "aws" and field != "ssh_private_key":
        fields["ssh_private_key"] = "k"
    if provider == "kubernetes" and field != "k8s_image":
        fields["k8s_image"] = "reg/train:1"
    with pytest.raises(PoolConfigError) as caught:
        GPUPool(**fields)
    assert str(caught.value).startswith(f"{field}: only provider "), str(caught.value)
    assert f"not provider={provider!r}" in str(caught.value)


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_each_provider_takes_every_field_it_reads(provider):
    reads = [f for f, readers in readers_of_fields().items() if provider in readers]
    fields = {"provider": provider, "nodes": 2, **{f: SET[f] for f in reads}}
    if provider == "slurm":
        fields["known_hosts"] = "kh"  # slurm_login needs it
    pool = GPUPool(**fields)
    spec = pool.spec()
    # Every provider, local too (its ready_timeout_seconds), has a part: the pool's settings model,
    # frozen, each setting spelled once (no second dataclass, no flat-name round trip).
    assert spec.part is pool.settings and isinstance(spec.part, ProviderSettingsModel)
    for f in reads:
        if f in type(spec.part).model_fields:
            assert getattr(spec.part, f) == getattr(pool, f), f
    with pytest.raises(ValidationError, match="frozen"):
        spec.part.ready_timeout_seconds = 1  # type: ignore[attr-defined]
    # The credentials block the provider's client is made with, handed over as the spec's own.
    credentials = PROVIDERS[provider].credentials
    assert spec.credentials is (None if credentials is None else getattr(pool, credentials))
    assert (provider in ("aws", "kubernetes")) == (spec.credentials is not None)


def test_a_local_pool_imports_no_other_providers_code_or_ssh_library():
    # (boto3 comes with the block's AwsCredentials field, from prefect-aws, for every provider)
    code = ("import sys; from skytasks import GPUPool; GPUPool(nodes=2).spec(); "
            "print(sorted(m for m in ('asyncssh', 'skytasks.providers.aws.provider', "
            "'skytasks.providers.ssh.nodes', 'skytasks.providers.slurm.provider', "
            "'skytasks.providers.kubernetes.provider') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_each_provider_states_what_it_can_do_as_one_frozen_value():
    import dataclasses

    from skytasks.providers import CAPABILITIES, Capabilities, capabilities_of

    for name in PROVIDERS:
        cls = provider_class(name)
        assert isinstance(cls.capabilities, Capabilities), name
        assert {f: getattr(cls, f) for f in CAPABILITIES} == dataclasses.asdict(cls.capabilities)  # one source
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls.capabilities.reattaches = True  # type: ignore[misc]
    assert provider_class("local").capabilities == Capabilities(reshape_is_cheap=True, runs_on_this_machine=True)
    assert provider_class("aws").capabilities.replaces_elsewhere and provider_class("ssh").capabilities.reattaches

    class Reattaching(provider_class("local")):  # type: ignore[misc,valid-type]  # a test's variant says one
        reattaches = True

    assert Reattaching.capabilities == Capabilities(reshape_is_cheap=True, runs_on_this_machine=True, reattaches=True)
    assert capabilities_of(object()) == Capabilities()  # a stand-in that says none can do none of them


def test_settings_and_gc_are_each_provider_s_own_from_its_plugin():
    from skytasks.blocks.pool_settings import SETTINGS
    from skytasks.providers.registry import imported

    for name, p in PROVIDERS.items():
        assert p.settings is not None and SETTINGS[name] is imported(p.settings)
        own = [f for f in SETTINGS[name].model_fields if f != "provider"]
        assert [f for f in p.reads if f != "kubernetes_credentials"] == own  # the fields, named once
    assert {name for name, p in PROVIDERS.items() if p.gc} == {"aws", "slurm", "kubernetes"}
    assert all(callable(imported(p.gc)) for p in PROVIDERS.values() if p.gc)
