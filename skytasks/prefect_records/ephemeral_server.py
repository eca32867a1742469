"""Prefect's ephemeral server, started at the first instant of `skytasks run`.

With no Prefect API configured, Prefect starts a server of its own for the run: it first imports
`prefect` (about 1 s on the 2-core dev machine) and `prefect.server` (2.3 s) in this process,
then starts the same server in a subprocess and waits for it (3.4 s). In series that is most of a
command that torchrun finishes in 4-5 s. Here the subprocess is started before anything else,
exactly as Prefect would start it (same command, environment and database under PREFECT_HOME),
and PREFECT_API_URL points Prefect at it, so nothing in this process imports `prefect.server`
and the server comes up while the ranks do. It is stopped at exit, after Prefect's own workers
have sent their last logs and events (they register their exit hooks later, so theirs run first).

Only when nothing configures an API: settings can come from the environment, the active profile,
and `prefect.toml`, `pyproject.toml` or `.env` in the working directory; when any of them might
say something about the API, Prefect is left to do as it always does.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from skytasks.node.linux import PR_SET_PDEATHSIG, prctl
from skytasks.node.ports import free_port

_CONFIGURING_ENV = ("PREFECT_API_", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "PREFECT_PROFILE", "PREFECT_CLOUD_",
                    "PREFECT_UI_URL")


def nothing_configures_an_api() -> bool:
    """True when Prefect would start its own ephemeral server; False when in any doubt."""
    if any(k.startswith(_CONFIGURING_ENV) for k in os.environ):
        return False
    home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH", home / "profiles.toml")).expanduser()
    if profiles.exists():
        import tomllib

        try:
            data = tomllib.loads(profiles.read_text())
        except (OSError, ValueError):
            return False
        active = data.get("profiles", {}).get(data.get("active", "ephemeral"), {})
        if any("API_" in k or (k.endswith("ALLOW_EPHEMERAL_MODE") and str(v).lower() != "true")
               for k, v in active.items()):
            return False
    cwd = Path.cwd()
    if (cwd / "prefect.toml").exists():
        return False
    for name, mark in ((".env", "PREFECT_"), ("pyproject.toml", "tool.prefect")):
        try:
            if mark in (cwd / name).read_text(errors="replace"):
                return False
        except OSError:
            pass
    return True


class EarlyServer:
    """The subprocess, its address, and a way to wait for it."""

    def __init__(self) -> None:
        self.port = free_port("127.0.0.1")  # outside the ephemeral range: no connection can take it meanwhile
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent  # type: ignore[union-attr, arg-type]
        self._log = tempfile.TemporaryFile()
        # Prefect's own command and environment for its ephemeral server (SubprocessASGIServer).
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_dir.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_detach)
        atexit.register(self.stop)

    def wait_until_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                tail = self._log.read()[-2000:].decode(errors="replace")
                why = f"exited with code {self.proc.returncode}" if self.proc.poll() is not None else \
                    f"did not answer within {timeout:g} s"
                raise RuntimeError(f"Prefect's server for this run (127.0.0.1:{self.port}) {why}: {tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _detach() -> None:
    """In the child: out of the terminal's process group (Ctrl-C is for the ranks; the record
    still has to be written), but killed with this process if it dies without stopping it.
    Nothing is imported here: a child between fork and exec must not take the import lock."""
    os.setsid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_early_server() -> EarlyServer | None:
    """Start Prefect's server now and point this process at it, when Prefect would start one."""
    if not nothing_configures_an_api():
        return None
    server = EarlyServer()
    os.environ["PREFECT_API_URL"] = server.api_url
    os.environ["PREFECT_UI_URL"] = ""  # no "View at" link: this server serves no UI and stops with the command
    return server


def flush_records(timeout: float = 30.0) -> None:
    """Send what Prefect's log and event workers still hold, before the command's exit.

    Left to Prefect's own at-exit drain, a worker stopped with items queued logs "Still processing
    items: N items remaining..." at WARNING, which a newcomer reads as an error although every item
    is then sent. Drained here, while the server still runs, with that one progress line quiet."""

    if "prefect" not in sys.modules:
        return  # nothing was recorded (bad arguments): nothing to send
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    quiet = [logging.getLogger(name) for name in ("EventsWorker", "APILogWorker")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        EventsWorker.drain_all(timeout=timeout, at_exit=False)  # task-run events first: logs name their runs
        APILogWorker.drain_all(timeout=timeout, at_exit=False)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
