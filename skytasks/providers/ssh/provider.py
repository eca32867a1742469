"""provider="ssh": the pool's own hosts, login and known_hosts, on the shared SSH transport."""

from __future__ import annotations

from skytasks.pool_spec import PoolSpec
from skytasks.providers import NodeProvider
from skytasks.event_bus import PoolReporter
from skytasks.providers.ssh.nodes import SSHLogin, SSHNodes, parse_host
from skytasks.providers.ssh.spec import SSHSettings


def ssh_login(spec: PoolSpec) -> SSHLogin:
    """How the pool reaches its hosts: its start's, and `skytasks check`'s (check.py)."""
    ssh = spec.own(SSHSettings)
    return SSHLogin(
        targets=[parse_host(h, ssh.ssh_user) for h in ssh.hosts],
        known_hosts=ssh.known_hosts or "",
        private_key=ssh.ssh_private_key.get_secret_value() if ssh.ssh_private_key else None,
        python=ssh.remote_python or "python3",
        python_default=None if ssh.remote_python else "the default: the first python3 on each host's PATH",
        pip_packages=list(ssh.pip_packages), env=dict(spec.env),
        timeout=ssh.ready_timeout_seconds, min_nodes=spec.min_nodes,
    )


class SSHProvider(SSHNodes, NodeProvider):
    def __init__(self, spec: PoolSpec, reporter: PoolReporter | None = None):
        super().__init__(ssh_login(spec), reporter)
