"""Tier 1: ports handed to other processes come from outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from areal.utils.network import (
    LINUX_EPHEMERAL,
    ephemeral_range,
    free_port,
    port_candidates,
)


def test_the_candidates_are_the_ports_from_20000_up_outside_the_ephemeral_range():
    assert port_candidates((32768, 60999)) == [range(20000, 32768), range(61000, 65536)]
    # an ephemeral range that starts below the floor leaves only the ports above it
    assert port_candidates((1024, 40000)) == [range(40001, 65536)]
    # one that covers everything from the floor up leaves none
    assert port_candidates((15000, 65535)) == []


def test_the_ephemeral_range_is_read_from_the_kernel_file_or_is_linuxs_default(tmp_path):
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000)
    f.write_text("garbage\n")
    assert ephemeral_range(str(f)) == LINUX_EPHEMERAL
    assert ephemeral_range(str(tmp_path / "missing")) == LINUX_EPHEMERAL


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    low, high = ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1, ports  # drawn at random, not one fixed port
    for port in ports:
        assert port >= 20000 and not low <= port <= high, (port, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_something_listens_on(monkeypatch):
    import areal.utils.network as network

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # only two candidates: the taken port and the one after it (if that one is free)
        monkeypatch.setattr(
            network, "port_candidates", lambda _ephemeral: [range(taken, taken + 2)]
        )
        ports = {network.free_port() for _ in range(10)}
    assert taken not in ports, ports
