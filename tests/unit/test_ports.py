"""Free port ranges for engines (megatron_flash.ports)."""

from __future__ import annotations

import socket

import pytest

from megatron_flash import ports


@pytest.fixture(autouse=True)
def _unconfined(monkeypatch):
    monkeypatch.delenv("MF_PORT_RANGE", raising=False)  # make test's workers each set one (tests/conftest.py)


def test_ranges_are_free_consecutive_and_outside_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:  # read independently of the module
        assert (lo, hi) == tuple(int(x) for x in f.read().split())
    for _ in range(20):
        base = ports.free_ports(4)
        assert base + 3 < lo or base > hi, (base, lo, hi)
        for p in range(base, base + 4):  # each can be bound now (then released)
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_a_range_with_a_taken_port_is_skipped(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    lo, _ = ports.ephemeral_range()
    free_base = 21000 if not 21000 <= taken < 21003 else 22000

    class Draws:  # the first draw puts the held port inside the range, the second does not
        def __init__(self):
            self.bases = [taken - 1, free_base]

        def choice(self, spans):
            return spans[0]

        def randrange(self, a, b):
            return self.bases.pop(0)

    monkeypatch.setattr(ports.random, "Random", Draws)
    try:
        assert ports.free_ports(3) == free_base
    finally:
        held.close()


def test_count_must_be_positive():
    with pytest.raises(ValueError, match="count"):
        ports.free_ports(0)


def test_mf_port_range_confines_every_draw(monkeypatch):
    monkeypatch.setenv("MF_PORT_RANGE", "23000-23009")
    seen = set()
    for _ in range(200):
        base = ports.free_ports(3)
        assert 23000 <= base and base + 2 <= 23009, base
        seen.add(base)
    assert len(seen) > 4  # drawn, not one fixed port
    monkeypatch.setenv("MF_PORT_RANGE", "23000-23000")
    assert ports.free_ports(1) == 23000


@pytest.mark.parametrize("value,match", [("23000", "expected LO-HI"), ("a-b", "expected LO-HI"),
                                         ("30000-20000", "LO <= HI"), ("80-90", "1024")])
def test_a_malformed_mf_port_range_names_the_variable(monkeypatch, value, match):
    monkeypatch.setenv("MF_PORT_RANGE", value)
    with pytest.raises(ValueError, match=f"MF_PORT_RANGE.*{match}"):
        ports.free_ports(1)


def test_a_range_too_small_for_the_count_is_refused(monkeypatch):
    monkeypatch.setenv("MF_PORT_RANGE", "23000-23001")
    with pytest.raises(RuntimeError, match="MF_PORT_RANGE=23000-23001 holds fewer than 3"):
        ports.free_ports(3)
