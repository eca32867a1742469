"""provider="kubernetes": its own tunables, each with its environment name (`SKYTASKS_<FIELD>`, as
every tunable in skytasks/settings.py), read when used."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from skytasks.settings import read


class KubernetesKnobs(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKYTASKS_", extra="ignore", frozen=True)

    k8s_autoscaler_silence_seconds: float = Field(
        30.0, gt=0, description="kubernetes, k8s_autoscaler='auto': how long a pod may wait for a node with no "
                                "node autoscaler speaking for it before the cluster is taken as fixed.")


def knobs() -> KubernetesKnobs:
    return read(KubernetesKnobs)
