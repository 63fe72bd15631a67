"""The weight rendezvous store listens on the address the members connect to, not on every interface (torch's
TCPStore binds them all unless handed a bound socket); a host name that resolves here to loopback without being
a loopback name keeps the old every-interface listening, since other nodes reach this one elsewhere."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest
import torch

from sfhpc.weights import group as weight_group


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the IPv4/IPv6 sockets listening on `port` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_the_store_listens_on_the_named_address_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weight_group.HOST_VARIABLE, "127.0.0.1")
    group, store = weight_group.open_group(2, timeout_s=10)
    assert (group.host, group.backend) == ("127.0.0.1", "gloo")
    assert listening_addresses(group.port) == {"0100007F"}  # 127.0.0.1, little-endian hex; not 0.0.0.0 or ::
    member = torch.distributed.TCPStore(group.host, group.port, group.size, is_master=False,
                                        timeout=datetime.timedelta(seconds=10))
    member.set("k", "v")
    assert store.get("k") == b"v"


def test_a_name_that_resolves_to_loopback_here_keeps_every_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(weight_group.HOST_VARIABLE, raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-with-debian-hosts")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "",
                                                                  ("127.0.1.1", 0))])
    assert weight_group.listening_socket("node-with-debian-hosts") is None
    listening = weight_group.listening_socket("node-with-debian-hosts", pinned=True)
    assert listening is not None and listening.getsockname()[0] == "127.0.1.1"
    listening.close()
