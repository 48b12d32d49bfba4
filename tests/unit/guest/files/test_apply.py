"""The applier's real writes: both files, foreign lines kept, idempotent, re-asserted."""

from __future__ import annotations

import hashlib
from pathlib import Path

from guest_agent.config import settings_from_mapping
from guest_agent.files.apply import Applier
from imex_shared.hostsfile import read_block
from imex_shared.model import ABSENT_IP, EnsembleId


def _settings(tmp_path: Path, **kw: object):  # type: ignore[no-untyped-def]
    raw = {
        "ensemble": "rack-a",
        "namespace": "gpu",
        "max_members": 4,
        "hosts_file": str(tmp_path / "hosts"),
        "nodes_config": str(tmp_path / "imex" / "nodes_config.cfg"),
        "imex_control": "none",
    }
    raw.update(kw)
    return settings_from_mapping(raw)


def test_applier_writes_both_files_keeps_foreign_lines_and_is_idempotent(tmp_path: Path) -> None:
    foreign = b"127.0.0.1\tlocalhost\n# admin note\n10.1.1.1 db.example db\n"
    (tmp_path / "hosts").write_bytes(foreign)
    ap = Applier(_settings(tmp_path))
    ens = EnsembleId("gpu", "rack-a")
    r = ap.apply({0: "10.0.0.1", 2: "10.0.0.3"})
    assert r.nodes_written and r.hosts_written
    hosts = (tmp_path / "hosts").read_bytes()
    assert hosts.startswith(foreign)
    assert read_block(hosts, ens) == {0: "10.0.0.1", 1: ABSENT_IP, 2: "10.0.0.3", 3: ABSENT_IP}
    nodes = (tmp_path / "imex" / "nodes_config.cfg").read_bytes()
    assert nodes.decode().splitlines() == [ens.slot(i) for i in range(4)]
    assert r.nodes_sha256 == hashlib.sha256(nodes).hexdigest()
    assert r.hosts_sha256 == hashlib.sha256(hosts).hexdigest()
    again = ap.apply({0: "10.0.0.1", 2: "10.0.0.3"})
    assert not again.written
    assert ap.assert_files() is not None and not ap.assert_files().written  # type: ignore[union-attr]


def test_assert_files_restores_block_after_clobber(tmp_path: Path) -> None:
    ap = Applier(_settings(tmp_path))
    ens = EnsembleId("gpu", "rack-a")
    assert ap.assert_files() is None  # nothing applied yet: nothing to assert
    ap.apply({1: "10.0.0.2"})
    clobbered = b"127.0.0.1 localhost\n10.9.9.9 other\n"
    (tmp_path / "hosts").write_bytes(clobbered)
    r = ap.assert_files()
    assert r is not None and r.hosts_written and not r.nodes_written
    hosts = (tmp_path / "hosts").read_bytes()
    assert hosts.startswith(clobbered)
    assert read_block(hosts, ens) == {0: ABSENT_IP, 1: "10.0.0.2", 2: ABSENT_IP, 3: ABSENT_IP}


def test_ips_mode_nodes_file_follows_pins(tmp_path: Path) -> None:
    ap = Applier(_settings(tmp_path, mode="ips"))
    r1 = ap.apply({0: "10.0.0.1"})
    r2 = ap.apply({0: "10.0.0.1", 1: "10.0.0.2"})
    assert r2.nodes_written and r1.nodes_sha256 != r2.nodes_sha256
    lines = (tmp_path / "imex" / "nodes_config.cfg").read_text().splitlines()
    assert lines == ["10.0.0.1", "10.0.0.2", ABSENT_IP, ABSENT_IP]


def test_found_reports_files_as_they_are(tmp_path: Path) -> None:
    ap = Applier(_settings(tmp_path))
    assert ap.found() == (None, None)
    ap.apply({3: "10.0.0.4"})
    pins, sha = ap.found()
    assert pins is not None and pins[3] == "10.0.0.4"
    assert sha == ap.last.nodes_sha256  # type: ignore[union-attr]
