"""Pid 1 of a test node's namespaces: run by `unshare` as `python -S -E node_init.py node SPEC`, so
it imports nothing but the standard library (no site, no package around it).

It binds a fresh /run, /var/lib, /var/log and the kernel settings the kubelet writes, brings up
the node's address, serves its pods' DNS, and starts containerd, the socat bridges and the
kubelet; it reaps every orphan of the namespace."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

SERVICE_IP = "203.0.113.1"  # the `kubernetes` Service: an address of every node namespace
# What the kubelet writes for the whole machine unless told not to (protectKernelDefaults: false
# only stops it from failing when they differ): each gets a file of its own bound over it.
KERNEL_SETTINGS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


def _serve_dns(spec: dict) -> None:
    """A small DNS server on the node's address, port 53 (its pods' nameserver), that answers A queries for
    `service.namespace.svc.cluster.local` (its ClusterIP, or a headless Service's pod IPs) and
    `hostname.service.namespace.svc.cluster.local` (a pod of a headless Service, by its hostname
    and subdomain) from the API, and no others: it forwards nothing anywhere."""
    import ssl
    import struct

    ctx = ssl.create_default_context(cafile=spec["ca"])
    ctx.load_cert_chain(spec["dns_cert"], spec["dns_key"])
    base = f"https://127.0.0.1:{spec['api_port']}/api/v1/namespaces"

    def get(path: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"{base}/{path}", context=ctx, timeout=3) as r:
                return json.loads(r.read())
        except Exception:
            return None

    def addresses(endpoints: dict | None, hostname: str | None = None) -> list[str]:
        return [a["ip"] for sub in (endpoints or {}).get("subsets") or [] for a in sub.get("addresses") or []
                if hostname is None or a.get("hostname") == hostname]

    def lookup(name: str) -> list[str] | None:  # None: no such name
        if not name.endswith(".svc.cluster.local"):
            return None
        parts = name[: -len(".svc.cluster.local")].split(".")
        if len(parts) == 2:
            svc = get(f"{parts[1]}/services/{parts[0]}")
            if svc is None:
                return None
            ip = svc.get("spec", {}).get("clusterIP")
            return [ip] if ip and ip != "None" else addresses(get(f"{parts[1]}/endpoints/{parts[0]}"))
        if len(parts) == 3:
            return addresses(get(f"{parts[2]}/endpoints/{parts[1]}"), parts[0]) or None
        return None

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((spec["ip"], 53))
    while True:
        query, peer = sock.recvfrom(512)
        try:
            qid, flags, qdcount = struct.unpack("!HHH", query[:6])
            labels, i = [], 12
            while query[i]:
                labels.append(query[i + 1:i + 1 + query[i]].decode().lower())
                i += 1 + query[i]
            qtype = struct.unpack("!H", query[i + 1:i + 3])[0]
            question = query[12:i + 5]
            found = lookup(".".join(labels))
            answers = [ip for ip in found or [] if qtype == 1]
            rcode = 3 if found is None else 0  # NXDOMAIN
            reply = struct.pack("!HHHHHH", qid, 0x8400 | (flags & 0x0100) | rcode, 1, len(answers), 0, 0) + question
            for ip in answers:
                reply += struct.pack("!HHHLH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip)
            sock.sendto(reply, peer)
        except Exception:
            pass



def _node_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    node, logs, suffix = Path(spec["node"]), Path(spec["logs"]), spec["suffix"]

    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True)

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(logs / f"{name}{suffix}.log", "ab"),
                                stderr=subprocess.STDOUT)

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # and the kernel ends the rest
    sh("hostname", spec["name"])
    # Fresh /run, /var/lib, /var/log: the kubelet and containerd hard-code paths there.
    for src, dst in (("run", "/run"), ("var-lib", "/var/lib"), ("var-log", "/var/log")):
        sh("mount", "--bind", str(node / src), dst)
    # The machine's kernel settings the kubelet writes: it writes files of its own instead.
    for setting in KERNEL_SETTINGS:
        target = Path("/proc/sys") / setting
        if target.exists():
            copy = node / "kernel" / setting.replace("/", ".")
            copy.write_text(target.read_text())
            sh("mount", "--bind", str(copy), str(target))
    if not os.path.islink("/etc/resolv.conf"):
        sh("mount", "--bind", str(node / "resolv.conf"), "/etc/resolv.conf")
    # The node's address on a veth of its own (the kubelet wants it on an interface, and it must
    # outlive the link to the other node, which goes when that node is lost): a /32, the routes
    # to the other node come with that link.
    for argv in (["link", "set", "lo", "up"], ["addr", "add", f"{SERVICE_IP}/32", "dev", "lo"],
                 ["link", "add", "eth0", "type", "veth", "peer", "name", "eth1"],
                 ["addr", "add", f"{spec['ip']}/32", "dev", "eth0"],
                 ["link", "set", "eth0", "up"], ["link", "set", "eth1", "up"]):
        sh("ip", *argv)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # this namespace's own
    (node / "net-ready").touch()
    threading.Thread(target=_serve_dns, args=(spec,), daemon=True).start()
    procs = {
        "containerd": start("containerd", ["containerd", "--config", str(node / "containerd.toml")]),
        # The apiserver, for pods (the `kubernetes` Service's port) and the kubelet.
        "api-443": start("node-api-bridge", ["socat", "TCP-LISTEN:443,fork,reuseaddr",
                                             f"UNIX-CONNECT:{spec['api_sock']}"]),
        "api": start("node-api-bridge", ["socat", f"TCP-LISTEN:{spec['api_port']},fork,reuseaddr",
                                         f"UNIX-CONNECT:{spec['api_sock']}"]),
        # The kubelet, for the apiserver (logs, exec).
        "kubelet-bridge": start("node-kubelet-bridge", [
            "socat", f"UNIX-LISTEN:{spec['kubelet_sock']},fork,unlink-early",
            f"TCP:127.0.0.1:{spec['kubelet_port']}"]),
    }
    waiting_kubelet = True
    while True:
        # The kubelet starts with containerd, before the apiserver answers: it registers the
        # node as soon as it does (about 4 s sooner Ready than a kubelet started after it).
        if waiting_kubelet and Path(spec["containerd_sock"]).exists():
            procs["kubelet"] = start("kubelet", spec["kubelet"])
            waiting_kubelet = False
        try:  # pid 1 reaps every orphan of the namespace
            while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
                for name, p in procs.items():
                    if p.pid == pid:
                        p.returncode = -1
                        print(f"node: {name} exited", flush=True)
        except ChildProcessError:
            pass
        time.sleep(0.05)


if __name__ == "__main__":
    if sys.argv[1:2] == ["node"]:
        _node_main(sys.argv[2])
