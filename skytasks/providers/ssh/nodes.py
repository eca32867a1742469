"""provider="ssh": machines you already have, reached with asyncssh; host keys always checked.

Each node's agent runs as `remote_python -m skytasks.node.agent` on an SSH channel, behind a check
that this Python is the controller's major.minor and has torch and a compatible cloudpickle
(`python_check`: a mismatch or a lack fails the start, naming remote_python, before any rank
starts). The controller's own skytasks is shipped to `~/.cache/skytasks/<content hash>` on each
node first, so a node always runs the controller's version. The channel is bridged to a pair of
local pipes, so the shared rank lifecycle reads and writes it exactly like a local node's pipes.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import io
import json
import os
import shlex
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skytasks.errors import PoolConfigError, PoolStartError
from skytasks.node import attach
from skytasks.node.ports import port_snippet
from skytasks.providers import NodeLink, agent_args
from skytasks.event_bus import PoolReporter
from skytasks.providers.ssh import env_in, python_check
from skytasks.providers.ssh.bridge import Forwarding, await_answer, bridge_process

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # skytasks/
CHUNK = 1 << 20
GROW_CONNECT_SECONDS = 15.0  # growing an elastic pool: how long one host may take to answer


def parse_host(spec: str, default_user: str | None) -> tuple[str | None, str, int]:
    user, _, rest = spec.rpartition("@") if "@" in spec else (default_user, "", spec)
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.partition(":")
    return user or default_user, host, int(port or 22)


def package_bundle() -> tuple[bytes, str]:
    """The controller's skytasks as a tar.gz, and its content hash (the cache key on nodes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(PACKAGE_DIR.rglob("*.py")):
            info = tar.gettarinfo(str(path), arcname=f"skytasks/{path.relative_to(PACKAGE_DIR)}")
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()[:16]


@dataclass
class SSHLogin:
    """How to reach a set of nodes: shared by provider="ssh" and the instances aws launches."""

    targets: list[tuple[str | None, str, int]]  # (user, host, port), head first
    known_hosts: str  # known_hosts text or a path to one
    private_key: str | None = field(repr=False)  # a secret: never in a repr, a log line or a traceback
    python: str
    # Why `python` is what it is when remote_python was left unset (None: the user set it), so
    # that an error about it names what to set.
    python_default: str | None = None
    pip_packages: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # applies on the node, pip included; secret
    heartbeat_file: str | None = None
    notice_file: str | None = None  # where the node's watchdog writes a preemption notice
    timeout: float = 900.0
    # The nodes' addresses as their peers see them, where that is not the address SSH uses
    # (EC2: SSH to the public address, rendezvous on the private one inside the VPC).
    peer_addresses: list[str] | None = None
    min_nodes: int | None = None  # elastic: start with the targets that answer, at least this many


class SSHNodes:
    """Connect to every target in parallel and start a node agent on each over SSH."""

    reshape_is_cheap = False  # the hosts are the pool's: another shape cannot have them too
    runs_on_this_machine = False  # a workdir travels to the nodes
    gpus_from_config = False
    # An agent outlives its SSH session (no pty, so no SIGHUP; sshd does not kill what it ran):
    # a new session reaches it through its door.
    reattaches = True

    def __init__(self, login: SSHLogin, reporter: PoolReporter | None = None):
        self._login = login
        self._reporter = reporter or PoolReporter("ssh-pool", "ssh")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="skytasks-ssh")
        self._conns: dict[int, Any] = {}  # node id (its target's index) -> its connection
        self._closers: list[Any] = []
        self._workdirs: dict[str, str] = {}  # tree digest -> its path on the nodes
        self._adopted: set[int] = set()  # a warm pool's nodes another process started (adopt)

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> list[NodeLink]:
        self._thread.start()
        try:
            return self._run(self._start_all(), timeout=self._login.timeout)
        except BaseException:
            self.stop()
            raise

    async def _start_all(self) -> list[NodeLink]:
        hosts = self._login.targets
        # All nodes in parallel: the slowest node, not the sum, sets the start time.
        connected = await asyncio.gather(*(self._connect(i, *h) for i, h in enumerate(hosts)), return_exceptions=True)
        self._conns = {i: c for i, c in enumerate(connected) if not isinstance(c, BaseException)}
        failed = [c for c in connected if isinstance(c, BaseException)]
        wanted = len(hosts) if self._login.min_nodes is None else self._login.min_nodes
        if len(self._conns) < wanted:  # stop() closes the connections that did open
            raise failed[0]
        if failed:  # an elastic pool starts with the hosts that answer
            self._reporter.note(f"{self._reporter.key}: starting with {len(self._conns)} of {len(hosts)} hosts; "
                                  + "; ".join(str(f) for f in failed))
        bundle, digest = package_bundle()
        # Every node to its end, started or failed: none is still starting when stop() tears down.
        started = await asyncio.gather(*(
            self._start_agent(conn, node_id, hosts[node_id][1], bundle, digest)
            for node_id, conn in self._conns.items()
        ), return_exceptions=True)
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:  # the agents that did start end with their streams; stop() closes the rest
            for link in started:
                if isinstance(link, NodeLink):
                    link.close()
                    _close_quietly(link.inbound)
            raise failed[0]
        return [link for link in started if isinstance(link, NodeLink)]

    async def _connect(self, node_rank: int, user: str | None, host: str, port: int,
                       connect_timeout: float | None = None) -> Any:
        return await connect(self._login, node_rank, user, host, port, connect_timeout)

    async def _start_agent(self, conn: Any, node_rank: int, host: str, bundle: bytes, digest: str) -> NodeLink:

        login = self._login
        remote_dir = f".cache/skytasks/{digest}"
        # Unpacked beside its place and renamed into it, as package_in.py does: a half-unpacked
        # tree (a dropped connection, a full disk) is never taken for the package, and of two
        # nodes on a shared home the second leaves the first's in place.
        await conn.run(f"test -d {remote_dir}/skytasks || {{ mkdir -p .cache/skytasks && "
                       f"t=$(mktemp -d {remote_dir}.XXXXXX) && {{ tar -xzf - -C \"$t\" || {{ rm -rf \"$t\"; exit 1; }}; }} && "
                       f"{{ mv -T \"$t\" {remote_dir} 2>/dev/null || rm -rf \"$t\"; }}; }} && test -d {remote_dir}/skytasks",
                       input=bundle, encoding=None, check=True)
        paths = [f"$HOME/{remote_dir}"]
        if login.pip_packages:
            paths.append("$HOME/" + await self._install_packages(conn))
        if login.env.get("PYTHONPATH"):
            paths.append(shlex.quote(login.env["PYTHONPATH"]))
        agent = " ".join(shlex.quote(a) for a in agent_args(login.heartbeat_file, login.notice_file))
        # The agent starts behind its env (on stdin: never on the node's command line, env_in) and
        # the check of its Python (python_check): one line, then its frames.
        proc = await conn.create_process(
            env_in.command(login.python, env_in.AGENT_START, agent, ":".join(paths)), encoding=None)
        proc.stdin.write(env_in.frame(login.env))  # at once: no round trip of its own
        await self._check_python(proc, f"node {node_rank} ({host})")
        inbound, outbound, tasks = bridge_process(proc, f"node {node_rank} {host}", self._reporter)
        self._closers.append((proc, tasks))
        address = login.peer_addresses[node_rank] if login.peer_addresses else host
        return NodeLink(node_rank=node_rank, address=address, inbound=inbound, outbound=outbound,
                        machine=host, close=lambda: _close_quietly(outbound))

    def reattach(self, node_id: int, door: str, timeout: float) -> NodeLink:
        """A new SSH session to the node's running agent, through its door: on the node's
        connection while it is open, else on a new one. The hosts are the user's: one that does
        not answer may answer later, so only an agent found gone (nothing behind its door) is
        NodeGone; anything else is tried again by the controller until reattach_seconds."""
        user, host, port = self._login.targets[node_id]
        where = f"node {node_id} ({host})"
        said: collections.deque[str] = collections.deque(maxlen=4)
        started = time.monotonic()

        async def open_session() -> tuple[Any, Any, Any]:
            conn: Any = self._conns.get(node_id)
            if conn is None or conn.is_closed():
                conn = await self._connect(node_id, user, host, port, connect_timeout=timeout)
                stale, self._conns[node_id] = self._conns.get(node_id), conn
                if stale is not None:
                    stale.close()
            try:
                proc = await conn.create_process(" ".join(shlex.quote(a) for a in attach.argv(self._login.python, door)),
                                                 encoding=None)
            except BaseException:
                # A connection that cannot open a session (a link that went dark without a
                # reset) is closed: the next try connects anew.
                conn.close()
                raise
            inbound, outbound, tasks = bridge_process(proc, where, _Tail(said))
            self._closers.append((proc, tasks))
            return proc, inbound, outbound

        try:
            proc, inbound, outbound = self._run(asyncio.wait_for(open_session(), timeout), timeout=timeout + 5)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise TimeoutError(f"{where}: no new SSH session within {timeout:g}s") from exc
        try:
            await_answer(inbound, timeout - (time.monotonic() - started), lambda: proc.exit_status,
                         lambda: " / ".join(said), where)
        except BaseException:
            _close_quietly(outbound)
            _close_quietly(inbound)
            raise
        address = self._login.peer_addresses[node_id] if self._login.peer_addresses else host
        return NodeLink(node_rank=node_id, node_id=node_id, address=address, inbound=inbound, outbound=outbound,
                        machine=host, close=lambda: _close_quietly(outbound))

    async def _check_python(self, proc: Any, where: str) -> None:
        """The check's line from the node's Python, or PoolStartError naming remote_python: a Python
        other than the controller's major.minor, a cloudpickle of another major, or a lack."""
        import asyncssh

        login = self._login
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), login.timeout)
        except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
            line = f"{type(exc).__name__}: {exc}".encode()
        found = python_check.parse(line)
        if found is not None:
            # Another Python first: it is what to fix (torch and cloudpickle go into the right one).
            wrong = python_check.wrong_python(where, login.python, found, login.python_default)
            if wrong is None and not found.missing:
                return
            proc.close()
            raise PoolStartError(wrong or python_check.cannot_import(where, login.python, found, login.python_default))
        try:  # why it never got to the check: the shell's or Python's own words
            said = await asyncio.wait_for(proc.stderr.read(), 5)
        except (OSError, asyncssh.Error, asyncio.TimeoutError):
            said = b""
        proc.close()
        text = (said or b"").decode(errors="replace") or line.decode(errors="replace")
        raise PoolStartError(python_check.did_not_start(where, login.python, text, login.python_default))

    async def _install_packages(self, conn: Any) -> str:
        """`pip_packages` into a folder of their own, cached by what was asked for: a warm node
        installs nothing, and the node's own Python stays untouched."""
        login = self._login
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

    def prepare_workdir(self, request) -> tuple[str, str | None]:
        """The workdir onto every node in parallel; only contents a node lacks travel."""
        from skytasks.providers.ssh.workdir import sync_workdir
        from skytasks.workdir import describe_sync, read_workdir

        tree = request.tree or read_workdir(request.root)
        if self._workdirs.get(tree.digest):  # this session sent it already
            return self._workdirs[tree.digest], None

        async def all_nodes() -> list:
            return list(await asyncio.gather(*(sync_workdir(c, self._login.python, tree) for c in conns.values())))

        conns = dict(self._conns)
        results = self._run(all_nodes(), timeout=self._login.timeout)
        self._workdirs[tree.digest] = results[0].path
        hosts = [f"node {i} ({self._login.targets[i][1]})" for i in conns]
        return results[0].path, describe_sync(request.root, [(h, r.files_sent, r.bytes_sent) for h, r in zip(hosts, results)])

    def retarget(self, node_rank: int, target: tuple[str | None, str, int], peer_address: str,
                 known_hosts: str) -> None:
        """Point a node at another machine (a replacement instance), before `replace`."""
        self._login.targets[node_rank] = target
        if self._login.peer_addresses:
            self._login.peer_addresses[node_rank] = peer_address
        self._login.known_hosts += known_hosts

    def add_target(self, target: tuple[str | None, str, int], peer_address: str, known_hosts: str) -> int:
        """One more machine (an instance launched to grow the pool): its node id, for `replace`."""
        self._login.targets.append(target)
        if self._login.peer_addresses is not None:
            self._login.peer_addresses.append(peer_address)
        self._login.known_hosts += known_hosts
        return len(self._login.targets) - 1

    def replace(self, node_id: int, what: str = "was lost and cannot be reached again",
                connect_timeout: float | None = None) -> NodeLink:
        """A lost node again: a new connection and agent, or an error naming the host."""
        from skytasks.errors import PoolStartError

        user, host, port = self._login.targets[node_id]

        async def again() -> NodeLink:
            old = self._conns.pop(node_id, None)
            if old is not None:
                old.close()
            try:
                conn = await self._connect(node_id, user, host, port, connect_timeout)
            except Exception as exc:  # noqa: BLE001
                raise PoolStartError(f"node {node_id} ({host}:{port}) {what}: {exc}") from exc
            self._conns[node_id] = conn
            bundle, digest = package_bundle()
            return await self._start_agent(conn, node_id, host, bundle, digest)

        return self._run(again(), timeout=self._login.timeout)

    def grow(self, count: int) -> list[NodeLink]:
        """Hosts of the pool not in use now (they did not answer at the start, or were dropped),
        each tried again; the first `count` that answer join."""
        links: list[NodeLink] = []
        for node_id in range(len(self._login.targets)):
            if len(links) == count:
                break
            if node_id in self._conns or node_id in self._adopted:
                continue
            try:
                # Bounded: a host that drops packets must not hold the call for the OS's TCP timeout.
                links.append(self.replace(node_id, what="cannot be reached", connect_timeout=GROW_CONNECT_SECONDS))
            except Exception as exc:  # noqa: BLE001 - said, and the pool stays as it is
                self._reporter.note(f"{self._reporter.key}: {exc}")
        return links

    def release(self, node_id: int) -> None:
        self._adopted.discard(node_id)
        conn = self._conns.pop(node_id, None)
        if conn is not None:
            self._loop.call_soon_threadsafe(conn.close)

    def abort(self) -> None:
        """Connecting is bounded by ready_timeout_seconds; nothing to cut short."""

    def free_port(self, head: int) -> int:
        python = self._login.python
        result = self._run(self._conns[head].run(f"{python} -c {shlex.quote(port_snippet())}", check=True), timeout=60)
        return int(result.stdout.strip())

    # -- warm pools: this process lets go, another takes over ------------------------------------

    def handle(self) -> dict[str, Any]:
        """Where the pool's nodes are, for another process's `adopt`: the hosts, the node ids in
        use and the host keys' public halves. No credential: the login key stays in the pool's block."""
        return {"targets": [list(t) for t in self._login.targets], "peer_addresses": self._login.peer_addresses,
                "nodes": sorted(set(self._conns) | self._adopted), "known_hosts": self._login.known_hosts}

    def adopt(self, handle: dict[str, Any]) -> None:
        """The nodes of `handle`, their agents running: `reattach` opens a session to each."""
        if handle.get("targets"):
            self._login.targets = [(u, h, int(p)) for u, h, p in handle["targets"]]
        if handle.get("peer_addresses") is not None:
            self._login.peer_addresses = list(handle["peer_addresses"])
        self._adopted = {int(i) for i in handle.get("nodes", range(len(self._login.targets)))}
        if not self._thread.is_alive():
            self._thread.start()

    def leave_running(self) -> None:
        """This process's sessions and connections close; the agents run on (a warm pool's)."""
        self._shut(wait_for_agents=False)

    def stop(self) -> None:
        self._shut(wait_for_agents=True)

    def _shut(self, wait_for_agents: bool) -> None:
        if not self._thread.is_alive():
            return

        async def close_all() -> None:
            # What the controller wrote last (END or RELEASE to each agent) reaches the channels first.
            forwarding = [p for _proc, pumps in self._closers for p in pumps if isinstance(p, Forwarding)]
            deadline = time.monotonic() + 5
            while not all(f.drained() for f in forwarding) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for proc, _pumps in self._closers:
                if not proc.stdin.is_closing():
                    proc.stdin.write_eof()
            # Each agent ends by itself (END, or EOF without a lease) before its connection
            # closes: cut first, an agent could find its stdout broken before it read END, and
            # wait out its re-attach window instead. Bounded: a dead node never answers. A
            # released agent stays: its channel closes when the connection does.
            if self._closers and wait_for_agents:
                await asyncio.wait([asyncio.ensure_future(proc.wait_closed()) for proc, _ in self._closers], timeout=5)
            for conn in self._conns.values():
                conn.close()
            # A node behind a dead link never acknowledges the close; do not wait for it long.
            if self._conns:
                await asyncio.wait([asyncio.ensure_future(c.wait_closed()) for c in self._conns.values()], timeout=5)

        try:
            self._run(close_all(), timeout=15)
        except Exception:  # noqa: BLE001 - teardown goes on
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def connect(login: SSHLogin, node_rank: int, user: str | None, host: str, port: int,
                  connect_timeout: float | None = None) -> Any:
    """One node's SSH connection, with the login's key and its host key checked against
    known_hosts; PoolStartError naming the node otherwise (a start's, and `skytasks check`'s)."""
    import asyncssh

    keys = None
    if login.private_key is not None:
        keys = [asyncssh.import_private_key(login.private_key)]
    try:
        return await asyncssh.connect(host, port=port, username=user, known_hosts=load_known_hosts(login.known_hosts, "ssh"),
                                      client_keys=keys, agent_path=None, keepalive_interval=10,
                                      keepalive_count_max=3, connect_timeout=connect_timeout)
    except asyncssh.HostKeyNotVerifiable as exc:
        raise PoolStartError(
            f"node {node_rank} ({host}:{port}): host key of {host}:{port} does not match known_hosts (or the "
            f"host is not in it): refused ({exc})"
        ) from None
    except (OSError, asyncssh.Error) as exc:
        raise PoolStartError(f"node {node_rank} ({host}:{port}): cannot connect over SSH: {exc}") from exc


def load_known_hosts(text: str | None, provider: str) -> Any:
    """known_hosts as asyncssh takes it, from its text or a path to it; never empty."""
    import asyncssh

    if not text:
        raise PoolConfigError(f"known_hosts: provider={provider!r} needs known_hosts (text or a path); host keys are "
                              "never trusted blindly")
    if "\n" not in text.strip() and os.path.exists(os.path.expanduser(text)):
        text = Path(os.path.expanduser(text)).read_text()
    return asyncssh.import_known_hosts(text)


class _Tail:
    """An attach's stderr, kept (its last words when it ends) rather than reported: the
    controller says what became of the node."""

    def __init__(self, lines: collections.deque):
        self._lines = lines

    def note(self, line: str) -> None:
        self._lines.append(line.split("] ", 1)[-1])


def _close_quietly(f: Any) -> None:
    try:
        f.close()
    except OSError:
        pass
