"""A rank group's rendezvous port is free when chosen and outside the range the kernel gives
outgoing connections, so no connection of the flow can take it before the head's store binds it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from skytasks.node import ports


@pytest.mark.parametrize("low, high, chosen_from", [
    (32768, 60999, range(10000, 32768)),  # Linux's default
    (49152, 65535, range(10000, 49152)),  # IANA's, as BSDs and Windows have it
    (12000, 60999, range(61000, 65536)),  # too little room below: above
    (1024, 65535, range(0)),              # no room at all: the kernel's choice
])
def test_the_ports_chosen_from_lie_outside_the_ephemeral_range(low, high, chosen_from):
    assert ports.candidates(low, high) == chosen_from


def test_with_nowhere_to_choose_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.free_port("127.0.0.1")))


def test_the_port_is_free_and_never_one_the_kernel_hands_to_a_connection():
    low, high = ports.ephemeral_range()
    chosen = {ports.free_port("127.0.0.1") for _ in range(50)}
    assert all(not low <= p <= high and p not in ports._TORCHRUN_DEFAULTS for p in chosen), chosen
    assert len(chosen) > 40  # random: two pools on one machine do not pick the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", chosen.pop()))


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        offered = iter([taken, 20123])
        monkeypatch.setattr(ports.random, "choice", lambda pool: next(offered))
        assert ports.free_port("127.0.0.1") == 20123


def test_a_remote_node_runs_the_same_code_as_text():
    out = subprocess.run([sys.executable, "-I", "-c", ports.port_snippet()], capture_output=True, text=True, check=True)
    low, high = ports.ephemeral_range()
    assert not low <= int(out.stdout) <= high
