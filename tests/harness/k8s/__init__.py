"""A real Kubernetes (v1.20.2) for tests: etcd, kube-apiserver, controller-manager and scheduler on
loopback, and one or two real nodes (containerd, runc and a kubelet each) in namespaces of their own.

The binaries are Debian bookworm's Kubernetes source built once per machine by
`scripts/k8s/build.sh` (cached in ~/.cache/skytasks/k8s-v1.20.2/bin); `make system-deps` runs it.

- The control plane listens on 127.0.0.1 only, on free ports. Certificates come from openssl (one
  CA), authorization is Node,RBAC, service-account tokens are signed with a key pair made here.
  The apiserver runs in a mount namespace of its own whose /etc/hosts names every node 127.0.0.1:
  it reaches each kubelet (logs, exec) through a socat bridge of that node, and never asks a DNS
  server.
- Each node (`K8sCluster(folder, nodes=2)`: NODES[0] and NODES[1]) runs in its own pid, mount, net
  and uts namespaces (`unshare`): its address (192.0.2.0/24, a documentation range) on a veth of
  its own, its pods on the bridge CNI in its half of POD_SUBNET (198.51.100.0/24), fresh /run,
  /var/lib and /var/log, its own containerd, and files bind-mounted over the kernel settings the
  kubelet would otherwise change for the whole machine. Two nodes are joined by one veth pair made
  straight into their two namespaces (it never exists in the machine's own), with routes to each
  other's address and pods: pods reach each other by pod IP across nodes. Nothing sent from a
  node or its pods leaves the namespaces but through its socat bridges over unix sockets (to the
  apiserver, and from the host's loopback to its kubelet). The kubelets' cgroups live under a
  root of the cluster's own (`cgroup_root`, one folder per node in it), removed when it stops.
- The `kubernetes` Service's ClusterIP (SERVICE_IP, 203.0.113.1, a documentation range) is an
  address of every node namespace, where a socat takes port 443 to the apiserver: a pod's
  `load_incluster_config()` works with the variables the kubelet injects (no kube-proxy needed).
- A small DNS server on each node's address (its pods' nameserver) answers
  `service.namespace.svc.cluster.local` and a headless Service's
  `hostname.subdomain.namespace.svc.cluster.local` from the API, and nothing else (it forwards no
  query).
- Images come from no registry: IMAGE is a few empty folders whose command is the host's Python,
  run by mounting the host's interpreter and this repository read-only (`host_python_template`);
  PAUSE_IMAGE is the pods' sandbox (a static `pause` built with the binaries).
- A node can be lost as a machine is (`kill_node`: its namespaces die with every process in them,
  pods included; its Node object stays and goes NotReady within NODE_GRACE seconds) and come back
  (`restart_node`). `set_gpus`, `label_node` and `taint_node` make a node look like a cloud's.

Every daemon dies with the process that started it (PR_SET_PDEATHSIG, and a node's pid
namespace dies with its first process), so a killed test session leaves no daemon running; a
later start removes the cgroups such a session left. `stop()` leaves nothing: no process,
namespace, mount, veth or cgroup, and no state in `folder` but the logs.
"""

from tests.harness.k8s.cgroups import _v1_hierarchies
from tests.harness.k8s.cluster import K8sCluster
from tests.harness.k8s.layout import (
                                      BIN,
                                      CACHE,
                                      IMAGE,
                                      NODE_GRACE,
                                      NODE_IP,
                                      NODE_NAME,
                                      NODES,
                                      PAUSE_IMAGE,
                                      POD_SUBNET,
                                      SERVICE_IP,
                                      SERVICE_SUBNET,
                                      VERSION,
                                      available,
                                      free_ports,
)
from tests.harness.k8s.nodes import Node

__all__ = ["BIN", "CACHE", "IMAGE", "NODE_GRACE", "NODE_IP", "NODE_NAME", "NODES", "PAUSE_IMAGE", "POD_SUBNET",
           "SERVICE_IP", "SERVICE_SUBNET", "VERSION", "K8sCluster", "Node", "_v1_hierarchies", "available",
           "free_ports"]
