"""Where SLURM's commands run: on this machine (a login node, where a Prefect worker usually
runs), or on `slurm_login` over SSH, with the pool's key and its host key checked against
`known_hosts` as for ssh pools. Either way: `run` a command to its end, or `open` a long-lived
one (an `srun` step running a node agent) whose stdin and stdout are the node's stream.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import shlex
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Optional

from skytasks.errors import PoolStartError
from skytasks.providers.slurm.spec import SlurmSettings
from skytasks.providers.processes import LOST_WAIT_SECONDS, end_child
from skytasks.event_bus import PoolReporter
from skytasks.providers.ssh.login import load_known_hosts, parse_host
from skytasks.providers.remote.bridge import bridge_process


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Step:
    """A running command's streams, and how to end it: `close`, or `close_lost` for a node found
    lost. An srun whose node died ends only once SLURM has declared the node down (SlurmdTimeout
    and more: 15 s on the test cluster), whatever it is sent: a replacement does not wait for that."""

    inbound: BinaryIO
    outbound: BinaryIO
    close: Callable[[], None]
    close_lost: Callable[[], None]
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    exit_code: Callable[[], Optional[int]] = lambda: None  # srun's status once it ended, else None
    # A sealed step (skytasks.stream_seal): the seal's plain end is `inbound`/`outbound`, and
    # letting go also ends the seal's pump and srun's own streams (`also_let_go`).
    also_let_go: Optional[Callable[[], None]] = None

    def let_go(self) -> None:
        """Close this end of the streams and nothing more: srun lives on, and with it its step.
        srun is never signalled for a step that must outlive this stream (a node agent reached
        again by another step): a killed srun has its step cancelled (srun's shepherd)."""
        for f in (self.outbound, self.inbound):
            try:
                f.close()
            except OSError:
                pass
        if self.also_let_go is not None:
            self.also_let_go()


class SlurmShell:
    def __init__(self, spec: SlurmSettings, reporter: PoolReporter):
        self._spec, self._reporter = spec, reporter
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._procs: list[subprocess.Popen] = []
        self.where = "this machine" if spec.slurm_login is None else f"the login node {spec.slurm_login}"

    # -- connection (slurm_login only) ------------------------------------------------------

    def _connected(self) -> Any:
        # A connection that dropped (the login node rebooted, a link reset) is made again: an
        # agent's step outlives it, and re-attaching needs a new srun on the login node.
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        import asyncssh

        user, host, port = parse_host(self._spec.slurm_login or "", self._spec.ssh_user)
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True, name="skytasks-slurm-login").start()
        key = self._spec.ssh_private_key
        keys = [asyncssh.import_private_key(key.get_secret_value())] if key is not None else None

        async def connect() -> Any:
            try:
                return await asyncssh.connect(host, port=port, username=user, client_keys=keys, agent_path=None,
                                              known_hosts=load_known_hosts(self._spec.known_hosts, "slurm"),
                                              keepalive_interval=10, keepalive_count_max=3)
            except asyncssh.HostKeyNotVerifiable as exc:
                raise PoolStartError(f"slurm_login ({host}:{port}): host key does not match known_hosts (or the "
                                     f"host is not in it): refused ({exc})") from None
            except (OSError, asyncssh.Error) as exc:
                raise PoolStartError(f"slurm_login ({host}:{port}): cannot connect over SSH: {exc}") from exc

        self._conn = self._call(connect(), timeout=60)
        return self._conn

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- commands ---------------------------------------------------------------------------

    def run(self, argv: list[str], input: bytes | None = None, timeout: float = 120.0) -> Done:
        if self._spec.slurm_login is None:
            try:
                p = subprocess.run(argv, input=input, capture_output=True, timeout=timeout, start_new_session=True)
            except FileNotFoundError:
                raise PoolStartError(f"{argv[0]}: not found on {self.where}; provider='slurm' runs SLURM's commands "
                                     f"here unless slurm_login names a login node") from None
            return Done(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))
        conn = self._connected()
        result = self._call(conn.run(shlex.join(argv), input=input, encoding=None), timeout=timeout)
        out, err = result.stdout or b"", result.stderr or b""
        return Done(result.exit_status if result.exit_status is not None else -1,
                    out.decode(errors="replace"), err.decode(errors="replace"))

    def open(self, argv: list[str], label: str) -> Step:
        """A long-lived command (an srun step): its stdin and stdout as a stream, its stderr lines
        to the reporter (and the last few kept, for when it ends)."""
        if self._spec.slurm_login is None:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    # its own session: Ctrl-C reaches the controller only, which
                                    # stops the ranks in order
                                    start_new_session=True)
            self._procs.append(proc)
            step = Step(proc.stdout, proc.stdin,  # type: ignore[arg-type]
                        lambda: end_child(proc, terminate_first=True),
                        lambda: end_child(proc, terminate_first=True, wait=LOST_WAIT_SECONDS), exit_code=proc.poll)
            threading.Thread(target=self._relay_stderr, args=(proc.stderr, label, step), daemon=True).start()
            return step
        conn = self._connected()

        async def start() -> tuple:
            proc = await conn.create_process(shlex.join(argv), encoding=None)
            return proc, bridge_process(proc, label, _TailReporter(self._reporter, tail))

        tail: collections.deque = collections.deque(maxlen=8)
        proc, (inbound, outbound, _tasks) = self._call(start(), timeout=60)
        close = functools.partial(self._close_remote, proc, outbound)  # waits on nothing either way
        return Step(inbound, outbound, close, close, tail, exit_code=lambda: proc.exit_status)

    def _relay_stderr(self, stream: BinaryIO, label: str, step: Step) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                step.stderr_tail.append(line)
                self._reporter.note(f"[{label}] {line}")
        except (ValueError, OSError):  # ending the step closed the pipe under this read: nothing more to say
            pass

    def _close_remote(self, proc: Any, outbound: BinaryIO) -> None:
        try:
            outbound.close()  # EOF to srun's stdin: the agent ends
        except OSError:
            pass

    def close(self) -> None:
        for p in self._procs:
            end_child(p, terminate_first=True)
        self._procs = []
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.close()
                self._call(asyncio.wait_for(conn.wait_closed(), 5), timeout=10)
            except Exception:  # noqa: BLE001 - teardown goes on
                pass
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


class _TailReporter:
    """Passes stderr lines on, keeping the last few (why an srun step ended)."""

    def __init__(self, reporter: PoolReporter, tail: collections.deque):
        self._reporter, self._tail = reporter, tail

    def note(self, line: str) -> None:
        self._tail.append(line.split("] ", 1)[-1])
        self._reporter.note(line)
