"""A real SLURM for tests: munged, slurmctld and one slurmd per node, each node a host of its own.

Every daemon runs in a network namespace (and a UTS namespace, for its hostname) joined to a
bridge, as `tests/test_multihost.py` does for sshd: ranks on different nodes talk over the bridge,
not loopback, and no daemon listens outside the namespaces made here. This machine (the
controller, where `srun` and `sbatch` run) has the bridge's first address. Debian's packages (22.05)
as root with no systemd and no cgroups: proctrack/linuxproc, task/none, no accounting, state
and spool in a temporary folder, munged with its own key and socket. Nodes declare fake GPUs
(`gres.conf` over plain files), so each step's `CUDA_VISIBLE_DEVICES` is SLURM's own.

Stopped by PIDs: every daemon, the namespaces and the bridge; nothing is left behind. A session
that ends without its teardown leaves nothing either: every daemon dies with the thread that started
it (PR_SET_PDEATHSIG, through setpriv, as the Kubernetes harness starts its daemons), and the
cluster is stopped at exit and on SIGTERM (a run ended by `timeout`).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
import uuid
from pathlib import Path

from tests.harness.processes import end, stop_with_session

SUBNET = "10.231.78"
CONTROLLER_ADDRESS = f"{SUBNET}.1"  # this machine, on the bridge
CTLD_ADDRESS = f"{SUBNET}.10"
CTLD_HOST = "skyctl"


DIE_WITH_US = ["setpriv", "--pdeathsig", "KILL"]  # the daemon dies with the thread that started it
def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def available() -> str | None:
    """Why a cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "SLURM's daemons run as root here"
    for tool in ("slurmctld", "slurmd", "munged", "sbatch", "ip", "unshare", "nsenter"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} is not installed (make system-deps installs it)"
    return None


class SlurmCluster:
    def __init__(self, folder: Path, nodes: int = 3, gpus_per_node: int = 2, cpus_per_node: int = 4):
        self.folder = folder
        self.names = [f"n{i}" for i in range(nodes)]
        self.addresses = {n: f"{SUBNET}.{i + 2}" for i, n in enumerate(self.names)}
        self.gpus_per_node = gpus_per_node
        self.cpus_per_node = cpus_per_node
        tag = uuid.uuid4().hex[:4]
        self.bridge = f"sksbr{tag}"
        self.netns = {n: f"sks{tag}{n}" for n in [*self.names, "ctl"]}
        self._links: list[str] = []
        self._made_ns: list[str] = []
        self.daemons: dict[str, subprocess.Popen] = {}
        self.conf = folder / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self.extra_partitions: list[str] = []

    # -- start -----------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        stop_with_session(self, lambda quick: self.stop())
        try:
            self._network()
            self._write_config()
            self._start_munge()
            self._start_daemon("ctl", ["slurmctld", "-D", "-i", "-f", str(self.conf)], CTLD_HOST)
            for name in self.names:
                self.start_node(name)
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        self._sweep_stale_network()
        ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        ip("addr", "add", f"{CONTROLLER_ADDRESS}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, (name, ns) in enumerate(self.netns.items()):
            address = CTLD_ADDRESS if name == "ctl" else self.addresses[name]
            ip("netns", "add", ns)
            self._made_ns.append(ns)
            outside = f"{ns}v"[-15:]
            ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._links.append(outside)
            ip("link", "set", outside, "master", self.bridge)
            ip("link", "set", outside, "up")
            for cmd in (["addr", "add", f"{address}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                        ["link", "set", "lo", "up"]):
                ip("-n", ns, *cmd)

    @staticmethod
    def _sweep_stale_network() -> None:
        """A cluster's bridge and namespaces that an earlier session left (one killed with SIGKILL,
        which no handler sees): its bridge holds this subnet's first address, and while it does no
        node of a new cluster is reachable ("SLURM nodes not up"). Only one cluster runs at a time."""
        links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith("sksbr"):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
                tag = name[len("sksbr"):]
                for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
                    if ns.startswith(f"sks{tag}"):
                        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                        subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def _write_config(self) -> None:
        f = self.folder
        for d in ("state", "spool", "dev", "log", *(f"spool/{n}" for n in self.names)):
            (f / d).mkdir(parents=True, exist_ok=True)
        for g in range(self.gpus_per_node):  # character devices, as SLURM insists (null's numbers)
            dev = f / "dev" / f"gpu{g}"
            if not dev.exists():
                os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        gres = f"Gres=gpu:{self.gpus_per_node} " if self.gpus_per_node else ""
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={self.cpus_per_node} RealMemory=1000 {gres}State=UNKNOWN"
            for n, a in self.addresses.items())
        self.conf.write_text(f"""\
ClusterName=skytest
SlurmctldHost={CTLD_HOST}({CTLD_ADDRESS})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={f / 'munge.socket'}
CredType=cred/munge
StateSaveLocation={f / 'state'}
SlurmdSpoolDir={f / 'spool'}/%n
SlurmctldPidFile={f / 'slurmctld.pid'}
SlurmdPidFile={f / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={f / 'log' / 'slurmctld.log'}
SlurmdLogFile={f / 'log'}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=6
SlurmctldTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=2
MinJobAge=2
SchedulerParameters=sched_interval=1
PriorityType=priority/basic
MpiDefault=none
{nodes}
PartitionName=debug Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP
PartitionName=small Nodes={self.names[0]} MaxTime=INFINITE State=UP
""" + "".join(p + "\n" for p in self.extra_partitions))
        if self.gpus_per_node:
            last = self.gpus_per_node - 1
            (f / "gres.conf").write_text(f"Name=gpu File={f / 'dev'}/gpu[0-{last}]\n" if last else
                                         f"Name=gpu File={f / 'dev'}/gpu0\n")

    def _start_munge(self) -> None:
        f = self.folder
        key = f / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.daemons["munged"] = subprocess.Popen(
            [*DIE_WITH_US, "munged", "-F", "-f", f"--socket={f / 'munge.socket'}", f"--key-file={key}",
             f"--pid-file={f / 'munged.pid'}", f"--log-file={f / 'log' / 'munged.log'}",
             f"--seed-file={f / 'munged.seed'}"], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not (f / "munge.socket").exists():
            assert self.daemons["munged"].poll() is None, (f / "log" / "munged.log").read_text()
            assert time.monotonic() < deadline, "munged did not start"
            time.sleep(0.05)

    def _start_daemon(self, name: str, argv: list[str], hostname: str) -> None:
        log = open(self.folder / "log" / f"{name}.out", "w")
        self.daemons[name] = subprocess.Popen(
            # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup mounts slurmd reads.
            [*DIE_WITH_US, "nsenter", f"--net=/var/run/netns/{self.netns[name]}", "unshare", "--uts", "sh", "-c",
             f"hostname {hostname} && exec \"$@\"", "-", *argv],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True)

    def freeze_controller(self) -> None:
        """slurmctld stops answering (a hung or overloaded controller): the jobs stay, and nobody
        can cancel them until it answers again."""
        self.daemons["ctl"].send_signal(signal.SIGSTOP)

    def thaw_controller(self) -> None:
        self.daemons["ctl"].send_signal(signal.SIGCONT)

    def start_node(self, name: str) -> None:
        self._start_daemon(name, ["slurmd", "-D", "-f", str(self.conf)], name)

    # -- use ---------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, env={**os.environ, **self.env},
                              check=check, timeout=60)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout: float = 60.0, names: list[str] | None = None) -> None:
        names = names or self.names
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(n, "").startswith(("idle", "mix", "alloc")) for n in names):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM nodes not up: {states}\n{self.logs()}")
            for n, p in self.daemons.items():
                if p.poll() is not None and n != "munged" and (n == "ctl" or n in names):
                    raise RuntimeError(f"{n} exited ({p.returncode}):\n{self.logs()}")
            time.sleep(0.3)

    def queue(self) -> list[str]:
        """Every job still in the queue (pending, running, completing)."""
        out = self.run("squeue", "-h", "-o", "%i %j %T", check=False).stdout
        return [line for line in out.splitlines() if line.strip()]

    def wait_queue_empty(self, timeout: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := self.queue()) and time.monotonic() < deadline:
            time.sleep(0.3)
        return left

    def wait_running(self, job_id: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip() == "RUNNING":
                return
            time.sleep(0.2)
        raise RuntimeError(f"job {job_id} is not running after {timeout:g}s: {self.queue()}")

    def wait_queue_empty_of(self, job_id: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while any(line.split()[0] == job_id for line in self.queue()) and time.monotonic() < deadline:
            time.sleep(0.2)

    def kill_node(self, name: str) -> None:
        """The node dies: its slurmd and every process in its namespace (its job steps too)."""
        pids = subprocess.run(["ip", "netns", "pids", self.netns[name]], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.daemons[name].wait(timeout=10)

    def revive_node(self, name: str) -> None:
        self.start_node(name)
        self.run("scontrol", "update", f"nodename={name}", "state=resume", check=False)
        self.wait_idle(names=[name])

    def capture(self) -> Capture:
        """Every frame on the cluster's links (the host end of each namespace's veth: slurmctld's
        and every node's) from now until the capture is closed, read with AF_PACKET sockets."""
        return Capture([link for link in self._links if link != self.bridge])

    def logs(self) -> str:
        parts = []
        for p in sorted((self.folder / "log").glob("*")):
            text = p.read_text(errors="replace")[-3000:]
            parts.append(f"--- {p.name}\n{text}")
        return "\n".join(parts)

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        if "ctl" in self.daemons and self.daemons["ctl"].poll() is None:
            subprocess.run(["scancel", "--full", "--quiet", "-u", "root"], env={**os.environ, **self.env},
                           capture_output=True, timeout=30)
        for ns in self._made_ns:  # every process in a node's namespace: slurmd, its steps, the ranks
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name, p in reversed(list(self.daemons.items())):
            end(p, 10)
        self.daemons.clear()
        for ns in reversed(self._made_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in reversed(self._links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self._made_ns, self._links = [], []


class Capture:
    """Raw frames off network interfaces (AF_PACKET, root), as tcpdump would take them, kept in
    memory; `tcp_streams()` puts each TCP connection's payload back together, one byte string per
    direction, so a secret cut across two segments is still found."""

    def __init__(self, interfaces: list[str]):
        import socket
        import threading

        self.frames: list[bytes] = []
        self._socks = []
        for name in interfaces:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
            sock.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE: no drops while busy
            sock.bind((name, 0))
            self._socks.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import select

        while not self._stop.is_set():
            ready, _, _ = select.select(self._socks, [], [], 0.1)
            for sock in ready:
                self.frames.append(sock.recv(1 << 17))

    def close(self) -> None:
        time.sleep(0.3)  # the last frames in flight
        self._stop.set()
        self._thread.join()
        for sock in self._socks:
            while True:  # what is queued still
                try:
                    self.frames.append(sock.recv(1 << 17, 0x40))  # MSG_DONTWAIT
                except BlockingIOError:
                    break
        self.drops = sum(self._dropped(s) for s in self._socks)
        for sock in self._socks:
            sock.close()

    @staticmethod
    def _dropped(sock) -> int:
        import struct

        packets, drops = struct.unpack("II", sock.getsockopt(263, 6, 8))  # SOL_PACKET, PACKET_STATISTICS
        return drops

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tcp_streams(self) -> dict[tuple, bytes]:
        """(source, source port, destination, destination port) -> the payload sent that way, in
        order (sequence numbers; a segment seen on two links, or sent again, counts once)."""
        import ipaddress
        import struct

        segments: dict[tuple, dict[int, bytes]] = {}
        bases: dict[tuple, int] = {}
        for frame in self.frames:
            if len(frame) < 34 or frame[12:14] != b"\x08\x00":  # IPv4 only: the cluster's subnet is
                continue
            ip_header = (frame[14] & 0x0F) * 4
            total = struct.unpack("!H", frame[16:18])[0]
            if frame[23] != 6:  # TCP
                continue
            src, dst = (str(ipaddress.IPv4Address(frame[26:30])), str(ipaddress.IPv4Address(frame[30:34])))
            tcp = 14 + ip_header
            sport, dport, seq = struct.unpack("!HHI", frame[tcp:tcp + 8])
            payload = frame[tcp + (frame[tcp + 12] >> 4) * 4:14 + total] if total else frame[tcp + (frame[tcp + 12] >> 4) * 4:]
            if payload:
                flow = segments.setdefault((src, sport, dst, dport), {})
                base = bases.setdefault((src, sport, dst, dport), seq)
                offset = (seq - base) % (1 << 32)  # from the first segment seen: past a wrap-around too
                flow.setdefault(offset - (1 << 32) if offset >= 1 << 31 else offset, payload)
        streams = {}
        for flow, parts in segments.items():
            out, end = bytearray(), None
            for seq in sorted(parts):
                data = parts[seq]
                if end is not None and seq < end:
                    data = data[end - seq:]
                out += data
                end = max(end or 0, seq + len(parts[seq]))
            streams[flow] = bytes(out)
        return streams
