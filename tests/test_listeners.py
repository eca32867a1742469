"""No listener of a pool on every interface (issue 53, API.md "Security").

During a call, each node's first rank lists the TCP sockets in LISTEN state that the processes
of its node hold (its agent and everything below it: the rank template, the ranks, a script's
processes), from the kernel's own tables (/proc/net/tcp{,6} of the node's network namespace,
matched to the processes' socket descriptors). None may be on 0.0.0.0 or ::, and the head's
TCPStore must be among them, on MASTER_PORT at the address the peers reach the head by.
Checked for a @distributed_task call and a run_script script, on local, ssh (namespaced hosts),
slurm and kubernetes.
"""

from __future__ import annotations

import errno
import inspect
import ipaddress
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from skytasks import GPUPool, ScriptResult, distributed_task, rank_info, run_script
from skytasks.node import socket_interface
from skytasks.node.ports import free_port
from tests.harness.netns import bridged_hosts, netns_pool
from tests.harness.workloads import regression_module


# --- what runs on the nodes (standard library only: a script imports it as probe.py) --------

def _descendants(root: int) -> set[int]:
    """`root` and every process below it, from each process's parent in /proc/<pid>/stat."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _socket_owners(pids: set[int]) -> dict[int, int]:
    """Socket inode -> the pid holding it."""
    owners: dict[int, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    owners[int(target[8:-1])] = pid
        except OSError:
            continue
    return owners


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four host-order words
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def pool_listeners(agent: int) -> list[dict]:
    """Every listening TCP socket held by `agent` or a process below it, as this network
    namespace's kernel tables list them."""
    pids = _descendants(agent)
    owners = _socket_owners(pids)
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[9]) in owners:  # 0A: LISTEN
                address, port = _address(fields[1])
                pid = owners[int(fields[9])]
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    command = "?"
                found.append({"address": address, "port": port, "pid": pid, "command": command})
    return found


def head_addresses(head_addr: str) -> list[str]:
    """What the head's name or address is, here."""
    return sorted({str(i[4][0]) for i in socket.getaddrinfo(head_addr, None, type=socket.SOCK_STREAM)})


# --- a @distributed_task call ----------------------------------------------------------------

def listeners_during_a_call() -> dict:
    import torch.distributed as dist

    info = rank_info()
    dist.barrier()  # every rank has joined: the store, gloo's listeners and the relay are open
    seen = pool_listeners(os.getppid()) if info.local_rank == 0 else None  # a rank's parent is its agent
    dist.barrier()  # nobody leaves before every node has looked
    return {"rank": info.rank, "node_rank": info.node_rank, "head_port": info.head_port,
            "head": head_addresses(info.head_addr) if info.rank == 0 else None, "listeners": seen,
            "pids": {"rank": os.getpid(), "agent": os.getppid()}}


def check(results: list[dict], nodes: int, head: set[str]) -> list[dict]:
    """No wildcard; the store on MASTER_PORT at the head's address, held by a process of the head's
    node. Returns every listener seen."""
    looked = [r for r in results if r["listeners"] is not None]
    assert sorted(r["node_rank"] for r in looked) == list(range(nodes))  # every node looked
    seen = [dict(lst, node_rank=r["node_rank"]) for r in looked for lst in r["listeners"]]
    wildcard = [s for s in seen if ipaddress.ip_address(s["address"]).is_unspecified]
    assert not wildcard, f"listening on every interface: {wildcard}"
    port = results[0]["head_port"]
    store = [s for s in seen if s["port"] == port and s["node_rank"] == 0]
    assert store and {s["address"] for s in store} <= head, (store, head)
    return seen


SCRIPT = """\
import json, os, sys
import torch.distributed as dist
from probe import pool_listeners, head_addresses

dist.init_process_group("gloo")  # env://, as under torchrun
dist.barrier()
rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
# This script's parent is its skytasks rank, whose parent is the node's agent.
agent = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])
seen = pool_listeners(agent) if local_rank == 0 else None
dist.barrier()
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump({"rank": rank, "node_rank": int(os.environ["NODE_RANK"]), "listeners": seen,
               "head_port": int(os.environ["MASTER_PORT"]), "store_host": os.getppid() if rank == 0 else None,
               "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"],
               "head": head_addresses(os.environ["MASTER_ADDR"]) if rank == 0 else None}, f)
dist.destroy_process_group()
"""


def script_project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "listen_probe.py").write_text(SCRIPT)
    probe = [inspect.getsource(f) for f in (_descendants, _socket_owners, _address, pool_listeners, head_addresses)]
    (root / "probe.py").write_text("import os\nimport socket\n\n\n" + "\n\n".join(probe))
    return root


def run_probe_script(pool: GPUPool, tmp_path: Path) -> list[dict]:
    project, out = script_project(tmp_path / "project"), tmp_path / "out"
    out.mkdir(mode=0o777)
    os.chmod(out, 0o777)
    world = pool.nodes * pool.procs_per_node
    assert run_script("listen_probe.py", [str(out)], workdir=project, pool=pool) == [
        ScriptResult(rank=r, exit_code=0) for r in range(world)]
    results = [json.loads((out / f"{r}.json").read_text()) for r in range(world)]
    assert {r["agent_store"] for r in results} == {"True"}  # every script rank is the store's client
    return results


def check_script(results: list[dict], nodes: int, head: set[str]) -> None:
    seen = check(results, nodes, head)
    # The store is hosted by rank 0's skytasks rank (the script's parent), not by the script.
    store = [s for s in seen if s["port"] == results[0]["head_port"] and s["node_rank"] == 0]
    assert {s["pid"] for s in store} == {results[0]["store_host"]}, store


# --- local -------------------------------------------------------------------------------------

def test_a_local_pool_listens_on_loopback_only_during_a_call():
    results = distributed_task(listeners_during_a_call, pool=GPUPool(nodes=2, procs_per_node=2))()
    seen = check(results, 2, {"127.0.0.1"})
    assert {s["address"] for s in seen} <= {"127.0.0.1"}, seen
    store = [s for s in seen if s["port"] == results[0]["head_port"]]
    assert {s["pid"] for s in store} == {results[0]["pids"]["rank"]}  # rank 0 holds it, on 127.0.0.1


def test_a_local_run_script_listens_on_loopback_only(tmp_path):
    results = run_probe_script(GPUPool(nodes=2, procs_per_node=2), tmp_path)
    check_script(results, 2, {"127.0.0.1"})
    assert {s["address"] for r in results for s in r["listeners"] or ()} <= {"127.0.0.1"}


# --- the head's listener, as decided (no cluster) -----------------------------------------------

def test_the_store_listener_binds_the_head_address_and_says_when_the_port_is_taken():
    port = free_port("127.0.0.1")
    with socket_interface.peer_listener("127.0.0.1", port, ["127.0.0.1"]) as sock:
        assert sock.getsockname() == ("127.0.0.1", port)
        with pytest.raises(OSError) as taken:
            socket_interface.peer_listener("127.0.0.1", port, ["127.0.0.1"])
        assert taken.value.errno == errno.EADDRINUSE
    with socket_interface.peer_listener("localhost", port, ["localhost"]) as sock:
        assert ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def test_a_head_name_that_means_loopback_here_is_not_used_when_peers_are_elsewhere():
    # A host's own name resolving to 127.0.1.1 (Debian) is no address its peers reach.
    chosen = socket_interface._candidates("127.0.1.1", ["10.231.53.3"])
    assert all(not ipaddress.ip_address(a).is_loopback for _, a in chosen)
    assert (socket.AF_INET, "127.0.1.1") in socket_interface._candidates("127.0.1.1", ["127.0.1.1"])
    assert socket_interface._candidates("0.0.0.0", []) == [] or all(
        not ipaddress.ip_address(a).is_unspecified for _, a in socket_interface._candidates("0.0.0.0", []))


# --- ssh: two hosts in network namespaces -------------------------------------------------------

SUBNET = "10.231.53"  # not test_multihost's: the two may run at once


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with bridged_hosts(tmp_path_factory.mktemp, SUBNET, "sktl") as made:
        yield made


def test_ssh_hosts_listen_on_their_own_address_only_during_a_call(hosts):
    results = distributed_task(listeners_during_a_call, pool=netns_pool(hosts, procs_per_node=2))()
    seen = check(results, 2, {hosts["addresses"][0]})
    # Each node's listeners are on its own address, or loopback (its ranks' own), nowhere else.
    for s in seen:
        assert s["address"] in {hosts["addresses"][s["node_rank"]], "127.0.0.1", "::1"}, s


def test_ssh_hosts_run_script_listens_on_their_own_address_only(hosts, tmp_path):
    results = run_probe_script(netns_pool(hosts, procs_per_node=2), tmp_path)
    check_script(results, 2, {hosts["addresses"][0]})


# --- slurm and kubernetes --------------------------------------------------------------------------

def test_slurm_nodes_listen_on_their_cluster_address_only_during_a_call(cluster):
    pool = GPUPool(provider="slurm", nodes=2, procs_per_node=2, remote_python=sys.executable,
                   ready_timeout_seconds=60)
    results = distributed_task(listeners_during_a_call, pool=pool, backend="gloo")()
    head = set(results[0]["head"])
    assert not any(ipaddress.ip_address(a).is_loopback for a in head), head
    check(results, 2, head)
    assert cluster.wait_queue_empty(timeout=30) == []


def test_slurm_run_script_listens_on_the_cluster_address_only(cluster, tmp_path):
    pool = GPUPool(provider="slurm", nodes=2, procs_per_node=1, remote_python=sys.executable,
                   ready_timeout_seconds=60)
    results = run_probe_script(pool, tmp_path)
    check_script(results, 2, set(results[0]["head"]))
    assert cluster.wait_queue_empty(timeout=30) == []


def test_kubernetes_pods_listen_on_their_node_address_only_during_a_call(k8s_cluster):
    from tests.harness.kube import kube_pool

    results = distributed_task(listeners_during_a_call, pool=kube_pool(k8s_cluster, procs_per_node=2))()
    head = set(results[0]["head"])
    assert not any(ipaddress.ip_address(a).is_loopback for a in head), head
    check(results, 2, head)


# --- Trainer-style scripts, as clients of the store rank 0's skytasks rank hosts ---------------------

def test_lightning_and_hugging_face_trainer_scripts_still_train_under_run_script(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    project, out = tmp_path / "project", tmp_path / "out"
    project.mkdir()
    out.mkdir()
    for name, text in (("lightning_fit.py", LIGHTNING_FIT), ("hf_trainer_fit.py", HF_TRAINER_FIT)):
        (project / name).write_text(text)
        assert run_script(name, [str(out)], workdir=project, pool=GPUPool(nodes=2)) == [
            ScriptResult(rank=r, exit_code=0) for r in range(2)]
    for kind in ("lightning", "hf"):
        ranks = [json.loads((out / f"{kind}{r}.json").read_text()) for r in range(2)]
        assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
        assert ranks[0]["weight"] == ranks[1]["weight"]  # DDP kept the replicas equal: the group worked


# Scripts as people write them for torchrun: a Lightning Trainer and a Hugging Face Trainer.
LIGHTNING_FIT = """\
import json, os, sys
import torch
import lightning as L

""" + inspect.getsource(regression_module) + """

Tiny = regression_module()
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=1, num_nodes=int(os.environ["WORLD_SIZE"]),
                    max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    default_root_dir=sys.argv[1])
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
with open(os.path.join(sys.argv[1], f"lightning{trainer.global_rank}.json"), "w") as f:
    json.dump({"rank": trainer.global_rank, "world": trainer.world_size,
               "weight": trainer.lightning_module.layer.weight.sum().item()}, f)
"""

HF_TRAINER_FIT = """\
import json, os, sys
import torch
from transformers import Trainer, TrainingArguments


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=g), "labels": torch.randn(1, generator=g)}


args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, num_train_epochs=1, use_cpu=True,
                         report_to=[], save_strategy="no", ddp_backend="gloo", disable_tqdm=True)
trainer = Trainer(model=Tiny(), args=args, train_dataset=Data())
trainer.train()
import torch.distributed as dist
with open(os.path.join(sys.argv[1], f"hf{dist.get_rank()}.json"), "w") as f:
    json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "weight": trainer.model.layer.weight.sum().item()}, f)
"""
