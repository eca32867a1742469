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
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import tempfile
import time
import urllib.request

from skytasks.node.linux import PR_SET_PDEATHSIG, prctl
from skytasks.node.ports import free_port
from skytasks.prefect_records.prefect_internals import drain_workers, ephemeral_server_command, nothing_configures_an_api

__all__ = ["EarlyServer", "flush_records", "nothing_configures_an_api", "start_early_server"]


class EarlyServer:
    """The subprocess, its address, and a way to wait for it."""

    def __init__(self) -> None:
        self.port = free_port("127.0.0.1")  # outside the ephemeral range: no connection can take it meanwhile
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self._log = tempfile.TemporaryFile()
        command, env = ephemeral_server_command(self.port)
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
    drain_workers(timeout)
