"""What an SSH pool runs on its connections besides the agents: `pip_packages` into a folder of
their own before an agent starts, and the orderly close of every channel and connection."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
import time
from typing import Any

from skytasks.errors import PoolStartError
from skytasks.providers.remote import env_in
from skytasks.providers.remote.bridge import Forwarding
from skytasks.providers.ssh.login import SSHLogin


async def install_packages(conn: Any, login: SSHLogin) -> str:
    """`pip_packages` into a folder of their own, cached by what was asked for: a warm node
    installs nothing, and the node's own Python stays untouched."""
    key = hashlib.sha256(json.dumps([login.python, login.pip_packages]).encode()).hexdigest()[:16]
    target = f".cache/skytasks/pip-{key}"
    packages = " ".join(shlex.quote(p) for p in login.pip_packages)
    result = await conn.run(
        # Nodes may share a home (NFS, or two "hosts" on one machine): each installs into a
        # folder of its own and the first to finish renames it into place. pip takes the env
        # (a private index's token, say) from stdin (env_in.PIP), never from the command line.
        f"cd && (test -f {target}/.done || (tmp={target}.$$ && {login.python} -c {shlex.quote(env_in.PIP)} "
        f"install -q --disable-pip-version-check --target $tmp {packages} && touch $tmp/.done && "
        f"(mv -T $tmp {target} 2>/dev/null || rm -rf $tmp)) && test -f {target}/.done)",
        input=env_in.frame(login.env).decode(),
    )
    if result.exit_status != 0:
        raise PoolStartError(f"pip_packages: installing {login.pip_packages} on {conn.get_extra_info('peername')} "
                             f"failed: {str(result.stderr).strip()[-2000:]}")
    return target


async def close_all(closers: list[Any], conns: dict[int, Any], wait_for_agents: bool) -> None:
    """Every channel (`closers`: a process and its bridge's pumps) and connection closed, in order."""
    # What the controller wrote last (END or RELEASE to each agent) reaches the channels first.
    forwarding = [p for _proc, pumps in closers for p in pumps if isinstance(p, Forwarding)]
    deadline = time.monotonic() + 5
    while not all(f.drained() for f in forwarding) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    for proc, _pumps in closers:
        if not proc.stdin.is_closing():
            proc.stdin.write_eof()
    # Each agent ends by itself (END, or EOF without a lease) before its connection
    # closes: cut first, an agent could find its stdout broken before it read END, and
    # wait out its re-attach window instead. Bounded: a dead node never answers. A
    # released agent stays: its channel closes when the connection does.
    if closers and wait_for_agents:
        await asyncio.wait([asyncio.ensure_future(proc.wait_closed()) for proc, _ in closers], timeout=5)
    for conn in conns.values():
        conn.close()
    # A node behind a dead link never acknowledges the close; do not wait for it long.
    if conns:
        await asyncio.wait([asyncio.ensure_future(c.wait_closed()) for c in conns.values()], timeout=5)
