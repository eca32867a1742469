"""etcd, kube-apiserver, controller-manager and scheduler on loopback, with their certificates and
kubeconfigs: the half of `K8sCluster` that is not its nodes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable

from tests.harness.k8s.daemons import _killpg, _popen, _popen_kept, _reap
from tests.harness.k8s.layout import BIN, NODE_GRACE, NODE_IP, NODES, SERVICE_IP, SERVICE_SUBNET


class ControlPlane:
    def _openssl(self, *args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=self.pki)

    def _certificate(self, name: str, cn: str, org: str = "", ips: tuple[str, ...] = (),
                     dns: tuple[str, ...] = (), usage: str = "clientAuth") -> None:
        sans = [f"IP:{i}" for i in ips] + [f"DNS:{d}" for d in dns]
        (self.pki / f"{name}.cnf").write_text(
            "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\n" + (f"O = {org}\n" if org else "") + f"CN = {cn}\n"
            "[ext]\nbasicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature, keyEncipherment\n"
            f"extendedKeyUsage = {usage}\n" + (f"subjectAltName = {', '.join(sans)}\n" if sans else ""))
        self._openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                      "-keyout", f"{name}.key", "-out", f"{name}.crt", "-config", f"{name}.cnf", "-extensions", "ext",
                      "-CA", "ca.crt", "-CAkey", "ca.key", "-days", "3650")

    def _certificates(self) -> None:
        self._openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                      "-keyout", "ca.key", "-out", "ca.crt", "-subj", f"/CN=skytasks-test-ca-{self.tag}",
                      "-days", "3650", "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")
        cluster_names = ("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                         "kubernetes.default.svc.cluster.local", "localhost")
        self._certificate("apiserver", "kube-apiserver", ips=("127.0.0.1", *(n[1] for n in NODES), SERVICE_IP),
                          dns=cluster_names, usage="serverAuth")
        self._certificate("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        self._certificate("admin", "skytasks-admin", "system:masters")
        self._certificate("controller-manager", "system:kube-controller-manager")
        self._certificate("scheduler", "system:kube-scheduler")
        self._certificate("dns", "skytasks-dns", "system:masters")  # reads Services and Endpoints
        for n in self._nodes:  # each kubelet is its own Node to the Node authorizer
            self._certificate(f"kubelet-client-{n.index + 1}", f"system:node:{n.name}", "system:nodes")
            self._certificate(f"kubelet-{n.index + 1}", n.name, ips=(n.ip, "127.0.0.1"), dns=(n.name,),
                              usage="serverAuth")
        self._openssl("ecparam", "-genkey", "-name", "prime256v1", "-noout", "-out", "sa.key")
        self._openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub")

    def _kubeconfig(self, path: Path, user: dict, server: str | None = None) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "skytasks",
            "clusters": [{"name": "skytasks", "cluster": {"server": server or self.server,
                                                           "certificate-authority": str(self.ca_cert)}}],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "skytasks", "context": {"cluster": "skytasks", "user": "user"}}],
        }, indent=1))
        return path

    def _cert_user(self, name: str) -> dict:
        return {"client-certificate": str(self.pki / f"{name}.crt"), "client-key": str(self.pki / f"{name}.key")}

    def _write_kubeconfigs(self) -> None:
        self._kubeconfig(self.admin_kubeconfig, self._cert_user("admin"))
        for name in ("controller-manager", "scheduler"):
            self._kubeconfig(self.folder / f"{name}.kubeconfig", self._cert_user(name))

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        self.daemons["etcd"] = _popen(
            ["etcd", "--name", "default", "--data-dir", str(self.folder / "etcd"), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}", "--initial-cluster-state", "new",
             "--initial-cluster-token", f"skytasks-{self.tag}", "--logger", "zap", "--log-outputs", "stderr",
             "--snapshot-count", "10000"], self.logs_dir / "etcd.log")

    def _start_apiserver(self) -> None:
        p = self.pki
        hosts = self.folder / "apiserver-hosts"
        hosts.write_text(f"127.0.0.1 localhost {' '.join(self.nodes)}\n")
        argv = [str(BIN / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1", f"--secure-port={self.api_port}", "--insecure-port=0",
                f"--advertise-address={NODE_IP}",
                f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
                "--kubelet-preferred-address-types=Hostname",
                f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--api-audiences=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_SUBNET}",
                "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true", "--profiling=false", "--logtostderr=true", "--v=1"]
        # Its own mount namespace, where /etc/hosts gives each node's name (the address the
        # apiserver dials its kubelet at) as 127.0.0.1: the host's end of that kubelet's bridge.
        self._apiserver_command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                   'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]
        self.daemons["apiserver"] = _popen(self._apiserver_command, self.logs_dir / "apiserver.log")
        # The apiserver, as pods and the kubelet see it: a unix socket they reach by bridges.
        self.daemons["api-bridge"] = _popen(
            ["socat", f"UNIX-LISTEN:{self.run_dir / 'api.sock'},fork,unlink-early",
             f"TCP:127.0.0.1:{self.api_port}"], self.logs_dir / "api-bridge.log")
        # Each kubelet, as the apiserver sees it: a port of the host's loopback.
        for n in self._nodes:
            self.daemons[f"kubelet-bridge-{n.index + 1}"] = _popen(
                ["socat", f"TCP-LISTEN:{n.kubelet_port},bind=127.0.0.1,fork,reuseaddr",
                 f"UNIX-CONNECT:{n.kubelet_sock}"], self.logs_dir / f"kubelet-bridge-{n.index + 1}.log")

    def _get(self, path: str, timeout: float = 2.0, method: str = "GET", body: dict | None = None) -> tuple[int, str]:
        """The apiserver as the admin, without the `kubernetes` client (a PATCH is a JSON merge
        patch)."""
        import ssl

        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        ctx.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")
        kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
        request = urllib.request.Request(self.server + path, method=method, data=json.dumps(body).encode()
                                         if body is not None else None, headers={"Content-Type": kind})
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def _check_daemons(self) -> None:
        nodes = [(f"node {n.name}", n.process) for n in self._nodes if n.process is not None]
        for name, p in [*self.daemons.items(), *nodes]:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.logs()}")

    def _poll(self, done: Callable[[], bool], deadline: float, not_yet: Callable[[], str], every: float) -> None:
        """Until `done()` (an OSError from the API counts as not yet), failing at once if a daemon
        exited, and at `deadline` with `not_yet()` and the logs."""
        while True:
            self._check_daemons()
            try:
                if done():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{not_yet()}:\n{self.logs()}")
            time.sleep(every)

    def _wait_apiserver(self, deadline: float) -> None:
        self._poll(lambda: self._get("/readyz")[0] == 200, deadline, lambda: "the apiserver is not ready", 0.1)

    def _start_controllers(self) -> None:
        p = self.pki
        self.daemons["controller-manager"] = _popen(
            [str(BIN / "kube-controller-manager"), f"--kubeconfig={self.folder / 'controller-manager.kubeconfig'}",
             "--leader-elect=false", "--port=0", "--secure-port=0", "--bind-address=127.0.0.1",
             f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
             "--use-service-account-credentials=true", f"--service-cluster-ip-range={SERVICE_SUBNET}",
             f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
             "--controllers=*,-cloud-node-lifecycle,-route,-service", "--profiling=false",
             f"--node-monitor-grace-period={NODE_GRACE}s", "--node-monitor-period=1s",
             "--logtostderr=true", "--v=1"], self.logs_dir / "controller-manager.log")
        self.daemons["scheduler"] = _popen(
            [str(BIN / "kube-scheduler"), f"--kubeconfig={self.folder / 'scheduler.kubeconfig'}",
             "--leader-elect=false", "--port=0", "--secure-port=0", "--bind-address=127.0.0.1",
             "--profiling=false", "--logtostderr=true", "--v=1"], self.logs_dir / "scheduler.log")

    def restart_apiserver(self, timeout: float = 60.0, down_for: float = 0.0) -> float:
        """A control-plane restart: the kube-apiserver SIGKILLed, which cuts every watch and exec
        stream through it at once (on SIGTERM it drains them for up to a minute), and started
        again `down_for` seconds later with the same command line and environment; nothing else
        is touched (etcd, the bridges, the kubelets, the pods and what was exec'd into them run
        on). Returns the seconds from its start until it answers /readyz again."""
        old = self.daemons["apiserver"]
        _killpg(old, signal.SIGKILL)
        _reap(old)
        time.sleep(down_for)
        t0 = time.monotonic()
        # From a thread of its own that waits on it: the kernel ends the apiserver when the thread
        # that started it exits (_popen's pdeathsig), and a caller's thread may restart it.
        self.daemons["apiserver"] = _popen_kept(self._apiserver_command, self.logs_dir / "apiserver.log")
        self._wait_apiserver(t0 + timeout)
        self.timings["restart:apiserver"] = took = time.monotonic() - t0
        return took
