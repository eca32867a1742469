"""A real OpenSSH server for tests: its own host key, one authorized client key, started on the
given addresses, optionally inside a network namespace, and optionally with folders of its own
(a node's state folder: on one machine, every "node" would otherwise share the one path)."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.harness.processes import end

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return Path(f"{path}.pub").read_text().strip()


class SSHServer:
    def __init__(self, folder: Path, addresses: list[str], port: int, netns: str | None = None,
                 host_key: str | None = None, authorized_key: str | None = None,
                 set_env: dict[str, str] | None = None, own_folders: dict[str, Path] | None = None):
        if not os.path.exists(SSHD):
            raise RuntimeError("openssh-server is not installed (make system-deps installs it)")
        self.folder, self.addresses, self.port, self.netns = folder, addresses, port, netns
        folder.mkdir(parents=True, exist_ok=True)
        if host_key is None:
            self.host_pub = keygen(folder / "host_key")
        else:  # a key someone else made (what cloud-init installs from user-data)
            (folder / "host_key").write_text(host_key)
            os.chmod(folder / "host_key", 0o600)
            self.host_pub = subprocess.run(["ssh-keygen", "-y", "-f", str(folder / "host_key")],
                                           capture_output=True, text=True, check=True).stdout.strip()
        if authorized_key is None:
            authorized_key = keygen(folder / "client_key")
            self.client_key = (folder / "client_key").read_text()
        (folder / "authorized_keys").write_text(authorized_key.strip() + "\n")
        (folder / "sshd_config").write_text("\n".join([
            *(f"ListenAddress {a}:{port}" for a in addresses),
            f"HostKey {folder / 'host_key'}", f"AuthorizedKeysFile {folder / 'authorized_keys'}",
            f"PidFile {folder / 'sshd.pid'}", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "AllowTcpForwarding no",
            "X11Forwarding no", "PrintMotd no",
            # A client behind a pulled link never closes its connection: the session gives it up
            # within seconds instead of waiting for TCP to time out (about 16 minutes).
            "ClientAliveInterval 2", "ClientAliveCountMax 3",
            *(f"SetEnv {k}={v}" for k, v in (set_env or {}).items()),
        ]) + "\n")
        os.makedirs("/run/sshd", exist_ok=True)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        if own_folders:  # a mount namespace where each path is this server's folder, for its sessions too
            binds = []
            for path, own in own_folders.items():
                os.makedirs(path, exist_ok=True)  # the mount point, left in place: others may be mounted on it
                own.mkdir(parents=True, exist_ok=True)
                binds.append(f"mount --bind {shlex.quote(str(own))} {shlex.quote(path)}")
            prefix += ["unshare", "-m", "--propagation", "private", "sh", "-c", " && ".join(binds) + ' && exec "$@"', "sh"]
        self.proc = subprocess.Popen([*prefix, SSHD, "-D", "-e", "-f", str(folder / "sshd_config")],
                                     stderr=open(folder / "sshd.log", "w"))
        self._wait_listening()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 20
        probe = ["ip", "netns", "exec", self.netns] if self.netns else []
        while True:
            if self.netns:
                ok = subprocess.run([*probe, "bash", "-c", f"exec 3<>/dev/tcp/{self.addresses[-1]}/{self.port}"],
                                    capture_output=True).returncode == 0
            else:
                try:
                    socket.create_connection((self.addresses[-1], self.port), timeout=1).close()
                    ok = True
                except OSError:
                    ok = False
            if ok:
                return
            assert self.proc.poll() is None and time.monotonic() < deadline, (self.folder / "sshd.log").read_text()
            time.sleep(0.1)

    def known_hosts(self, addresses: list[str] | None = None) -> str:
        key = " ".join(self.host_pub.split()[:2])
        return "".join(f"[{a}]:{self.port} {key}\n" if self.port != 22 else f"{a} {key}\n"
                       for a in addresses or self.addresses)

    def stop(self) -> None:
        """The listener and every session it forked: OpenSSH leaves sessions running when its
        listener ends, and a test must leave nothing running."""
        import psutil

        try:
            sessions = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            sessions = []
        end(self.proc, 10)
        for p in sessions:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(sessions, timeout=10)


def free_port(address: str = "127.0.0.1") -> int:
    """Free, and outside the ephemeral range: no connection can take it before its server binds it."""
    from skytasks.node.ports import free_port as outside_the_ephemeral_range

    return outside_the_ephemeral_range(address)
