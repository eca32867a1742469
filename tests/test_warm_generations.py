"""A warm pool's record as generations on the real Prefect API (issue 58): a write lands only on the
generation it read, a stale writer never overwrites a newer record, an ended pool leaves a
tombstone; and a new holder's fresh key, after which the old one reaches neither a door nor a relay.
"""

from __future__ import annotations

import time
import uuid

import pytest

from skytasks import GPUPool
from skytasks.controller.reconnect import Refused, door_handshake
from skytasks.controller.warm_claim import tombstone
from skytasks.node.peer_links import connect
from skytasks.node.tls_link import PeerTLS
from skytasks.prefect_records.warm_store import PrefectWarmStore, _generation_name
from skytasks.providers.local.provider import LocalProvider
from skytasks.resume import RELAY_LABEL, subkey
from skytasks.wire import ChannelClosed
from tests.test_warm_pools import _use



def _documents(pool: str) -> list[str]:
    return sorted(name for name, _ in PrefectWarmStore._documents(_generation_name(pool, 0)[:-1]))


def test_a_write_lands_only_on_the_generation_it_read_and_a_stale_writer_loses():
    store, pool = PrefectWarmStore(), f"gen-{uuid.uuid4().hex[:8]}"
    assert store.newest(pool) == (0, None)
    assert store.write(pool, {"pool": pool, "state": "up", "who": "a"}, 0)
    assert not store.write(pool, {"pool": pool, "state": "up", "who": "b"}, 0)  # b read generation 0 too: it lost
    assert store.write(pool, {"pool": pool, "state": "up", "who": "a2"}, 1)
    generation, record = store.newest(pool)
    assert generation == 2 and record is not None and record["who"] == "a2" and record["generation"] == 2
    assert _documents(pool) == [_generation_name(pool, 2)]  # older generations deleted (by id)
    # a very stale writer whose generation's name was freed by that clean-up: its write is undone
    assert not store.write(pool, {"pool": pool, "state": "up", "who": "stale"}, 0)
    assert store.newest(pool)[1]["who"] == "a2" and _documents(pool) == [_generation_name(pool, 2)]
    # the pool ends: a tombstone, no key in it, and the next claim goes on counting
    assert store.write(pool, tombstone(pool), 2)
    assert store.newest(pool) == (3, None) and store.load(pool) is None and pool not in store.names()
    assert not store.write(pool, {"pool": pool, "state": "up", "who": "a2"}, 2)  # the old holder cannot return
    assert store.write(pool, {"pool": pool, "state": "starting", "who": "c"}, 3)
    assert store.newest(pool)[0] == 4 and pool in store.names()
    assert store.write(pool, tombstone(pool), 4)


def _probe(provider: LocalProvider, node: dict, key: bytes) -> dict:
    link = provider.reattach(node["node_id"], node["door"], 10)
    try:
        return door_handshake(link, key, node["instance"], "probe", "probe", 0, "test", time.monotonic() + 10)
    finally:
        link.let_go_lost()


def test_every_new_holder_gives_the_pool_a_fresh_key_and_the_old_one_reaches_no_agent(pool_name, tmp_path):
    GPUPool(provider="local", nodes=2, keep_warm_minutes=1.0).save(pool_name, overwrite=True)
    first = _use(pool_name, tmp_path / "first.json")
    old = PrefectWarmStore().load(pool_name)
    second = _use(pool_name, tmp_path / "second.json")
    new = PrefectWarmStore().load(pool_name)
    assert second["pids"] == first["pids"]  # the same agents, attached
    assert old is not None and new is not None and new["generation"] > old["generation"]
    assert new["pool_key"] != old["pool_key"] and new["tls_key"] != old["tls_key"]
    provider = LocalProvider(GPUPool(provider="local", nodes=2).spec())
    provider.adopt(new["handle"])
    try:
        for node in new["nodes"]:
            with pytest.raises(Refused, match="key was not proven"):
                _probe(provider, node, bytes.fromhex(old["pool_key"]))
            state = _probe(provider, node, bytes.fromhex(new["pool_key"]))["state"]
            port = int(state["peer_port"])
            assert port
            with pytest.raises((ChannelClosed, OSError)):  # the relay refuses the old key's subkey
                connect("127.0.0.1", port, subkey(bytes.fromhex(old["pool_key"]), RELAY_LABEL), timeout=5,
                        tls=PeerTLS(old["tls_cert"], old["tls_key"])).close()
            connect("127.0.0.1", port, subkey(bytes.fromhex(new["pool_key"]), RELAY_LABEL), timeout=5,
                    tls=PeerTLS(new["tls_cert"], new["tls_key"])).close()
    finally:
        provider.leave_running()
