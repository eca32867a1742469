"""The pure decisions behind warm pools (issue 58), on a fake clock: when a waiter asks again, when
a "starting" claim is abandoned (the waiter's own clock only), when a pool is gone (only on every
node's definite word), and the keys each use of the pool's key gets."""

from __future__ import annotations

import hashlib
import hmac

from skytasks.controller.warm_claim import (ASK_AGAIN, ATTACH, CLAIM_STALE_SECONDS, HELD_BACKOFF, POOL_GONE, Backoff,
                                            ClaimWatch, NodeTries, verdict)
from skytasks.node.holding import TICKET_SECONDS
from skytasks.resume import DOOR_LABEL, RELAY_LABEL, attach_key, subkey


def test_a_waiter_backs_off_to_its_most_and_starts_over_when_reset():
    wait = Backoff(0.5, 3.0)
    assert [wait.wait() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    wait.reset()
    assert wait.wait() == 0.5


def test_a_waiter_in_line_asks_again_before_its_ticket_lapses():
    assert HELD_BACKOFF[1] < TICKET_SECONDS  # its place in the agents' line is kept


def test_a_claim_is_abandoned_only_when_its_generation_stood_still_on_the_waiters_clock():
    watch = ClaimWatch(stale=60.0)
    assert not watch.abandoned(3, now=1000.0)
    assert not watch.abandoned(3, now=1059.9)
    assert not watch.abandoned(4, now=1059.95)  # its starter rewrote it: the waiter's clock starts over
    assert not watch.abandoned(4, now=1119.0)
    assert watch.abandoned(4, now=1119.95)


def test_a_claim_is_never_judged_by_the_time_written_in_it():
    watch = ClaimWatch()
    # the first sight of any generation is never stale, whatever another machine's clock said
    assert not watch.abandoned(7, now=0.0)
    assert CLAIM_STALE_SECONDS > 3 * 10.0  # several of the starter's rewrites fit in the window


def test_a_pool_is_gone_only_when_every_node_is_definitely_gone():
    assert verdict(NodeTries(held=0, gone=2, unread=0), None, 0.0, 10.0) == POOL_GONE
    assert verdict(NodeTries(held=0, gone=1, unread=1), None, 0.0, 10.0) == ASK_AGAIN
    assert verdict(NodeTries(held=0, gone=0, unread=2), 0.0, 1e6, 10.0) == ASK_AGAIN  # never gone for silence
    assert verdict(NodeTries(held=2, gone=0, unread=0), None, 0.0, 10.0) == ATTACH
    assert verdict(NodeTries(held=1, gone=1, unread=0), None, 0.0, 10.0) == ATTACH  # the gone one is replaced


def test_an_unread_node_holds_the_attach_back_for_its_grace_then_is_taken_as_lost():
    tries = NodeTries(held=1, gone=0, unread=1)
    assert verdict(tries, None, 100.0, 10.0) == ASK_AGAIN  # first seen now
    assert verdict(tries, 100.0, 109.9, 10.0) == ASK_AGAIN
    assert verdict(tries, 100.0, 110.0, 10.0) == ATTACH


def test_the_door_and_the_relay_use_labelled_subkeys_of_the_pools_key():
    key = bytes(range(32))
    door, relay = subkey(key, DOOR_LABEL), subkey(key, RELAY_LABEL)
    assert len({door, relay, key}) == 3 and attach_key(key) == door
    # RFC 5869 HKDF-SHA256, one block, salt "skytasks pool key"
    prk = hmac.new(b"skytasks pool key", key, hashlib.sha256).digest()
    assert door == hmac.new(prk, DOOR_LABEL + b"\x01", hashlib.sha256).digest()
    # what a relay peer can make the relay compute (HMAC of the relay's key over any nonce it sends,
    # labels included) is never the door's key
    assert all(hmac.new(relay, label, hashlib.sha256).digest() != door
               for label in (DOOR_LABEL, b"skytasks-attach", DOOR_LABEL + b"\x01"))
