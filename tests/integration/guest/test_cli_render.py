"""``imex-guest-agent render`` and config errors, through the real console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parents[2] / "golden"
SCRIPT = Path(sys.executable).parent / "imex-guest-agent"


def _config(tmp_path: Path, **extra: object) -> Path:
    hosts = tmp_path / "hosts"
    hosts.write_bytes((GOLDEN / "hosts" / "debian_default.in").read_bytes())
    nodes = tmp_path / "nodes_config.cfg"
    nodes.write_bytes(b"untouched\n")
    lines = [
        'ensemble = "gb200"',
        'namespace = "gpu"',
        "max_members = 4",
        f'hosts_file = "{hosts}"',
        f'nodes_config = "{nodes}"',
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    path = tmp_path / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, timeout=30)


def _snapshot(tmp_path: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns)
        for p in tmp_path.iterdir()
        if p.name in ("hosts", "nodes_config.cfg")
    }


def test_render_hosts_merges_into_configured_file_without_writing(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    members = tmp_path / "members.json"
    members.write_text(
        json.dumps(
            [
                {"index": 0, "ip": "10.0.0.1"},
                {"index": 1, "ip": "10.0.0.2"},
                {"index": 3, "ip": "fd00::4"},
            ]
        )
    )
    before = _snapshot(tmp_path)
    out = _run("render", "--config", str(cfg), "--members", str(members), "--what", "hosts")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (GOLDEN / "hosts" / "debian_default.out").read_bytes()
    assert _snapshot(tmp_path) == before


def test_render_hosts_input_overrides_configured_file(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    members = tmp_path / "members.json"
    members.write_text(json.dumps([{"index": 2, "ip": "10.0.0.3"}]))
    src = GOLDEN / "hosts" / "crlf_no_final_newline.in"
    out = _run(
        "--config",
        str(cfg),
        "render",
        "--members",
        str(members),
        "--what",
        "hosts",
        "--hosts-input",
        str(src),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == (GOLDEN / "hosts" / "crlf_no_final_newline.out").read_bytes()


@pytest.mark.parametrize(("mode", "golden"), [("ips", "ips_4.cfg")])
def test_render_nodes_config_ips_mode(tmp_path: Path, mode: str, golden: str) -> None:
    cfg = _config(tmp_path, mode=mode)
    members = tmp_path / "m.json"
    members.write_text(
        json.dumps([{"index": 0, "ip": "10.0.0.1"}, {"index": 2, "ip": "fd00::3/64"}])
    )
    out = _run("render", "--config", str(cfg), "--members", str(members), "--what", "nodes_config")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (GOLDEN / "nodes_config" / golden).read_bytes()


def test_render_nodes_config_names_mode(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    (tmp_path / "m.json").write_text("[]")
    out = _run(
        "render",
        "--config",
        str(cfg),
        "--members",
        str(tmp_path / "m.json"),
        "--what",
        "nodes_config",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == b"".join(b"imex-93a7a316-%d\n" % i for i in range(4))


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([{"index": 4, "ip": "10.0.0.1"}], "members[0]: slot index 4 is out of range"),
        ([{"index": 0, "ip": "10.0.2.2"}], "members[0]: 10.0.2.2 is the guest-internal"),
        ([{"index": 0, "ip": "169.254.0.9"}], "link-local"),
        ([{"index": "0", "ip": "10.0.0.1"}], "not an integer"),
        ({"index": 0}, "JSON list"),
    ],
)
def test_render_bad_members_exit_nonzero_and_touch_nothing(
    tmp_path: Path, members: object, message: str
) -> None:
    cfg = _config(tmp_path)
    path = tmp_path / "members.json"
    path.write_text(json.dumps(members))
    before = _snapshot(tmp_path)
    for what in ("hosts", "nodes_config"):
        out = _run("render", "--config", str(cfg), "--members", str(path), "--what", what)
        assert out.returncode == 2
        assert out.stdout == b""
        assert message in out.stderr.decode()
    assert _snapshot(tmp_path) == before


def test_render_members_not_json(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    (tmp_path / "m.json").write_text("[{index: 0}")
    out = _run(
        "render", "--config", str(cfg), "--members", str(tmp_path / "m.json"), "--what", "hosts"
    )
    assert out.returncode == 2 and b"not valid JSON" in out.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_member": 4}, "unknown key(s) max_member"),
        ({"port": "50000"}, "port: expected an integer"),
        ({"mode": "hostnames"}, "mode: must be one of 'names', 'ips'"),
        ({"nameservers": ["10.0.0.1:99999"]}, "nameservers: '10.0.0.1:99999' has a bad port"),
        ({"poll_interval": True}, "poll_interval: expected a number of seconds, got a boolean"),
        ({"own_index": 7}, "own_index: 7 is out of range"),
        ({"imex_command": []}, "imex_command: must be a non-empty list"),
        ({"registry_url": "ftp://x"}, "registry_url: 'ftp://x' is not an http(s) URL"),
    ],
)
def test_bad_config_is_refused_naming_the_key(
    tmp_path: Path, extra: dict[str, object], message: str
) -> None:
    cfg = _config(tmp_path, **extra)
    (tmp_path / "m.json").write_text("[]")
    before = _snapshot(tmp_path)
    for command in (["render", "--members", str(tmp_path / "m.json"), "--what", "hosts"], ["once"]):
        out = _run(command[0], "--config", str(cfg), *command[1:])
        assert out.returncode == 2, out
        assert message in out.stderr.decode(), out.stderr
        assert str(cfg) in out.stderr.decode()
    assert _snapshot(tmp_path) == before


def test_missing_and_malformed_config_files(tmp_path: Path) -> None:
    out = _run(
        "render", "--config", str(tmp_path / "nope.toml"), "--members", "x", "--what", "hosts"
    )
    assert out.returncode == 2 and b"cannot read config" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('ensemble = "gb200"\nnamespace = \n')
    out = _run("render", "--config", str(bad), "--members", "x", "--what", "hosts")
    assert out.returncode == 2 and b"not valid TOML" in out.stderr
    assert os.path.exists(bad)


def test_render_without_a_config_file_from_its_flags(tmp_path: Path) -> None:
    """On a workstation: --ensemble, --namespace and --max-members are enough; the file
    is the one the same values in a config file give."""
    members = tmp_path / "m.json"
    members.write_text(json.dumps([{"index": 1, "ip": "10.0.0.2"}]))
    flags = ("--ensemble", "gb200", "--namespace", "gpu", "--max-members", "4")
    for what in ("nodes_config", "hosts"):
        out = _run("render", *flags, "--members", str(members), "--what", what,
                   "--hosts-input", str(GOLDEN / "hosts" / "debian_default.in"))
        cfg = _config(tmp_path)
        want = _run("render", "--config", str(cfg), "--members", str(members), "--what",
                    what, "--hosts-input", str(GOLDEN / "hosts" / "debian_default.in"))
        assert out.returncode == 0, out.stderr
        assert out.stdout == want.stdout
    ips = _run("render", *flags, "--mode", "ips", "--members", str(members), "--what",
               "nodes_config")
    assert ips.stdout == b"127.0.0.2\n10.0.0.2\n127.0.0.2\n127.0.0.2\n"


def test_render_flags_are_checked_and_a_missing_one_is_named(tmp_path: Path) -> None:
    members = tmp_path / "m.json"
    members.write_text("[]")
    bad = _run("render", "--ensemble", "GB200", "--namespace", "gpu", "--max-members", "4",
               "--members", str(members), "--what", "hosts")
    assert bad.returncode == 2 and b"ensemble:" in bad.stderr
    # not all three and no config file (the default path does not exist here)
    partial = _run("render", "--ensemble", "gb200", "--members", str(members), "--what",
                   "hosts")
    assert partial.returncode == 2
    assert b"--namespace, --max-members instead of a config file" in partial.stderr
    # a flag over a config file wins
    cfg = _config(tmp_path)
    out = _run("render", "--config", str(cfg), "--max-members", "2", "--members",
               str(members), "--what", "nodes_config")
    assert out.returncode == 0, out.stderr
    assert out.stdout == b"imex-93a7a316-0\nimex-93a7a316-1\n"


def test_help_lists_every_command_cloudinit_included() -> None:
    out = _run("--help")
    assert out.returncode == 0
    for command in (b"run", b"once", b"status", b"render", b"cloudinit"):
        assert command in out.stdout
    # and cloudinit still has its own parser (and needs no config)
    sub = _run("cloudinit", "--help")
    assert sub.returncode == 0 and b"--from-ensemble" in sub.stdout
