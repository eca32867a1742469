"""Whether launched nodes are ready: one SSH look at each, against the host key the controller
pinned in the user-data, reading the status file the bootstrap writes ("ready" or the failure).
A node that answers with another key is not ready yet (cloud-init has not written ours), never
trusted."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from skytasks.providers.aws.bootstrap import STATE_DIR


async def probe_all(addresses: list[str], login: str, login_key: Any, host_key: Any) -> list[str]:
    return list(await asyncio.gather(*(_probe(a, login, login_key, host_key) for a in addresses)))


async def _probe(address: str, login: str, login_key: Any, host_key: Any) -> str:
    """One look at a node: "ready", "failed: ...", or what it is still doing."""
    import asyncssh

    try:
        async with asyncssh.connect(address, port=22, username=login, client_keys=[login_key], agent_path=None,
                                    known_hosts=asyncssh.import_known_hosts(known_hosts_text([address], host_key)),
                                    connect_timeout=5) as conn:
            result = await conn.run(f"cat {STATE_DIR}/status 2>/dev/null || echo bootstrapping", timeout=10)
            return str(result.stdout).strip() or "bootstrapping"
    except asyncssh.HostKeyNotVerifiable:
        return "ssh up, host key not yet the pinned one"
    except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
        return f"waiting for ssh ({type(exc).__name__})"


def known_hosts_text(addresses: list[str], host_key: Any) -> str:
    public = host_key.export_public_key().decode().strip()
    return "".join(f"{a} {public}\n" for a in addresses)


def run_async(coro: Any) -> Any:
    """Run a coroutine to the end from sync code, even when this thread already has a loop."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
