"""A warm pool used by controller processes of their own, as a deployment's runs use it: each
`use` is one process (tests/programs/warm_call.py, a Prefect flow run) that takes the saved pool,
runs one call and exits; `events` reads what the pool said to Prefect."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from tests.harness.warm import api_env

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "programs" / "warm_call.py"


def use(name: str, out: Path, timeout: float = 300) -> dict:
    """One controller process uses the saved pool once, and exits: what it saw (its agents'
    pids, where they run, its ranks, its flow run)."""
    proc = subprocess.run([sys.executable, str(PROGRAM), name, str(out)], env=api_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads(out.read_text())


def events(name: str, since: datetime, kind: str, timeout: float = 20) -> list[dict]:
    """The pool's `skytasks.pool.<kind>` events since `since`, once there is one."""
    from prefect.client.orchestration import get_client

    async def read() -> list[dict]:
        async with get_client() as client:
            resp = await client._client.post("/events/filter", json={
                "filter": {"event": {"name": [f"skytasks.pool.{kind}"]}, "occurred": {"since": since.isoformat()}},
                "limit": 50})
            resp.raise_for_status()
            return resp.json()["events"]

    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in asyncio.run(read()) if e["resource"]["prefect.resource.id"] == f"skytasks.pool.{name}"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


def related_to_flow_run(event: dict, flow_run_id: str) -> bool:
    return any(r["prefect.resource.id"] == f"prefect.flow-run.{flow_run_id}" for r in event.get("related") or [])


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g}s"
        time.sleep(0.2)
