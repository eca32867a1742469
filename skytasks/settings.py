"""Every tunable of the controller, in one place, each with its environment name.

`SKYTASKS_<FIELD>` sets a field (pydantic-settings, as Prefect's own settings are read). They are
read when used, not at import, so a test or a long-lived flow process can change them between
calls. The node side never imports this: the controller hands nodes what they need (agent
arguments, rank environment), so nodes need nothing but the standard library and torch.
"""

from __future__ import annotations

import functools
import os
from typing import Literal, TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SkytasksSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKYTASKS_", extra="ignore", frozen=True)  # shared (see settings())

    heartbeat_seconds: float = Field(5.0, gt=0, description="Both ends of a node stream send a heartbeat this often.")
    heartbeat_timeout_seconds: float = Field(
        60.0, gt=0, description="Either end gives the other up after this much silence (at least 2 heartbeats).")
    init_timeout_seconds: float = Field(
        120.0, gt=0, description="How long ranks may wait for their peers in init_process_group.")
    stop_grace_seconds: float = Field(
        1.0, gt=0, description="How long a stopped rank gets between SIGTERM and SIGKILL (it dumps its stack first).")
    close_grace_seconds: float = Field(
        5.0, gt=0, description="How long ranks get to leave a closed group cleanly before they are killed.")
    stop_confirm_seconds: float = Field(
        10.0, gt=0, description="How long stopped ranks may take to be confirmed gone before a call returns anyway.")
    resource_sample_seconds: float = Field(
        5.0, gt=0, description="How often each node agent samples its ranks' CPU, memory and GPU.")
    teardown_wait_seconds: float = Field(
        60.0, gt=0, description="How long a teardown waits for SLURM jobs to leave the queue before it reports them.")
    grow_retry_seconds: float = Field(
        60.0, ge=0, description="After an elastic pool could not grow back, how long before a call tries again.")
    straggler_warn_seconds: float = Field(
        60.0, ge=0, description="Ranks still running this long after another returned get one WARNING naming "
                                "where each is (0: never).")
    line_backlog: int = Field(
        100_000, gt=0, description="Output and log lines the controller holds waiting for the record; past it, "
                                   "lines are dropped and counted per rank (said as LinesDropped).")
    rank_start: Literal["fork", "exec"] = Field(
        "fork", description="How a node starts its ranks: forked from one warm template process per node "
                            "(milliseconds each), or each as a fresh interpreter (exec).")
    workdir_limit_mb: float = Field(100.0, gt=0, description="Largest workdir that may travel to remote nodes.")
    peer_tls: bool = Field(
        True, description="TLS on the relay links between node agents. Off (0) only to measure what it costs: "
                          "the links then carry the pool's arguments in the clear.")

    @property
    def heartbeat(self) -> tuple[float, float]:
        """(interval, timeout), the timeout never under two intervals."""
        return self.heartbeat_seconds, max(self.heartbeat_timeout_seconds, 2 * self.heartbeat_seconds)


Knobs = TypeVar("Knobs", bound=BaseSettings)


def settings() -> SkytasksSettings:
    """The settings as the environment has them now. Built again only when a SKYTASKS_ variable
    changed: pydantic-settings takes a millisecond or more, and a call reads them several times."""
    return read(SkytasksSettings)


def read(kind: type[Knobs]) -> Knobs:
    """Settings of `kind` (these, or a provider's own knobs: its folder's settings.py) as the
    environment has them now, built again only when a SKYTASKS_ variable changed."""
    ours = tuple(sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("SKYTASKS_")))
    return _settings_for(kind, ours)  # type: ignore[return-value]


@functools.lru_cache(maxsize=16)
def _settings_for(kind: type[BaseSettings], environment: tuple[tuple[str, str], ...]) -> BaseSettings:
    return kind()
