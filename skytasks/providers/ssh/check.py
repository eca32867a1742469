"""`skytasks check` for an ssh pool: what its start would find out host by host, asked cheaply.

Every host at once, each bounded by a short timeout: that it answers SSH with the pool's key and a
host key known_hosts has (the start's own connection, `nodes.connect`), and that its
`remote_python` is the controller's Python major.minor with a compatible cloudpickle and can import
torch and cloudpickle (the start's own check, `env_in.PROBE`, and its verdict, run alone: no agent
starts, nothing is copied, pip installs nothing).
"""

from __future__ import annotations

import asyncio
import re
import shlex
from dataclasses import replace
from typing import Any, Iterator

from skytasks.errors import PoolConfigError, PoolStartError
from skytasks.pool_spec import PoolSpec
from skytasks.providers.checks import Check
from skytasks.providers.remote import env_in, python_check
from skytasks.providers.ssh.login import SSHLogin, connect, load_known_hosts
from skytasks.providers.remote.python_check import NEEDED

CONNECT_SECONDS = 15.0  # one host's answer to SSH
PYTHON_SECONDS = 30.0  # its Python's start and the check's lookups


def run(spec: PoolSpec) -> Iterator[Check]:
    from skytasks.providers.ssh.provider import ssh_login

    login = ssh_login(spec)
    try:
        load_known_hosts(login.known_hosts, "ssh")
    except (PoolConfigError, ValueError) as exc:
        yield Check("known_hosts has the hosts' keys", False, str(exc))
        return
    yield from asyncio.run(_all(login))


async def _all(login: SSHLogin) -> list[Check]:
    per_host = await asyncio.gather(*(_host(login, i, *target) for i, target in enumerate(login.targets)))
    return [check for checks in per_host for check in checks]


async def _host(login: SSHLogin, node: int, user: str | None, host: str, port: int) -> list[Check]:
    import asyncssh

    where = f"{user + '@' if user else ''}{host}:{port}"
    answers = f"node {node} ({where}) answers SSH with the pool's key and a host key in known_hosts"
    imports = f"node {node} ({where}): remote_python imports torch and cloudpickle"
    try:
        conn = await asyncio.wait_for(connect(login, node, user, host, port, CONNECT_SECONDS), CONNECT_SECONDS + 5)
    except asyncio.TimeoutError:
        return [Check(answers, False, f"no answer within {CONNECT_SECONDS:g}s"), Check(imports, None, "not reached")]
    except (PoolStartError, OSError, asyncssh.Error) as exc:
        return [Check(answers, False, _after_node(str(exc))), Check(imports, None, "not reached")]
    try:
        server = conn.get_extra_info("server_version") or ""
        return [Check(answers, True, server), await _python(conn, login, node, where)]
    finally:
        conn.close()
        try:
            await asyncio.wait_for(conn.wait_closed(), 5)
        except (asyncio.TimeoutError, OSError, asyncssh.Error):
            pass


async def _python(conn: Any, login: SSHLogin, node: int, where: str) -> Check:
    import asyncssh

    name = f"node {node} ({where}): remote_python imports torch and cloudpickle"
    # The env on stdin, never on the node's command line (env_in); PYTHONPATH as the start sets it.
    pythonpath = shlex.quote(login.env["PYTHONPATH"]) if login.env.get("PYTHONPATH") else None
    try:
        result = await asyncio.wait_for(
            conn.run(env_in.command(login.python, env_in.PROBE, pythonpath=pythonpath),
                     input=env_in.frame(login.env), encoding=None),
            PYTHON_SECONDS)
    except asyncio.TimeoutError:
        return Check(name, False, f"{python_check.ran(login.python, login.python_default)} did not answer within "
                                  f"{PYTHON_SECONDS:g}s")
    except (OSError, asyncssh.Error) as exc:
        return Check(name, False, f"{type(exc).__name__}: {exc}")
    out = result.stdout or b""
    found = python_check.parse(next(iter(out.splitlines(keepends=True)), b""))
    if found is None:
        said = (result.stderr or out or b"").decode(errors="replace").strip()[-800:] or "nothing"
        return Check(name, False, f"{python_check.ran(login.python, login.python_default)} did not run (exit "
                                  f"{result.exit_status}); it said: {said}")
    # What pip_packages names is installed beside it as the pool starts: not missing then, and
    # its version, not the node's own, is the one the start compares.
    def from_pip(module: str) -> bool:
        return any(re.match(rf"{re.escape(module)}\b", p) for p in login.pip_packages)

    missing = {m: why for m, why in found.missing.items() if not from_pip(m)}
    found = replace(found, missing=missing, cloudpickle=None if from_pip("cloudpickle") else found.cloudpickle)
    # The start's verdict, in its order: another Python (or cloudpickle) first, then a lack.
    wrong = python_check.wrong_python(f"node {node} ({where})", login.python, found, login.python_default)
    if wrong or missing:
        return Check(name, False, _after_node(wrong or python_check.cannot_import(
            f"node {node} ({where})", login.python, found, login.python_default)))
    pickler = f" with cloudpickle {found.cloudpickle}" if found.cloudpickle else ""
    pip = [m for m in NEEDED if from_pip(m)]
    installed = f"; {', '.join(pip)} from pip_packages" if pip else ""
    return Check(name, True, f"{found.executable} (Python {found.version}{pickler}){installed}")


def _after_node(text: str) -> str:
    """An error's words without the node it names (the check's name says which)."""
    text = re.sub(r"^remote_python: node \d+ \([^)]*\): ", "", text)
    text = re.sub(r"; no rank was started$", "", text)
    return re.sub(r"^node \d+ \([^)]*\): ", "", text)
