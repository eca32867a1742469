"""provider="local": the one field it reads beyond the pool's shape; the model is also its part of
the spec (skytasks/providers/settings_model.py).

`ready_timeout_seconds`: local processes start in milliseconds, so it bounds only how long a
process waits in line for a warm pool that another process holds (skytasks.controller.warm)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from skytasks.providers.remote_fields import ReadyTimeout
from skytasks.providers.settings_model import ProviderSettingsModel, ProviderTag


class LocalSettings(ProviderSettingsModel):
    """local: processes on this machine."""

    model_config = ConfigDict(title="local")

    provider: ProviderTag[Literal["local"]] = "local"
    ready_timeout_seconds: ReadyTimeout = Field(
        900, description="Seconds a process waits in line for a warm pool another process holds.")


LocalSpec = LocalSettings  # (its old name: the settings are the spec)
