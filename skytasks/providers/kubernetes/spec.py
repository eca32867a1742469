"""provider="kubernetes": its settings (`KubernetesSettings`: the pods' image, namespace, scheduling
and resources) and the cluster's credentials field, their validation; the model is also its part of the
spec (skytasks/providers/settings_model.py), and the pool's credentials block is `PoolSpec.credentials`.

The credentials field holds prefect-kubernetes' `KubernetesCredentials` block (`pip install
"skytasks[kubernetes]"`), so a saved pool refers to a saved credentials block as Prefect's own blocks
do. Its type names the block lazily: prefect-kubernetes (with its worker and both Kubernetes
clients, over a thousand modules) is imported when credentials are given, a kubernetes pool is
made, or the block's schema is made, never by a pool of another provider. Without the extra, a
kubernetes pool is refused naming it.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError, field_validator

# (the block's own schema is given the real class: blocks/gpu_pool.py, from the plugin's `block_fields`)
from skytasks.providers.kubernetes import CREDENTIALS_BLOCK
from skytasks.providers.remote_fields import (IdleMinutes, MaxLifetime, OptionalInt, OptionalStr, ReadyTimeout,
                                              RemotePython)
from skytasks.providers.settings_model import ProviderSettingsModel, ProviderTag

EXTRA = 'pip install "skytasks[kubernetes]"'

# A DNS-1123 label (namespaces, service accounts and Secrets are named so), and a resource quantity.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
# Each name-like setting: the pattern it matches, and what it is said not to be otherwise.
_NAMES = {
    "k8s_namespace": (_DNS_LABEL, "is not a Kubernetes namespace name (lower-case letters, digits and '-', at most 63)"),
    "k8s_service_account": (_DNS_SUBDOMAIN, "is not a Kubernetes object name"),
    "k8s_queue": (_DNS_SUBDOMAIN, "is not a Kubernetes object name"),
    "k8s_priority_class": (_DNS_SUBDOMAIN, "is not a Kubernetes object name"),
    "k8s_gpu_label": (_LABEL_KEY, "is not a node label key (such as 'example.com/gpu-type')"),
}

def credentials_block_class() -> Any:
    """prefect-kubernetes' KubernetesCredentials block class, imported now; None without the extra."""
    module, _, name = CREDENTIALS_BLOCK.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def _as_credentials_block(value: Any) -> Any:
    """A KubernetesCredentials block from what was given: a block, or its fields (as a saved pool's
    document holds them). Without the extra, the value as given: the field is another provider's
    then, or a kubernetes pool is refused naming the extra."""
    block = None if value is None else credentials_block_class()
    if block is None:
        return value
    if isinstance(value, dict) and value.get("block_type_slug") == block.get_block_type_slug():
        # (a saved pool's: by its slug Prefect would look the class up, importing every collection)
        value = {k: v for k, v in value.items() if k != "block_type_slug"}
    try:
        return block.model_validate(value)
    except ValidationError as exc:  # said as the block's own errors are said where its type is known
        raise ValueError("; ".join(_said(e) for e in exc.errors())) from None


def _said(error: Any) -> str:
    """One error of the credentials block as `kubernetes_credentials.PART: what (got value)`."""
    where = ".".join(("kubernetes_credentials", *map(str, error["loc"])))
    got = f" (got {error['input']!r})" if error["type"] != "missing" and not isinstance(error["input"], dict) else ""
    return f"{where}: {error['msg']}{got}"


if TYPE_CHECKING:
    from prefect_kubernetes.credentials import KubernetesCredentials as CredentialsBlock

    from skytasks.pool_spec import PoolSpec
else:
    CredentialsBlock = Annotated[Any, BeforeValidator(_as_credentials_block)]


class KubernetesSettings(ProviderSettingsModel):
    """kubernetes: one pod per node in a Kubernetes cluster, created and deleted by the pool."""

    model_config = ConfigDict(title="kubernetes")

    provider: ProviderTag[Literal["kubernetes"]] = "kubernetes"
    k8s_image: OptionalStr = Field(
        None, description="The image of every pod (Python with torch and cloudpickle); required.")
    k8s_namespace: str = Field("default", description="The namespace of the pool's pods.")
    k8s_service_account: OptionalStr = Field(None, description="The pods' service account.")
    k8s_image_pull_secrets: list[str] = Field(default_factory=list, description="Names of Secrets for pulling the image.")
    k8s_node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    k8s_tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations, as in a pod spec.")
    k8s_cpu: OptionalStr = Field(None, description='Each pod\'s CPU (request and limit), e.g. "8".')
    k8s_memory: OptionalStr = Field(None, description='Each pod\'s memory (request and limit), e.g. "64Gi".')
    k8s_shm_size: OptionalStr = Field(None, description="The cap of every pod's memory-backed /dev/shm.")
    k8s_pod_template: dict[str, Any] = Field(
        default_factory=dict, description="A partial pod manifest merged into every pod the pool makes.")
    k8s_autoscaler: Literal["auto", "none", "wait"] = Field(
        "auto", description="A pod no node can take yet: 'auto' waits while a node autoscaler adds one (and fails "
        "when it says it will not); 'none': a fixed cluster, fail at once; 'wait': wait to the timeout.")
    k8s_gpu_label: OptionalStr = Field(
        None, description="The node label naming the GPU product, when the cluster uses one skytasks does not know.")
    k8s_pods_per_host: OptionalInt = Field(
        None, ge=1, description="How many of the pool's pods may share a Kubernetes node; empty: 1 with an "
        "accelerator, else no limit.")
    k8s_queue: OptionalStr = Field(None, description="A Kueue LocalQueue that admits the pool's pods as one group.")
    k8s_priority_class: OptionalStr = Field(None, description="The pods' priorityClassName.")
    remote_python: RemotePython = None
    ready_timeout_seconds: ReadyTimeout = 900
    idle_minutes: IdleMinutes = 15
    max_lifetime_minutes: MaxLifetime = None

    @field_validator(*_NAMES)
    @classmethod
    def _a_name(cls, value: Optional[str], info: Any) -> Optional[str]:
        pattern, said = _NAMES[info.field_name]
        if value is not None and not pattern.match(value):
            raise ValueError(f"{info.field_name}: {value!r} {said}")
        return value

    @field_validator("k8s_image_pull_secrets")
    @classmethod
    def _secrets_are_names(cls, names: list[str]) -> list[str]:
        for n in names:
            if not _DNS_SUBDOMAIN.match(n):
                raise ValueError(f"k8s_image_pull_secrets: {n!r} is not a Secret's name")
        return names

    @field_validator("k8s_cpu", "k8s_memory", "k8s_shm_size")
    @classmethod
    def _quantity(cls, value: Optional[str], info: Any) -> Optional[str]:
        if value is not None and not _QUANTITY.match(str(value).strip()):
            raise ValueError(f"{info.field_name}: {value!r} is not a Kubernetes quantity (such as \"8\", \"500m\", "
                             "\"64Gi\")")
        return None if value is None else str(value).strip()

    @field_validator("k8s_tolerations")
    @classmethod
    def _tolerations(cls, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for t in items:
            unknown = set(t) - _TOLERATION_KEYS
            if unknown:
                raise ValueError(f"k8s_tolerations: {sorted(unknown)} are not fields of a toleration (known: "
                                 f"{', '.join(sorted(_TOLERATION_KEYS))})")
        return items

    @field_validator("k8s_pod_template")
    @classmethod
    def _template_is_a_pod(cls, template: dict[str, Any]) -> dict[str, Any]:
        unknown = set(template) - {"metadata", "spec", "apiVersion", "kind"}
        if unknown:
            raise ValueError(f"k8s_pod_template: {sorted(unknown)} are not parts of a pod manifest (metadata, spec)")
        spec = template.get("spec", {})
        if not isinstance(spec, dict):
            raise ValueError("k8s_pod_template: spec must be a mapping, as in a pod manifest")
        containers = spec.get("containers", [])
        if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
            raise ValueError("k8s_pod_template: spec.containers must be a list of container mappings")
        return template

    def check_pool(self, pool: PoolSpec) -> None:
        try:  # the client and the credentials block: a kubernetes pool is the one that needs them
            import kubernetes  # noqa: F401
        except ImportError:
            raise ValueError(f"provider: provider='kubernetes' needs its extra: {EXTRA}") from None
        if credentials_block_class() is None:
            raise ValueError(f"provider: provider='kubernetes' needs its extra: {EXTRA}")
        if not self.k8s_image:
            raise ValueError("k8s_image: provider='kubernetes' needs the image every pod runs (Python with torch and "
                             "cloudpickle; skytasks itself arrives from the controller)")

    @property
    def python(self) -> str:
        """The pods' Python: remote_python, else python3."""
        return self.remote_python or "python3"

    @staticmethod
    def gpus_for(pool: PoolSpec) -> int:
        """nvidia.com/gpu per pod: the pool's accelerators per node, none without an accelerator."""
        return (pool.accelerators_per_node or 1) if pool.accelerator else 0

    def per_host_for(self, pool: PoolSpec) -> Optional[int]:
        """The most pods of the pool on one Kubernetes node (None: no limit): k8s_pods_per_host, else
        1 with an accelerator."""
        return self.k8s_pods_per_host if self.k8s_pods_per_host is not None else (1 if pool.accelerator else None)


KubernetesSpec = KubernetesSettings  # (its old name: the settings are the spec)
