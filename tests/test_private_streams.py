"""Streams that are authenticated but not private carry nothing in the clear (issue 53, item 4).

SLURM: the cluster's links are captured (AF_PACKET on every namespace's veth) during a call with
a marker in `env` and a 4 MB argument; neither the marker, nor the argument, nor the pool's key
(taken from the controller in-process) is in any TCP stream. The same call with sealing turned
off (the test-only switch) shows the capture would have found them.
Kubernetes: which kubeconfigs make an exec stream that is sealed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import uuid

import pytest

from skytasks import GPUPool, distributed_task
from skytasks.stream_seal import UNSEALED_FOR_TESTS

# After each test that used the SLURM cluster, its queue is empty (conftest).
pytestmark = pytest.mark.usefixtures("slurm_queue_empty_after")


def what_the_rank_got(arg: bytes) -> tuple[str, str]:
    return os.environ.get("SKYTASKS_TEST_MARKER", ""), hashlib.sha256(arg).hexdigest()


def _call_under_capture(cluster) -> dict:
    """One call on a 2-node slurm pool while the cluster's links are captured."""
    marker = f"skytasks-marker-{uuid.uuid4().hex}"
    arg_marker = f"skytasks-argument-{uuid.uuid4().hex}".encode()
    arg = (arg_marker * ((4 << 20) // len(arg_marker) + 1))[:4 << 20]
    pool = GPUPool(provider="slurm", nodes=2, procs_per_node=1, remote_python=sys.executable,
                   ready_timeout_seconds=60, env={"SKYTASKS_TEST_MARKER": marker})
    from tests.harness.kube import Said

    with cluster.capture() as capture, Said() as said:
        with pool:
            out = distributed_task(what_the_rank_got, pool=pool, init_torch=False)(arg)
            relay = pool.runtime().session.relay
            key, tls = relay._secret, relay._tls
    assert out == [(marker, hashlib.sha256(arg).hexdigest())] * 2  # the ranks got the env and the argument
    # ... over the streams the pool started with: none broke and was mended on the way
    assert not [line for _, line in said.lines if "its stream broke" in line or "was lost" in line], said.lines
    streams = capture.tcp_streams()
    tls_lines = [line for line in (tls.key if tls else "").splitlines() if line and "PRIVATE KEY" not in line]
    secrets = {"the env marker": marker.encode(), "the argument": arg_marker, "the pool's key": key,
               "the pool's key (hex)": key.hex().encode(),
               **{f"the relay's TLS key, line {i}": line.encode() for i, line in enumerate(tls_lines)}}
    found = {what for what, value in secrets.items() for data in streams.values() if value in data}
    return {"found": found, "streams": streams, "drops": capture.drops, "tls_lines": tls_lines}


def _payload_bytes(streams: dict) -> int:
    return sum(len(data) for data in streams.values())


def test_a_slurm_pools_stream_carries_no_env_argument_or_key_in_the_clear(cluster):
    seen = _call_under_capture(cluster)
    assert seen["drops"] == 0, "the capture dropped frames: what it did not find proves nothing"
    assert seen["tls_lines"], "the pool made its relay key"
    # The argument crossed the captured links, once to each node: the capture saw the call.
    assert _payload_bytes(seen["streams"]) > 2 * (4 << 20)
    assert seen["found"] == set()


def test_the_same_capture_finds_them_when_the_stream_is_not_sealed(cluster, monkeypatch):
    """The search can fail: on an unsealed stream (the test-only switch) the marker, the
    argument and the pool's key are all there to be read."""
    monkeypatch.setenv(UNSEALED_FOR_TESTS, "1")
    seen = _call_under_capture(cluster)
    assert {"the env marker", "the argument", "the pool's key (hex)"} <= seen["found"]
    assert any(what.startswith("the relay's TLS key") for what in seen["found"])


def _cfg(host: str, verify: bool) -> object:
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host, cfg.verify_ssl = host, verify
    return cfg


@pytest.mark.parametrize("host,verify,private", [
    ("https://10.0.0.1:6443", True, True),  # TLS verified against the kubeconfig's CA: private
    ("https://10.0.0.1:6443", False, False),  # insecure-skip-tls-verify: anyone in between reads it
    ("http://127.0.0.1:8001", True, False),  # plain http (kubectl proxy, an old insecure port)
    ("HTTP://127.0.0.1:8001", True, False),
])
def test_a_kubernetes_exec_stream_is_sealed_unless_its_tls_is_verified(host, verify, private):
    from skytasks.providers.kubernetes.cluster import private_stream
    from skytasks.stream_seal import wanted

    assert private_stream(_cfg(host, verify)) is private
    assert wanted(private_stream(_cfg(host, verify))) is (not private)


def test_a_sealed_stream_moves_100_mb_and_says_how_fast(capsys):
    """The seal's cost, measured: 100 MB through the controller's end and a node's (its own
    process, as on a node), and back."""
    import subprocess
    import threading

    from skytasks import stream_seal

    ident = stream_seal.identity()
    echo = "import os\nwhile b := os.read(0, 1 << 20):\n    v = memoryview(b)\n    while v:\n        v = v[os.write(1, v):]\n"
    node = subprocess.Popen([sys.executable, "-c", stream_seal.node_prelude(ident.pin) + echo],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    ends = stream_seal.seal_controller_end(node.stdout, node.stdin, ident, 30, node.kill)  # type: ignore[arg-type]
    block, total = os.urandom(1 << 20), 100 << 20
    digest, back = hashlib.sha256(), [0]

    def read() -> None:
        while back[0] < total and (data := ends.inbound.read1(1 << 20)):
            digest.update(data)
            back[0] += len(data)

    reader = threading.Thread(target=read)
    started = time.monotonic()
    reader.start()
    for _ in range(total // len(block)):
        ends.outbound.write(block)
    ends.outbound.flush()
    reader.join(120)
    seconds = time.monotonic() - started
    ends.close()
    node.stdin.close()  # type: ignore[union-attr]
    assert node.wait(10) == 0
    assert back[0] == total and digest.hexdigest() == hashlib.sha256(block * (total // len(block))).hexdigest()
    with capsys.disabled():
        print(f"\nsealed stream: 100 MB there and back in {seconds:.2f}s ({total / seconds / 1e6:.0f} MB/s each way)")


def test_a_node_refuses_a_certificate_that_is_not_the_pinned_one():
    """A man in the middle with a certificate of its own is refused by the node before anything
    is read from the stream (the pin on its command line is the controller's)."""
    import subprocess

    from skytasks import stream_seal

    ident, other = stream_seal.identity(), stream_seal.identity()
    node = subprocess.Popen([sys.executable, "-c", stream_seal.node_prelude(ident.pin) + "import os\nos.read(0, 1)\n"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ends = stream_seal.seal_controller_end(node.stdout, node.stdin, other, 30, node.kill)  # type: ignore[arg-type]
    ends.outbound.write(b"x")
    ends.outbound.flush()
    assert ends.inbound.read(1) == b""  # the node's end closed: nothing was passed on
    ends.close()
    node.stdin.close()  # type: ignore[union-attr]
    node.wait(10)
    assert "not the controller's" in node.stderr.read().decode()  # type: ignore[union-attr]


def test_a_kubernetes_pool_over_a_kubeconfig_that_skips_tls_verification_runs_sealed(k8s_cluster, tmp_path):
    """The test cluster's admin kubeconfig with `insecure-skip-tls-verify` instead of its CA: the
    agents' exec streams are sealed, and a call with a 4 MB argument goes through them whole."""
    import json

    from tests.harness.kube import kube_pool

    config = json.loads(k8s_cluster.admin_kubeconfig.read_text())
    cluster_entry = config["clusters"][0]["cluster"]
    del cluster_entry["certificate-authority"]
    cluster_entry["insecure-skip-tls-verify"] = True
    insecure = tmp_path / "insecure.kubeconfig"
    insecure.write_text(json.dumps(config))
    arg = os.urandom(4 << 20)
    marker = f"skytasks-marker-{uuid.uuid4().hex}"
    with kube_pool(k8s_cluster, kubeconfig=insecure, nodes=2, procs_per_node=1,
                   env={"SKYTASKS_TEST_MARKER": marker}) as pool:
        out = distributed_task(what_the_rank_got, pool=pool, init_torch=False)(arg)
        session = pool.runtime().session
        agents = session.provider._agents
        sealed = [agents._plain.get(id(agents.streams[pod])) for pod in list(agents.streams)]
        links = [node.link.inbound for node in session.nodes]
    assert out == [(marker, hashlib.sha256(arg).hexdigest())] * 2
    assert agents.sealed and len(sealed) == 2 and all(s is not None for s in sealed)
    assert all(any(link is s.inbound for s in sealed) for link in links)  # the links read the plain ends
