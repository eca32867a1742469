"""Prefect's ephemeral server, started at the first instant of `skytasks run`.

With no Prefect API configured, Prefect starts a server of its own for the run: it first imports
`prefect` and `prefect.server` in this process, then starts the same server in a subprocess and
waits for it, each a matter of seconds on 2 cores. In series that is most of a command that
torchrun finishes in a few seconds. Here the subprocess is started before anything else,
exactly as Prefect would start it (same command, environment and database under PREFECT_HOME),
and PREFECT_API_URL points Prefect at it, so nothing in this process imports `prefect.server`
and the server comes up while the ranks do. It is stopped at exit, after Prefect's own workers
have sent their last logs and events (they register their exit hooks later, so theirs run first).

Only when nothing configures an API: settings can come from the environment, the active profile,
and `prefect.toml`, `pyproject.toml` or `.env` in the working directory; when any of them might
say something about the API, Prefect is left to do as it always does.

On a shared login node every local user reaches 127.0.0.1, and the server holds every block the
run loads (SSH keys, `env`, cloud credentials, warm records) with `include_secrets`. So the
server takes a random credential for this run only (Prefect's own API auth string: the server's
`PREFECT_SERVER_API_AUTH_STRING`, this process's `PREFECT_API_AUTH_STRING`, which its children
inherit, each readable by this user alone), and its home (PREFECT_HOME, the database) is made
`0700`. Only its health check answers without the credential, as Prefect's middleware allows.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import tempfile
import time
import urllib.request

from skytasks.node.linux import PR_SET_PDEATHSIG, prctl
from skytasks.node.ports import free_port
from skytasks.prefect_records.prefect_internals import drain_workers, ephemeral_server_command, nothing_configures_an_api

__all__ = ["EarlyServer", "flush_records", "nothing_configures_an_api", "start_early_server"]

SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"  # the server requires it (HTTP basic auth) ...
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"  # ... and Prefect's clients send it


class EarlyServer:
    """The subprocess, its address, and a way to wait for it."""

    def __init__(self) -> None:
        self.port = free_port("127.0.0.1")  # outside the ephemeral range: no connection can take it meanwhile
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self._log = tempfile.TemporaryFile()
        self.credential = secrets.token_urlsafe(32)
        private_home()
        command, env = ephemeral_server_command(self.port)
        env[SERVER_AUTH_ENV] = self.credential
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, preexec_fn=_detach)
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


def private_home() -> None:
    """Prefect's home (its database, with every block of the run) made `0700`, when it is this
    user's: created so, or narrowed."""
    home = os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect"))
    os.makedirs(home, mode=0o700, exist_ok=True)
    if os.stat(home).st_uid == os.getuid():
        os.chmod(home, 0o700)


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
    os.environ[CLIENT_AUTH_ENV] = server.credential
    os.environ["PREFECT_UI_URL"] = ""  # no "View at" link: this server serves no UI and stops with the command
    return server


def flush_records(timeout: float = 30.0) -> None:
    """Send what Prefect's log and event workers still hold, before the command's exit.

    Left to Prefect's own at-exit drain, a worker stopped with items queued logs "Still processing
    items: N items remaining..." at WARNING, which a newcomer reads as an error although every item
    is then sent. Drained here, while the server still runs, with that one progress line quiet."""
    drain_workers(timeout)
