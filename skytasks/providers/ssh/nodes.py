"""provider="ssh": machines you already have, reached with asyncssh; host keys always checked.

Each node's agent runs as `remote_python -m skytasks.node.agent` on an SSH channel, started by the
remote toolkit's one bootstrap (remote.agent_start): the pool's env on stdin, the check that this
Python is the controller's major.minor with torch and a compatible cloudpickle (a mismatch or a
lack fails the start, naming remote_python, before any rank starts), then the controller's own
skytasks under `~/.cache/skytasks/<content hash>`, sent only to a node that lacks it, so a node
always runs the controller's version. This module is the SSH transport: connections, the
channel (bridged to a pair of local pipes once the agent runs, so the shared rank lifecycle reads
and writes it exactly like a local node's pipes), growing, replacing and handing over nodes.
"""

from __future__ import annotations

import asyncio
import collections
import shlex
import threading
from typing import Any

from skytasks.errors import PoolStartError
from skytasks.node.ports import port_snippet
from skytasks.providers import NodeLink, agent_args
from skytasks.providers.remote import env_in
from skytasks.providers.remote.agent_start import AgentStarter, NodePython, bootstrap
from skytasks.providers.remote.bridge import bridge_process
from skytasks.providers.remote.reattach import reach_agent
from skytasks.providers.remote.workdir import SentWorkdirs
from skytasks.event_bus import PoolReporter
from skytasks.providers.ssh.channel import Channel, Session, Tail, close_quietly, in_own_thread
from skytasks.providers.ssh.login import SSHLogin, connect, load_known_hosts, parse_host
from skytasks.providers.ssh.node_setup import close_all, install_packages

__all__ = ["BOOTSTRAP", "SSHLogin", "SSHNodes", "connect", "load_known_hosts", "parse_host"]

GROW_CONNECT_SECONDS = 15.0  # growing an elastic pool: how long one host may take to answer

# argv: digest, bundle size, then `-m skytasks.node.agent ARGS`. Run as `cd && exec python -c`, so
# the package's home is under ~; the agent then runs in this same process, as `python -m` would
# (no second interpreter to start), with the package first on its path.
BOOTSTRAP = bootstrap('home = os.path.join(".cache", "skytasks", sys.argv[1])\n', env=True, launch=r"""
sys.path[0:1] = [os.getcwd(), os.path.abspath(home)]
from skytasks.node.agent import main
main(sys.argv[5:])
""")


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
        self._workdirs = SentWorkdirs()
        self._adopted: set[int] = set()  # a warm pool's nodes another process started (adopt)
        self._starter = AgentStarter(BOOTSTRAP, login.timeout, env=login.env)

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
        # Every node to its end, started or failed: none is still starting when stop() tears down.
        started = await asyncio.gather(*(
            self._start_agent(conn, node_id, hosts[node_id][1]) for node_id, conn in self._conns.items()
        ), return_exceptions=True)
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:  # the agents that did start end with their streams; stop() closes the rest
            for link in started:
                if isinstance(link, NodeLink):
                    link.close()
                    close_quietly(link.inbound)
            raise failed[0]
        return [link for link in started if isinstance(link, NodeLink)]

    async def _connect(self, node_rank: int, user: str | None, host: str, port: int,
                       connect_timeout: float | None = None) -> Any:
        return await connect(self._login, node_rank, user, host, port, connect_timeout)

    async def _start_agent(self, conn: Any, node_rank: int, host: str) -> NodeLink:
        login = self._login
        paths = []
        if login.pip_packages:
            paths.append("$HOME/" + await install_packages(conn, login))
        if login.env.get("PYTHONPATH"):
            paths.append(shlex.quote(login.env["PYTHONPATH"]))
        loop = asyncio.get_running_loop()

        def open_channel(code: str, argv: list[str]) -> Channel:
            # The bootstrap's env comes on stdin, never on the node's command line (env_in).
            command = env_in.command(login.python, code, " ".join(shlex.quote(a) for a in argv), ":".join(paths))
            async def create() -> Any:
                return await conn.create_process(command, encoding=None)

            return Channel(asyncio.run_coroutine_threadsafe(create(), loop).result(), loop)

        # SSH encrypts the channel itself: no seal of its own.
        python = NodePython(f"node {node_rank} ({host})", login.python, login.python_default)
        way, _ = await in_own_thread(lambda: self._starter.start(
            open_channel, agent_args(login.heartbeat_file, login.notice_file), python, sealed=False))
        inbound, outbound, tasks = bridge_process(way.proc, f"node {node_rank} {host}", self._reporter)
        self._closers.append((way.proc, tasks))
        address = login.peer_addresses[node_rank] if login.peer_addresses else host
        return NodeLink(node_rank=node_rank, address=address, inbound=inbound, outbound=outbound,
                        machine=host, close=lambda: close_quietly(outbound))

    def reattach(self, node_id: int, door: str, timeout: float) -> NodeLink:
        """A new SSH session to the node's running agent, through its door: on the node's
        connection while it is open, else on a new one. The hosts are the user's: one that does
        not answer may answer later, so only an agent found gone (nothing behind its door) is
        NodeGone; anything else is tried again by the controller until reattach_seconds."""
        user, host, port = self._login.targets[node_id]
        where = f"node {node_id} ({host})"

        async def open_session(client: list[str]) -> Session:
            conn: Any = self._conns.get(node_id)
            if conn is None or conn.is_closed():
                conn = await self._connect(node_id, user, host, port, connect_timeout=timeout)
                stale, self._conns[node_id] = self._conns.get(node_id), conn
                if stale is not None:
                    stale.close()
            try:
                proc = await conn.create_process(" ".join(shlex.quote(a) for a in client), encoding=None)
            except BaseException:
                # A connection that cannot open a session (a link that went dark without a
                # reset) is closed: the next try connects anew.
                conn.close()
                raise
            said: collections.deque[str] = collections.deque(maxlen=4)
            inbound, outbound, tasks = bridge_process(proc, where, Tail(said))
            self._closers.append((proc, tasks))
            return Session(proc, inbound, outbound, said)

        def session(client: list[str]) -> Session:
            try:
                return self._run(asyncio.wait_for(open_session(client), timeout), timeout=timeout + 5)
            except (asyncio.TimeoutError, TimeoutError) as exc:
                raise TimeoutError(f"{where}: no new SSH session within {timeout:g}s") from exc

        way, _ = reach_agent(session, self._login.python, door, timeout, where, sealed=False)
        address = self._login.peer_addresses[node_id] if self._login.peer_addresses else host
        return NodeLink(node_rank=node_id, node_id=node_id, address=address, inbound=way.inbound,
                        outbound=way.outbound, machine=host, close=lambda: close_quietly(way.outbound))

    def prepare_workdir(self, request) -> tuple[str, str | None]:
        """The workdir onto every node in parallel; only contents a node lacks travel."""
        nodes = [(f"node {i} ({self._login.targets[i][1]})", conn) for i, conn in dict(self._conns).items()]
        return self._workdirs.send(request, self._login.python, nodes,
                                   lambda sends: self._run(sends, timeout=self._login.timeout))

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
            return await self._start_agent(conn, node_id, host)

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

        try:
            self._run(close_all(self._closers, self._conns, wait_for_agents), timeout=15)
        except Exception:  # noqa: BLE001 - teardown goes on
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
