"""provider="aws", warm pools (keep_warm_minutes): the instances outlive the process that launched
them, and another process's provider takes them over. The provider's part that only a warm pool
uses, as a mixin of AWSProvider (provider.py), which has the attributes named below."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from skytasks.errors import PoolGone, PoolStartError
from skytasks.event_bus import PoolReporter
from skytasks.pool_spec import PoolSpec
from skytasks.providers.aws.bootstrap import HEARTBEAT_FILE, NOTICE_FILE
from skytasks.providers.aws.resources import PoolResources
from skytasks.providers.aws.spec import AWSSettings
from skytasks.providers.remote_fields import Lease
from skytasks.providers.ssh.nodes import SSHLogin, SSHNodes


class WarmInstances:
    """handle / adopt / leave_running of an AWSProvider."""

    # (the provider's, provider.py)
    pool_id: str
    reporter: PoolReporter
    owned: PoolResources
    _spec: PoolSpec
    _aws: AWSSettings
    _ec2: Any
    _nodes: SSHNodes | None
    _node_ids: dict[int, str]
    _lease: Lease
    _login_key: Any
    _host_key: Any
    _request: dict[str, Any] | None
    _teardown_lock: threading.Lock
    _python: Callable[[], str]
    _describe_new_instances: Callable[[], list[dict]]

    def handle(self) -> dict[str, Any]:
        """The pool's instances and how to reach them (addresses, host keys' public halves). With
        your own key pair the login key stays in the pool's block; a key pair the pool made for
        itself goes with the handle, which is kept only in the warm pool's Prefect Secret record
        (encrypted at rest, obfuscated in the UI and the API), so the next holder can log in."""
        assert self._nodes is not None
        own = {} if not self.owned.key_name else {
            "key_name": self.owned.key_name, "login_key": self._login_key.export_private_key().decode()}
        return {**self._nodes.handle(), **own, "pool_id": self.pool_id,
                "instances": {str(i): iid for i, iid in self._node_ids.items()},
                "instance_ids": list(self.owned.instance_ids), "security_group_id": self.owned.security_group_id,
                "placement_group": self.owned.placement_group,
                "started_at": self._lease.started_at.timestamp()}

    def adopt(self, handle: dict[str, Any]) -> None:
        """Another process's instances, their agents running: reached by `reattach` over SSH;
        `stop` terminates them and deletes the pool's group. PoolGone when EC2 says none runs."""
        import asyncssh
        from datetime import datetime, timezone

        self.pool_id = self.reporter.key = str(handle["pool_id"])
        self.owned = PoolResources(self._ec2, self.pool_id, instance_ids=list(handle.get("instance_ids", [])),
                                   security_group_id=handle.get("security_group_id"),
                                   placement_group=handle.get("placement_group"))
        self.owned.key_name = handle.get("key_name")  # the pool's own key pair: `stop` deletes it, expired too
        self._node_ids = {int(i): iid for i, iid in handle.get("instances", {}).items()}
        self._lease.started_at = datetime.fromtimestamp(float(handle.get("started_at", time.time())), timezone.utc)
        live = [i["InstanceId"] for i in self._describe_new_instances() if i["State"]["Name"] in ("pending", "running")]
        if not any(iid in live for iid in self._node_ids.values()):
            raise PoolGone(f"{self.pool_id}: none of its instances runs any more (EC2 says so)")
        private = handle.get("login_key") or (self._aws.ssh_private_key.get_secret_value()
                                              if self._aws.ssh_private_key is not None else None)
        if not private:
            raise PoolStartError(f"{self.pool_id}: the warm pool's record holds no login key, and the pool no "
                                 "ssh_private_key")
        self._login_key = asyncssh.import_private_key(private)
        self._host_key = asyncssh.generate_private_key("ssh-ed25519")  # a replacement's own
        self._request = None
        self._nodes = SSHNodes(SSHLogin(
            targets=[], known_hosts=str(handle.get("known_hosts", "")), peer_addresses=handle.get("peer_addresses"),
            private_key=private, python=self._python(), env=dict(self._spec.env),
            heartbeat_file=HEARTBEAT_FILE, timeout=self._aws.ready_timeout_seconds,
            notice_file=NOTICE_FILE if self._aws.spot else None), self.reporter)
        self._nodes.adopt(handle)
        self._lease.keep(lambda until: self.owned.renew_expiry(list(self._node_ids.values()), until),
                         lambda line: self.reporter.note(f"{self.pool_id}: {line}", level=logging.WARNING),
                         name=f"skytasks-lease-{self.pool_id}")

    def leave_running(self) -> None:
        """This process's SSH sessions and lease renewal end; the instances run on, their lease
        (skytasks:expires-at) renewed once more to cover idle_minutes plus keep_warm_minutes."""
        with self._teardown_lock:
            self._lease.stop()
            try:
                self.owned.renew_expiry(list(self._node_ids.values()), self._lease.expiry())
            except Exception as exc:  # noqa: BLE001 - the renewal before last still holds for a while
                self.reporter.note(f"{self.pool_id}: could not renew its lease as it was released: {exc}")
            if self._nodes is not None:
                self._nodes.leave_running()
                self._nodes = None
