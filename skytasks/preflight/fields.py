"""The pool's preflight fields as the `GPUPool` block holds them.

The contract's keywords are flat (`preflight_min_ratio=0.6`), but Prefect's form shows at most
about 15 fields before a provider is chosen: the four thresholds are one nested model in the form
(`preflight_limits`, one box), and the flat keywords and attributes map onto it, as a provider's
flat keywords map onto its settings. Their checks, naming each field, are `PoolSpec`'s.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

Level = Literal["off", "basic", "full"]


class PreflightLimits(BaseModel):
    """For `preflight="full"`: when a node counts as unhealthy, and how long the checks may take."""

    model_config = ConfigDict(extra="forbid", title="Preflight limits")

    preflight_timeout_seconds: float = Field(60, description="How long the checks may take before the nodes "
                                             "that did not answer are named.")
    preflight_min_ratio: float = Field(0.5, description='"full": a node below this share of the pool\'s median '
                                       "figure is unhealthy.")
    preflight_min_tflops: Optional[float] = Field(None, description='"full": the least matmul TFLOPS per rank; '
                                                  "empty: no floor.")
    preflight_min_gbps: Optional[float] = Field(None, description='"full": the least collective bandwidth (GB/s) '
                                                "within a node and between nodes; empty: no floor.")


FLAT_LIMITS = tuple(PreflightLimits.model_fields)
# How the block's form shows the limits: one JSON box of these keys (a nested model's schema would
# put four more inputs on the form before a provider is chosen).
LIMITS_BOX = {"type": "object", "title": "Preflight limits", "additionalProperties": True,
              "description": "Keys: " + ", ".join(FLAT_LIMITS) + "."}


def fold_flat_limits(data: dict[str, Any]) -> dict[str, Any]:
    """A pool's input with its flat `preflight_*` keywords moved into `preflight_limits`."""
    flat = {k: data[k] for k in FLAT_LIMITS if k in data}
    if not flat:
        return data
    rest = {k: v for k, v in data.items() if k not in flat}
    given = rest.get("preflight_limits")
    base = given.model_dump() if isinstance(given, BaseModel) else dict(given or {})
    return {**rest, "preflight_limits": {**base, **flat}}
