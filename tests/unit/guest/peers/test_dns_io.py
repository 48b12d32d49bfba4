"""The DNS client's reading of resolv.conf: a missing file, a file that changes."""

from __future__ import annotations

from guest_agent.peers.dns_io import nameservers_from_resolv_conf
from imex_shared.model import EnsembleId

ENS = EnsembleId("team-a", "rack1")


def test_resolv_conf(tmp_path: object) -> None:
    from pathlib import Path

    p = Path(str(tmp_path)) / "resolv.conf"
    p.write_text("search a.svc\nnameserver 10.96.0.10\nnameserver fe80::1%eth0\n"
                 "nameserver ::1\noptions ndots:5\n")
    assert [str(n) for n in nameservers_from_resolv_conf(p)] == ["10.96.0.10:53", "[::1]:53"]
    p.write_text("# nothing\n")
    assert [str(n) for n in nameservers_from_resolv_conf(p)] == ["127.0.0.1:53"]
    assert [str(n) for n in nameservers_from_resolv_conf(p.parent / "missing")] == [
        "127.0.0.1:53"]


def test_resolv_conf_reread_when_it_changes(tmp_path: object) -> None:
    import os
    from pathlib import Path

    from guest_agent.config import Settings
    from guest_agent.peers.dns_io import DnsClient

    p = Path(str(tmp_path)) / "resolv.conf"
    p.write_text("nameserver 10.96.0.10\n")
    client = DnsClient(Settings(ensemble="rack1", namespace="team-a"), ENS, resolv_conf=str(p))
    assert [n.ip for n in client.nameservers] == ["10.96.0.10"]
    new = p.with_name("resolv.new")
    new.write_text("nameserver 10.96.0.53\n")
    os.replace(new, p)  # as NetworkManager or dhclient do
    assert [n.ip for n in client.nameservers] == ["10.96.0.53"]
