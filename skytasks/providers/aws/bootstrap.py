"""The user-data of a launched node: a cloud-config that pins the host key, starts the watchdog,
then builds the node's Python environment.

Order matters. The host key comes first (cloud-init installs it before sshd starts), so the very
first SSH connection is already checked against a key the controller made. The watchdog starts
before the slow installs, so a controller that dies during provisioning still ends the node.

skytasks itself is not in here: user-data is capped at 16 KB, and the controller ships its own
package over SSH once the node is ready, cached there by content hash, so there is no version skew.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import re
import shlex
import sys
from pathlib import Path

import yaml

from skytasks.providers.aws.spec import AWSSettings

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec

TORCH_INDEX = "https://download.pytorch.org/whl/{suffix}"
STATE_DIR = "/var/lib/skytasks"  # status file ("ready" or the failure) and the agent's heartbeat
VENV = "/opt/skytasks/venv"
VENV_PYTHON = f"{VENV}/bin/python"
HEARTBEAT_FILE = f"{STATE_DIR}/heartbeat"
NOTICE_FILE = f"{STATE_DIR}/preemption-notice"  # the watchdog writes a spot interruption here
WATCHDOG_SOURCE = Path(__file__).resolve().parent / "watchdog.py"
_BARE_VERSION = re.compile(r"^\d+(\.\d+)*([a-z]+\d*)?(\+[\w.]+)?$")


def requirement(package: str, spec: str | None) -> str | None:
    """`"latest"` is unpinned, a bare version pins with ==, a constraint passes through;
    None means the package is not wanted."""
    if spec is None:
        return None
    spec = spec.strip()
    if spec in ("", "latest"):
        return package
    if _BARE_VERSION.match(spec):
        return f"{package}=={spec}"
    return f"{package}{spec}"


def torch_install(spec: PoolSpec, cuda: bool) -> tuple[list[str], str]:
    """The torch family to install and the wheel index to take it from."""
    aws = spec.own(AWSSettings)
    wanted = [requirement("torch", aws.torch_version), requirement("torchvision", aws.torchvision),
              requirement("torchaudio", aws.torchaudio)]
    index = TORCH_INDEX.format(suffix=aws.torch_cuda if cuda else "cpu")
    return [w for w in wanted if w], index


def bootstrap_script(spec: PoolSpec, cuda: bool, python_version: str | None = None) -> str:
    aws = spec.own(AWSSettings)
    import cloudpickle

    python_version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    torch_reqs, index = torch_install(spec, cuda)
    # cloudpickle must match the controller's exactly: it is the wire format of the function.
    extras = [f"cloudpickle=={cloudpickle.__version__}", "numpy", *aws.pip_packages]
    q = " ".join
    return "\n".join([
        "#!/bin/bash",
        "set -euo pipefail",
        f"mkdir -p {STATE_DIR} && chmod 1777 {STATE_DIR}",
        "exec > >(tee -a /var/log/skytasks-bootstrap.log) 2>&1",
        f"trap 'echo \"failed: $(tail -c 2000 /var/log/skytasks-bootstrap.log)\" > {STATE_DIR}/status' ERR",
        "export HOME=/root UV_INSTALL_DIR=/usr/local/bin UV_PYTHON_INSTALL_DIR=/opt/skytasks/python",
        "command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh",
        # The controller's own Python minor version: cloudpickled functions carry its bytecode.
        f"uv venv --python {python_version} {VENV}",
        f"uv pip install --python {VENV_PYTHON} --index-url {index} {q(shlex.quote(r) for r in torch_reqs)}",
        f"uv pip install --python {VENV_PYTHON} {q(shlex.quote(r) for r in extras)}",
        f"echo ready > {STATE_DIR}/status",
        "",
    ])


class _Literal(str):
    pass


class _Dumper(yaml.SafeDumper):
    """Block scalars for _Literal, on a dumper of our own: yaml.SafeDumper itself, which every
    other library shares, is left as it was."""


_Dumper.add_representer(_Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))


def render_user_data(spec: PoolSpec, cuda: bool, host_key_private: str, host_key_public: str,
                     python_version: str | None = None) -> str:
    aws = spec.own(AWSSettings)
    idle = aws.idle_minutes * 60
    # No max_lifetime_minutes: no lifetime flag, and the watchdog ends the node for idleness only.
    lifetime = "" if aws.max_lifetime_minutes is None else f" --max-lifetime-seconds {aws.max_lifetime_minutes * 60:g}"
    watchdog_unit = "\n".join([
        "[Unit]", "Description=skytasks watchdog: terminate this node when its controller is gone", "",
        "[Service]",
        f"ExecStart=/usr/bin/python3 /opt/skytasks/watchdog.py --heartbeat-file {HEARTBEAT_FILE} "
        f"--idle-seconds {idle:g}{lifetime}"
        + (f" --notice-file {NOTICE_FILE}" if aws.spot else ""),
        "Restart=always", "", "[Install]", "WantedBy=multi-user.target", "",
    ])
    config = {
        # Only the controller's key: the host is pinned from the first connection on.
        "ssh_deletekeys": True,
        "ssh_genkeytypes": [],
        "ssh_keys": {"ed25519_private": _Literal(host_key_private.strip() + "\n"),
                     "ed25519_public": host_key_public.strip()},
        "write_files": [
            {"path": "/opt/skytasks/watchdog.py", "permissions": "0755", "content": _Literal(WATCHDOG_SOURCE.read_text())},
            {"path": "/etc/systemd/system/skytasks-watchdog.service", "content": _Literal(watchdog_unit)},
            {"path": "/opt/skytasks/bootstrap.sh", "permissions": "0755",
             "content": _Literal(bootstrap_script(spec, cuda, python_version))},
        ],
        "runcmd": [
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", "--now", "skytasks-watchdog.service"],
            ["bash", "/opt/skytasks/bootstrap.sh"],
        ],
    }
    return "#cloud-config\n" + yaml.dump(config, Dumper=_Dumper, sort_keys=False, width=1000)
