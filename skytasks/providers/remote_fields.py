"""The block fields that more than one provider reads: how to log in to a node, which Python runs
there, and how long a node may take to come up or sit idle. Each provider's `reads` says which
of them it takes; set on a pool whose provider does not, one is a PoolConfigError naming it.

Also the lease that the providers whose resources can outlive their controller (aws, slurm) write
on them for `skytasks gc`: see `lease_expiry` and `Lease`."""

from __future__ import annotations

import re
import threading
from datetime import datetime, timedelta, timezone
from typing import Callable, Optional

from pydantic import BaseModel, Field, SecretStr

HOST_PATTERN = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>\d{1,5}))?$")


class RemoteFields(BaseModel):
    ssh_user: Optional[str] = None
    ssh_private_key: Optional[SecretStr] = Field(None, description="Private key (PEM/OpenSSH text) for ssh and aws.")
    known_hosts: Optional[str] = Field(None, description="known_hosts text or path; host keys are always checked.")
    remote_python: Optional[str] = Field(
        None, description='Python on the nodes: ssh default "python3"; aws default the venv its bootstrap builds.')
    pip_packages: list[str] = Field(default_factory=list, description="Extra packages installed on launched nodes.")
    ready_timeout_seconds: float = Field(900, gt=0)
    idle_minutes: float = Field(15, gt=0)
    max_lifetime_minutes: Optional[float] = Field(
        None, gt=0, description="Launched nodes end at this age. None (default): no cap; idle_minutes ends nodes "
                                "whose controller is gone, so orphans are still guarded against.")


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
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def expiry(self) -> datetime:
        return lease_expiry(datetime.now(timezone.utc), self.started_at, self.idle_minutes, self.max_lifetime_minutes)

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
