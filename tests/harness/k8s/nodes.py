"""The test cluster's nodes: each a machine in namespaces of its own, started, joined, lost and
brought back, and made to look like a cloud's (labels, taints, GPUs)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness.k8s import node_init
from tests.harness.k8s.daemons import _children, _kill, _popen_kept, _reap
from tests.harness.k8s.images import pause_image_tar, python_image_tar
from tests.harness.k8s.layout import BIN, PAUSE_IMAGE


@dataclass
class Node:
    """One node of the cluster: what its kubelet is told, and the namespaces it runs in."""

    index: int
    name: str
    ip: str
    pod_subnet: str
    gateway: str
    kubelet_port: int  # the kubelet's port in its namespace and its bridge's on the host's loopback
    healthz_port: int
    cgroup_root: str  # the kubelet's cgroupRoot: a folder of the cluster's cgroup root
    dir: Path  # its configuration, /run, /var/lib, /var/log and containerd's root
    containerd_sock: Path
    kubelet_sock: Path
    process: subprocess.Popen | None = field(default=None, repr=False)  # unshare; None once killed

    def init_pid(self, timeout: float = 10.0) -> int:
        """The node's pid 1 (unshare's child): in its namespaces once it exists."""
        deadline = time.monotonic() + timeout
        while self.process is not None:
            children = _children(self.process.pid)
            if children:
                return children[0]
            if self.process.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        raise RuntimeError(f"node {self.name} is not running")

class NodeLifecycle:
    def _start_node(self, node: Node) -> tuple[threading.Thread, list[BaseException]]:
        """Writes the node's configuration and starts its namespaces, where containerd and then
        its kubelet start at once. Returns the thread that imports the images into its containerd."""
        n, i = node.dir, node.index + 1
        shutil.rmtree(n, ignore_errors=True)  # a restarted node starts as a machine that boots afresh
        for d in ("run", "var-lib", "var-log", "cni", "kernel", "containerd"):
            (n / d).mkdir(parents=True)
        for sock in (node.containerd_sock, node.kubelet_sock):  # a killed node's, which nothing serves
            sock.unlink(missing_ok=True)
        (n / "resolv.conf").write_text("nameserver 127.0.0.1\noptions ndots:5 timeout:1 attempts:1\n")
        (n / "cni" / "10-skytasks.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "skytasks", "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": node.pod_subnet, "gateway": node.gateway}]],
                         "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(n / "cni-ipam")}}]}))
        (n / "containerd.toml").write_text(f"""\
version = 2
root = "{n / 'containerd'}"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{node.containerd_sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{n / 'containerd-opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/{PAUSE_IMAGE}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{n / 'cni'}"
""")
        (n / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "port": node.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": node.healthz_port,
            "tlsCertFile": str(self.pki / f"kubelet-{i}.crt"), "tlsPrivateKeyFile": str(self.pki / f"kubelet-{i}.key"),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": node.cgroup_root,
            "clusterDomain": "cluster.local", "clusterDNS": [node.ip], "resolvConf": str(n / "resolv.conf"),
            "failSwapOn": False, "makeIPTablesUtilChains": False, "protectKernelDefaults": False,
            "nodeStatusUpdateFrequency": "2s", "nodeStatusReportFrequency": "2s",
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                             "imagefs.available": "1%"},
            "serializeImagePulls": False, "runtimeRequestTimeout": "2m",
        }))
        kubeconfig = self._kubeconfig(n / "kubelet.kubeconfig", self._cert_user(f"kubelet-client-{i}"))
        kubelet = [str(BIN / "kubelet"), f"--config={n / 'kubelet.yaml'}", f"--kubeconfig={kubeconfig}",
                   "--container-runtime=remote", f"--container-runtime-endpoint=unix://{node.containerd_sock}",
                   f"--node-ip={node.ip}", f"--hostname-override={node.name}", "--root-dir=/var/lib/kubelet",
                   f"--cert-dir={n / 'kubelet-pki'}", "--logtostderr=true", "--v=1"]
        spec = {"name": node.name, "ip": node.ip, "node": str(n), "logs": str(self.logs_dir), "suffix": f"-{i}",
                "api_sock": str(self.run_dir / "api.sock"), "api_port": self.api_port,
                "containerd_sock": str(node.containerd_sock), "kubelet_sock": str(node.kubelet_sock),
                "kubelet_port": node.kubelet_port, "kubelet": kubelet,
                "ca": str(self.ca_cert), "dns_cert": str(self.pki / "dns.crt"), "dns_key": str(self.pki / "dns.key")}
        (n / "spec.json").write_text(json.dumps(spec))
        # pid 1 of a pid namespace: when it dies, so does every process in it (containers too).
        # unshare dies with this process (setpriv, from a thread that waits on it) and takes its
        # child with it (--kill-child).
        node.process = _popen_kept(
            ["unshare", "--fork", "--pid", "--mount-proc", "--mount", "--net", "--uts", "--propagation", "private",
             "--kill-child=KILL", sys.executable, "-S", "-E", node_init.__file__, "node", str(n / "spec.json")],
            self.logs_dir / f"node-{i}.log")
        return self._in_thread(self._import_images, node)

    def _link_nodes(self, a: Node, b: Node) -> None:
        """One veth pair made straight into the two nodes' network namespaces (named `peer` in
        both: it never exists in the machine's own), and in each the routes to the other's
        address and to its pods. Either end dies with its namespace, and the other with it."""
        for x in (a, b):  # its own address is up (the routes' `src`) once net-ready is written
            deadline = time.monotonic() + 30
            while not (x.dir / "net-ready").exists():
                if x.process is None or x.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node {x.name} has no network")
                time.sleep(0.01)
        pid_a, pid_b = a.init_pid(), b.init_pid()
        subprocess.run(["ip", "link", "add", "peer", "netns", str(pid_a), "type", "veth", "peer", "name", "peer",
                        "netns", str(pid_b)], check=True, capture_output=True)
        for (x, pid), y in (((a, pid_a), b), ((b, pid_b), a)):
            # The node's address on `peer` too: the ARP requests it sends there (for a pod's
            # packet) then say it, not another address of its own, such as SERVICE_IP, which the
            # other node has too and so drops as a martian source.
            routes = (f"addr add {x.ip}/32 dev peer\nlink set peer up\nroute add {y.ip}/32 dev peer src {x.ip}\n"
                      f"route add {y.pod_subnet} via {y.ip} dev peer src {x.ip}\n")
            subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"], input=routes.encode(),
                           check=True, capture_output=True)

    def _image_tars(self) -> list[Path]:
        """The pause and python images as `docker save` tars, written once for every node."""
        with self._images_lock:
            folder = self.folder / "images"
            if not folder.exists():
                folder.mkdir()
                (folder / "pause.tar").write_bytes(pause_image_tar())
                (folder / "python.tar").write_bytes(python_image_tar())
            return [folder / "pause.tar", folder / "python.tar"]

    def _import_images(self, node: Node) -> None:
        deadline = time.monotonic() + 30
        while not node.containerd_sock.exists():
            if node.process is None or node.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start on {node.name}")
            time.sleep(0.05)
        for tar in self._image_tars():
            try:
                subprocess.run(["ctr", "--address", str(node.containerd_sock), "-n", "k8s.io", "images", "import",
                                str(tar)], check=True, capture_output=True, timeout=60)
            except subprocess.CalledProcessError as e:
                raise RuntimeError(f"{e}: {e.stderr!r}") from None

    def node_condition(self, name: str | None = None) -> str | None:
        """The status of the node's Ready condition ("True", "False", or "Unknown" for a node
        whose kubelet went silent), or None before it has one. The first node if not named."""
        code, body = self._get(f"/api/v1/nodes/{name or self.node_name}")
        if code != 200:
            return None
        conditions = json.loads(body).get("status", {}).get("conditions", [])
        return next((c["status"] for c in conditions if c["type"] == "Ready"), None)

    def node_ready(self, name: str | None = None) -> bool:
        return self.node_condition(name) == "True"

    def wait_ready(self, deadline: float, t0: float | None = None) -> None:
        """Until every running node is Ready and the `default` service account has its token
        (noting in `timings` when each node was, from t0)."""
        waiting = {n.name for n in self._nodes if n.process is not None}

        def ready() -> bool:
            for name in sorted(waiting):
                if self.node_ready(name):
                    waiting.discard(name)
                    if t0 is not None:
                        self.timings[f"node_ready:{name}"] = time.monotonic() - t0
            return not waiting and self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200

        self._poll(ready, deadline, lambda: f"not Ready: {sorted(waiting)}", 0.2)

    def wait_node(self, name: str, ready: bool = True, timeout: float = 60.0) -> float:
        """Polls until the node is Ready (ready=True) or is not (False: NotReady or Unknown, as a
        lost node becomes within NODE_GRACE s); returns the seconds it took."""
        t0 = time.monotonic()
        while True:
            try:
                if self.node_ready(name) == ready:
                    return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"node {name} is still {self.node_condition(name)!r} after {timeout} s")
            time.sleep(0.2)

    # -- lost nodes, and nodes as a cloud's ------------------------------------------------------

    def kill_node(self, name: str) -> None:
        """The node's machine goes away: SIGKILL to its pid 1 ends every process in its
        namespaces at once (kubelet, containerd, its pods' processes), and the namespaces and
        their mounts and veths with them. Its Node object stays, and goes NotReady (Ready
        "Unknown") within NODE_GRACE s; its pods stay in the API as they were. `restart_node`
        brings it back."""
        node = self.node(name)
        p, node.process = node.process, None
        if p is not None:
            for pid in _children(p.pid):
                _kill(pid, signal.SIGKILL)
            _reap(p)

    def restart_node(self, name: str, timeout: float = 90.0) -> float:
        """A killed node boots again, with nothing of its former state (containers, pod IPs),
        and joins the other node again; returns once its Node is Ready (seconds). Pods still
        bound to it in the API are started again by its kubelet, as after a reboot."""
        node = self.node(name)
        if node.process is not None:
            raise RuntimeError(f"node {name} is running")
        t0 = time.monotonic()
        helpers = [self._start_node(node)]
        for other in self._nodes:
            if other is not node and other.process is not None:
                helpers.append(self._in_thread(self._link_nodes, *sorted((node, other), key=lambda x: x.index)))
        self._join(helpers, t0 + timeout)
        self.wait_node(name, True, max(1.0, t0 + timeout - time.monotonic()))
        self.timings[f"restart:{name}"] = took = time.monotonic() - t0
        return took

    # -- nodes as a cloud's ------------------------------------------------------------------

    def label_node(self, name: str, labels: dict[str, str | None]) -> None:
        """Sets the node's labels (None removes one), as a cloud labels a node it adds."""
        self._patch_node(name, {"metadata": {"labels": labels}})

    def taint_node(self, name: str, key: str, value: str = "", effect: str = "NoSchedule") -> None:
        """Adds a taint (or sets its value), as a booting or reserved node carries one. The node
        lifecycle controller owns the `node.kubernetes.io/*` taints and lifts them from a Ready
        node within seconds: to hold pods off a node, taint it with a key of your own."""
        self._update_taints(name, lambda taints: [t for t in taints if (t["key"], t["effect"]) != (key, effect)]
                            + [{"key": key, "value": value, "effect": effect} if value else
                               {"key": key, "effect": effect}])

    def untaint_node(self, name: str, key: str, effect: str | None = None) -> None:
        """Lifts the node's taints with that key (of that effect only, if given)."""
        self._update_taints(name, lambda taints: [t for t in taints
                                                  if t["key"] != key or (effect and t["effect"] != effect)])

    def set_gpus(self, name: str, count: int, product: str | None = None) -> None:
        """The node advertises `count` GPUs as NVIDIA's device plugin would (`nvidia.com/gpu`
        in its status capacity; its kubelet keeps it) and, given `product`, carries GPU Feature
        Discovery's labels (`nvidia.com/gpu.product`, `nvidia.com/gpu.count`). count=0 takes
        all of it away. Returns once the scheduler can count them (allocatable, about 2.5 s)."""
        want = str(count) if count else None
        code, body = self._get(f"/api/v1/nodes/{name}/status", method="PATCH",
                               body={"status": {"capacity": {"nvidia.com/gpu": want}}})
        if code != 200:
            raise RuntimeError(f"node {name} status: {code} {body}")
        self.label_node(name, {"nvidia.com/gpu.product": product if count else None,
                               "nvidia.com/gpu.count": want if product else None})
        deadline = time.monotonic() + 30
        while json.loads(self._get(f"/api/v1/nodes/{name}")[1])["status"].get("allocatable", {}).get(
                "nvidia.com/gpu") != want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {name} does not show nvidia.com/gpu={want} as allocatable")
            time.sleep(0.2)

    def _patch_node(self, name: str, patch: dict) -> dict:
        code, body = self._get(f"/api/v1/nodes/{name}", method="PATCH", body=patch)
        if code != 200:
            raise RuntimeError(f"node {name}: {code} {body}")
        return json.loads(body)

    def _update_taints(self, name: str, change) -> None:
        """Read, change, write back with the resourceVersion read: the node lifecycle controller
        writes taints too, and a lost race (409) reads again."""
        for _ in range(20):
            code, body = self._get(f"/api/v1/nodes/{name}")
            if code != 200:
                raise RuntimeError(f"node {name}: {code} {body}")
            got = json.loads(body)
            taints = change(got["spec"].get("taints") or [])
            code, body = self._get(f"/api/v1/nodes/{name}", method="PATCH", body={
                "metadata": {"resourceVersion": got["metadata"]["resourceVersion"]}, "spec": {"taints": taints}})
            if code == 200:
                return
            if code != 409:
                raise RuntimeError(f"node {name} taints: {code} {body}")
        raise RuntimeError(f"node {name} taints: too many conflicting writes")
