"""The settings that more than one provider reads (how to log in to a node, which Python runs
there, how long a node may take to come up or sit idle), as annotated types each provider's
settings model (`skytasks/providers/<name>/spec.py`) declares. A provider takes those its model has;
set on a pool whose provider does not, one is a PoolConfigError naming it.

Also the lease that the providers whose resources can outlive their controller (aws, slurm) write
on them for `skytasks gc`: see `lease_expiry` and `Lease`."""

from __future__ import annotations

import re
import threading
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Callable, Optional

from pydantic import BeforeValidator, Field, SecretStr, WithJsonSchema

HOST_PATTERN = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>\d{1,5}))?$")


def blank_is_none(value: Any) -> Any:
    """An empty input of an optional field (Prefect's form sends "" for a box left empty) means unset."""
    return None if isinstance(value, str) and not value.strip() else value


def shown_as(json_type: str) -> WithJsonSchema:
    """An optional field's form input, without Prefect's "type | null" toggle: the box, left empty,
    is None (the field's description says what None means)."""
    return WithJsonSchema({"type": json_type})


OptionalStr = Annotated[Optional[str], BeforeValidator(blank_is_none), shown_as("string")]
OptionalInt = Annotated[Optional[int], BeforeValidator(blank_is_none), shown_as("integer")]
OptionalFloat = Annotated[Optional[float], BeforeValidator(blank_is_none), shown_as("number")]

# The fields more than one provider reads, as each provider's settings model declares them (a
# provider takes those its model has): one definition, so ssh, aws and slurm agree.
SSHUser = Annotated[OptionalStr, Field(description="The user the pool logs in as (slurm: on slurm_login).")]
SSHPrivateKey = Annotated[Optional[SecretStr], BeforeValidator(blank_is_none), WithJsonSchema(
    {"type": "string", "format": "password", "writeOnly": True}), Field(
    description="Private key (PEM/OpenSSH text) the pool logs in with; stored encrypted, shown obfuscated.")]
KnownHosts = Annotated[OptionalStr, Field(description="known_hosts text or path; host keys are always checked.")]
RemotePython = Annotated[OptionalStr, Field(
    description='Python on the nodes; empty: "python3" (aws: the venv its bootstrap builds).')]
PipPackages = Annotated[list[str], Field(description="Extra packages installed on launched nodes.")]
ReadyTimeout = Annotated[float, Field(gt=0, description="Seconds launched nodes may take to become reachable.")]
IdleMinutes = Annotated[float, Field(gt=0, description="Launched nodes end after their controller is silent this long.")]
MaxLifetime = Annotated[Optional[Annotated[float, Field(gt=0)]], BeforeValidator(blank_is_none), shown_as("number"),
                        Field(description="Launched nodes end at this age; empty (default): no cap, idle_minutes "
                              "still ends orphans.")]


def host_field(field: str, text: str) -> str:
    """`[user@]host[:port]`, stripped, or a ValueError naming the field."""
    m = HOST_PATTERN.match(text.strip())
    if not m or (m["port"] and not 0 < int(m["port"]) < 65536):
        raise ValueError(f"{field}: {text!r} is not of the form [user@]host[:port]")
    return text.strip()


def renew_every_seconds(idle_minutes: float) -> float:
    """How often a live controller renews its pool's lease: a third of the idle limit, between 5 s
    and 5 minutes (a 15-minute idle limit: every 5 minutes)."""
    return min(300.0, max(5.0, idle_minutes * 60 / 3))


def lease_expiry(now: datetime, started_at: datetime, idle_minutes: float,
                 max_lifetime_minutes: Optional[float]) -> datetime:
    """The `skytasks:expires-at` a pool's resources carry, as written (or renewed) at `now`: past
    it, `skytasks gc` may delete them.

    A live controller renews it every `renew_every_seconds`, so it means "the controller was heard
    lately": once the controller is gone, it runs out after `idle_minutes` and two renewals more.
    By then the nodes have ended themselves for idleness if their own watch works; gc is for
    what is left when it did not. Without this, a pool with no lifetime cap would carry no time at
    which gc could tell an orphan from a long training run. With `max_lifetime_minutes`, it is never
    later than that long after the pool started."""
    end = now + timedelta(seconds=idle_minutes * 60 + 2 * renew_every_seconds(idle_minutes))
    if max_lifetime_minutes is not None:
        end = min(end, started_at + timedelta(minutes=max_lifetime_minutes))
    return end


class Lease:
    """A pool's lease (`lease_expiry`), counted from when the pool started (this object's making),
    and the daemon thread that renews it: `keep` calls `renew(expiry)` every `renew_every_seconds`
    until `stop`. A renewal that raises is said once through `warn`; the next one tries again."""

    def __init__(self, idle_minutes: float, max_lifetime_minutes: Optional[float]):
        self.idle_minutes, self.max_lifetime_minutes = idle_minutes, max_lifetime_minutes
        self.started_at = datetime.now(timezone.utc)
        # A warm pool's nodes outlive their holder for keep_warm_minutes after its last renewal:
        # its lease covers that too, so gc does not take a released warm pool for an orphan.
        self.keep_warm_minutes = 0.0
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def expiry(self) -> datetime:
        return lease_expiry(datetime.now(timezone.utc), self.started_at, self.idle_minutes + self.keep_warm_minutes,
                            self.max_lifetime_minutes)

    def keep(self, renew: Callable[[datetime], None], warn: Callable[[str], None], name: str) -> None:
        self._thread = threading.Thread(target=self._run, args=(renew, warn), daemon=True, name=name)
        self._thread.start()

    def _run(self, renew: Callable[[datetime], None], warn: Callable[[str], None]) -> None:
        told = False
        while not self._stopped.wait(renew_every_seconds(self.idle_minutes)):
            try:
                renew(self.expiry())
                told = False
            except Exception as exc:  # noqa: BLE001 - a blip must not end the renewals
                if not told:
                    warn(f"could not renew the lease (skytasks:expires-at) on what the pool holds ({exc}); it is "
                         f"tried again, but meanwhile `skytasks gc` may take the pool for an orphan")
                    told = True

    def stop(self, wait: float = 30.0) -> None:
        """No renewal starts after this returns (unless one in flight outlasts `wait`)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait)
