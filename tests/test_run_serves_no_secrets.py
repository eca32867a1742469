"""`skytasks run` with no API configured serves no secrets to other local users.

While a run's ranks are up, every port its process tree listens on is asked for block documents
(the `include_secrets` read of Prefect's API) without a credential: Prefect's server answers 401,
the other listeners (the relay, torch's store) answer nothing a client could read a block from.
The run itself, authenticated with its own credential, is recorded whole, and Prefect's home is
`0700`.
"""

from __future__ import annotations

import http.client
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time

import psutil

PROBE_SCRIPT = """\
import pathlib, time
here = pathlib.Path({folder!r})
(here / "started").touch()
deadline = time.time() + 150
while not (here / "go").exists() and time.time() < deadline:
    time.sleep(0.2)
print("probed")
"""


def _listening_ports(root: psutil.Process) -> set[int]:
    ports = set()
    for p in [root, *root.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        ports.update(c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN)
    return ports


def _ask(port: int, method: str, path: str, body: bytes | None = None) -> int | None:
    """The HTTP status a request without credentials gets, or None when nothing answers HTTP."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def test_no_port_of_a_run_answers_an_unauthenticated_block_read(tmp_path, empty_prefect_database):
    home = tmp_path / "prefect-home"
    home.mkdir(mode=0o755)
    shutil.copy(empty_prefect_database, home / "prefect.db")  # migrated already: Prefect's first start skipped
    (tmp_path / "probe.py").write_text(PROBE_SCRIPT.format(folder=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    run = subprocess.Popen([sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", "probe.py"], cwd=tmp_path,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        root = psutil.Process(run.pid)
        deadline, server = time.monotonic() + 150, None
        while time.monotonic() < deadline and run.poll() is None:
            ports = _listening_ports(root)
            server = next((p for p in ports if _ask(p, "GET", "/api/health") == 200), None)
            if server is not None and (tmp_path / "started").exists():
                break
            time.sleep(0.5)
        assert server is not None and (tmp_path / "started").exists(), "the run's server and ranks never came up"
        ports = _listening_ports(root)
        assert server in ports and len(ports) >= 2, ports  # the server and the ranks' own listeners
        answers = {}
        for port in sorted(ports):
            answers[port] = (_ask(port, "POST", "/api/block_documents/filter?include_secrets=true", b"{}"),
                             _ask(port, "GET", "/api/block_documents/filter"))
        assert answers[server] == (401, 401), answers
        for port, (post, get) in answers.items():
            assert post in (None, 401, 403) and get in (None, 401, 403, 404, 405), (port, answers)
            assert post not in range(200, 300) and get not in range(200, 300), (port, answers)
    finally:
        (tmp_path / "go").touch()
        out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err[-3000:]
    assert "probed" in out + err
    assert stat.S_IMODE(home.stat().st_mode) == 0o700  # the database's folder is this user's alone
    db = sqlite3.connect(home / "prefect.db")  # the run's own credential let its record in
    assert [s for (s,) in db.execute("select state_type from flow_run")] == ["COMPLETED"]
    tasks = dict(db.execute("select name, state_type from task_run").fetchall())
    assert tasks == {"probe": "COMPLETED", "probe[rank 0/2]": "COMPLETED", "probe[rank 1/2]": "COMPLETED"}, tasks
