"""The cloud-init generator's pure parts: YAML it emits, files it renders, flags it refuses.

PyYAML (a test dependency) is cloud-init's own parser, so "loads back with
yaml.safe_load" is what the guest will see. The real ``cloud-init schema`` and
cloud-init's write_files module run in tests/integration/test_cloudinit_schema.py.
"""

from __future__ import annotations

import base64
import hashlib
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from guest_agent.config import settings_from_mapping
from guest_agent.installer import cli, cloudyaml, guest_files, setup_script
from guest_agent.installer import options as opt
from guest_agent.installer import userdata as ci
from imex_shared.model import EnsembleId
from imex_shared.render import render_nodes_config

TOKEN = "0123456789abcdef" * 4
UNIT = (
    "[Unit]\nDescription=unit under test\nBefore=nvidia-imex.service\n\n"
    "[Service]\nExecStart=/opt/imex-guest-agent/bin/imex-guest-agent run\n"
)


def opts(**kw: Any) -> opt.Options:
    base: dict[str, Any] = {"ensemble": "gb200", "namespace": "gpu-jobs"}
    base.update(kw)
    return opt.Options(**base)


def files_of(user_data: str) -> dict[str, tuple[bytes, str]]:
    """path -> (bytes, permissions) as cloud-init would decode the write_files entries."""
    doc = yaml.safe_load(user_data)
    out = {}
    for entry in doc["write_files"]:
        content = entry["content"]
        data = base64.b64decode(content) if entry.get("encoding") == "b64" else content.encode()
        out[entry["path"]] = (data, entry["permissions"])
    return out


def parse(argv: list[str]) -> opt.Options:
    return cli.options_from_args(cli.build_parser().parse_args(argv))


# --- YAML emission --------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_quoted_scalar_loads_back_exactly(text: str) -> None:
    assert yaml.safe_load(f"k: {cloudyaml.yaml_quote(text)}\n") == {"k": text}


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_file_content_loads_back_byte_for_byte(data: bytes) -> None:
    lines = cloudyaml.render_write_files([cloudyaml.WriteFile("/x", data, "0600")])
    assert files_of("\n".join(lines) + "\n") == {"/x": (data, "0600")}


@pytest.mark.parametrize("b64", ["1234", "0000", "Null", "NULL", "True", "true"])
def test_base64_that_reads_as_a_yaml_scalar_stays_a_string(b64: str) -> None:
    # Hypothesis found it: these are valid base64 and, unquoted, YAML 1.1 ints,
    # nulls and bools, so cloud-init would not get the string it must decode.
    data = base64.b64decode(b64)
    lines = cloudyaml.render_write_files([cloudyaml.WriteFile("/b", data, "0600")])
    assert f'    content: "{b64}"' in lines
    assert files_of("\n".join(lines) + "\n") == {"/b": (data, "0600")}


@pytest.mark.parametrize(
    "text",
    ["a\n", "a", "a\n\n", " leading\n", "\ttab\n", "x\n  \n", "x\n\ny\n", "#c\r\n", "é\u2028\n"],
)
def test_awkward_contents_round_trip(text: str) -> None:
    data = text.encode()
    lines = cloudyaml.render_write_files([cloudyaml.WriteFile("/p", data)])
    assert files_of("\n".join(lines) + "\n")["/p"] == (data, "0644")


def test_text_files_are_literal_blocks_for_review() -> None:
    lines = cloudyaml.render_write_files([cloudyaml.WriteFile("/n", b"a\nb\n")])
    assert lines[-3:] == ["    content: |", "      a", "      b"]


# --- rendered files -------------------------------------------------------


def test_user_data_writes_exactly_the_rendered_files() -> None:
    o = opts(registry_url="http://reg.example:8080", token=TOKEN)
    got = files_of(ci.render_user_data(o, UNIT))
    ens = EnsembleId("gpu-jobs", "gb200")
    assert got == {
        "/etc/imex-guest-agent/config.toml": (guest_files.render_agent_config(o).encode(), "0644"),
        "/etc/imex-guest-agent/token": (TOKEN.encode(), "0600"),
        "/etc/nvidia-imex/config.cfg": (guest_files.render_imex_config(o).encode(), "0644"),
        "/etc/nvidia-imex/nodes_config.cfg": (render_nodes_config(ens, 18, "names"), "0644"),
        "/etc/systemd/system/imex-guest-agent.service": (UNIT.encode(), "0644"),
        "/etc/systemd/system/imex-domain-ready.service": (
            guest_files.ready_unit_source().encode(), "0644"),
    }


def test_agent_config_is_what_the_agent_accepts() -> None:
    o = opts(
        max_members=4,
        cluster_domain="corp.local",
        registry_url="https://reg.example:8443/",
        token=TOKEN,
        mode="ips",
        imex_port=50123,
        own_slot="published",
        nameservers=("10.96.0.10", "[fd00::a]:5353"),
    )
    s = settings_from_mapping(tomllib.loads(guest_files.render_agent_config(o)))
    assert (s.ensemble, s.namespace, s.cluster_domain, s.max_members) == (
        "gb200",
        "gpu-jobs",
        "corp.local",
        4,
    )
    assert (s.port, s.mode, s.own_slot) == (50123, "ips", "published")
    assert s.registry_url == "https://reg.example:8443"
    assert s.token_file == "/etc/imex-guest-agent/token"
    assert [str(n) for n in s.nameservers] == ["10.96.0.10:53", "[fd00::a]:5353"]
    assert s.nodes_config == "/etc/nvidia-imex/nodes_config.cfg"


def test_no_token_means_no_token_file() -> None:
    o = opts()
    assert "token_file" not in tomllib.loads(guest_files.render_agent_config(o))
    assert "/etc/imex-guest-agent/token" not in files_of(ci.render_user_data(o, None))


def test_imex_config_keys() -> None:
    text = guest_files.render_imex_config(opts(imex_port=50001, imex_cmd_port=50006,
                                               wait_for_quorum="NONE"))
    kv = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert kv["SERVER_PORT"] == "50001"
    assert kv["IMEX_CMD_PORT"] == "50006"
    assert kv["IMEX_CMD_ENABLED"] == "1"
    assert kv["IMEX_WAIT_FOR_QUORUM"] == "NONE"
    assert kv["BIND_INTERFACE_IP"] == ""
    assert kv["IMEX_NODE_CONFIG_FILE"] == "/etc/nvidia-imex/nodes_config.cfg"


def test_ips_mode_starts_with_every_slot_absent() -> None:
    got = files_of(ci.render_user_data(opts(mode="ips", max_members=3), None))
    assert got["/etc/nvidia-imex/nodes_config.cfg"][0] == b"127.0.0.2\n" * 3


def test_hosts_and_resolv_conf_are_left_alone() -> None:
    doc = yaml.safe_load(ci.render_user_data(opts(token=TOKEN), UNIT))
    assert doc["manage_etc_hosts"] is False
    assert not {"manage_resolv_conf", "resolv_conf"} & set(doc)
    (bootcmd,) = doc["bootcmd"]
    assert "hosts" not in bootcmd and "resolv" not in bootcmd
    paths = {f["path"] for f in doc["write_files"]}
    assert not {"/etc/hosts", "/etc/resolv.conf"} & paths


# --- install script -------------------------------------------------------


def script_lines(o: opt.Options) -> list[list[str]]:
    doc = yaml.safe_load(ci.render_user_data(o, UNIT))
    (script,) = doc["runcmd"]
    assert script == setup_script.render_setup_script(o, UNIT)
    subprocess.run(["sh", "-n", "-c", script], check=True)  # the shell accepts it
    return [shlex.split(line) for line in script.splitlines()]


@pytest.mark.parametrize(
    ("install", "source"),
    [
        ("find-links:http://wheels.internal/imex/",
         ["--find-links", "http://wheels.internal/imex/"]),
        ("pip-index:https://mirror.internal/simple",
         ["--index-url", "https://mirror.internal/simple"]),
        ("wheel:https://files.internal/imex_ensemble-0.1.0-py3-none-any.whl",
         ["--wheel", "https://files.internal/imex_ensemble-0.1.0-py3-none-any.whl"]),
    ],
)
def test_install_sources(install: str, source: list[str]) -> None:
    o = opts(install=opt.InstallSource.parse(install), package=None)
    lines = script_lines(o)
    assert lines[0] == ["set", "-eu"]
    # one installer run by the image's python3: it picks the interpreter, makes the venv
    # without pip and removes it again on any failure (guest_agent/installer/bootstrap.py)
    # first where to commit (cloud-init's semaphore directory), before anything is installed
    assert lines[1] == [f"imex_sem={SEM_DIR}"]
    run = lines[3]
    assert run[:2] == ["python3", guest_files.INSTALLER_PATH]
    assert run[2:4] == source
    assert run[run.index("--venv") + 1] == "/opt/imex-guest-agent"
    req = run[run.index("--requirement") + 1]
    if source[0] == "--wheel":
        assert req == f"imex-ensemble[guest] @ {source[1]}"
    else:
        assert req.split("==")[0] == "imex-ensemble[guest]"
    # the installer is written by write_files, verbatim from the package
    doc = yaml.safe_load(ci.render_user_data(o, UNIT))
    (inst,) = [f for f in doc["write_files"] if f["path"] == guest_files.INSTALLER_PATH]
    from guest_agent.installer import bootstrap

    assert inst["content"] == Path(bootstrap.__file__).read_text()
    # Installed, enabled, committed to disk, then started; IMEX restarts last.
    joined = [" ".join(line) for line in lines]
    enable = joined.index("systemctl enable imex-guest-agent.service imex-domain-ready.service")
    start = joined.index("systemctl restart imex-guest-agent.service")
    assert 3 < enable < start
    assert "systemctl restart nvidia-imex.service" in joined[start + 1]


def test_version_pin_follows_the_generator() -> None:
    from importlib.metadata import version

    req = setup_script.package_requirement(opts())
    assert req == f"imex-ensemble[guest]=={version('imex-ensemble')}"
    assert setup_script.package_requirement(opts(package="imex-ensemble[guest]>=0.1")) == (
        "imex-ensemble[guest]>=0.1"
    )


def test_wheel_direct_reference_drops_the_version_spec() -> None:
    url = "https://files.internal/imex_ensemble-0.2.0-py3-none-any.whl"
    o = opts(install=opt.InstallSource.parse(f"wheel:{url}"), package="imex-ensemble[guest]>=0.2")
    run = script_lines(o)[3]
    assert run[run.index("--requirement") + 1] == f"imex-ensemble[guest] @ {url}"


def test_preinstalled_only_enables() -> None:
    lines = script_lines(opts())
    assert not any(guest_files.INSTALLER_PATH in line for line in lines)
    doc = yaml.safe_load(ci.render_user_data(opts(), None))
    assert guest_files.INSTALLER_PATH not in {f["path"] for f in doc["write_files"]}
    assert not any(line[:2] == ["rm", "-rf"] for line in lines)  # the image's agent stays
    assert ["systemctl", "enable", "imex-guest-agent.service",
            "imex-domain-ready.service"] in lines
    assert ["systemctl", "restart", "imex-guest-agent.service"] in lines
    assert ["systemctl", "start", "--no-block", "imex-domain-ready.service"] in lines
    # the barrier unit is written in every install mode, from the package's own file
    written = {f["path"]: f["content"] for f in doc["write_files"]}
    assert written["/etc/systemd/system/imex-domain-ready.service"] == \
        guest_files.ready_unit_source()
    assert "/etc/modprobe.d/imex-channel0.conf" not in written


def test_imex_channel0_module_param_writes_modprobe_d() -> None:
    doc = yaml.safe_load(ci.render_user_data(opts(imex_channel0_module_param=True), None))
    written = {f["path"]: f["content"] for f in doc["write_files"]}
    assert written["/etc/modprobe.d/imex-channel0.conf"].splitlines()[-1] == \
        "options nvidia NVreg_CreateImexChannel0=1"


def test_expected_members_reaches_the_agent_config() -> None:
    s = settings_from_mapping(tomllib.loads(guest_files.render_agent_config(
        opts(max_members=4, expected_members=3))))
    assert s.members_expected == 3
    with pytest.raises(opt.CloudInitError, match="expected_members: 5 is more than"):
        guest_files.render_agent_config(opts(max_members=4, expected_members=5))


def test_no_restart_imex() -> None:
    script = setup_script.render_setup_script(opts(restart_imex=False), UNIT)
    assert "nvidia-imex" not in script


# --- crash safety: commit marker and the bootcmd that re-arms the setup ---------


SEM_DIR = "/var/lib/cloud/instance/sem"


def committed_sem(script: str) -> str:
    """The semaphore the setup script creates between two syncs (the default directory)."""
    (line,) = [x for x in script.splitlines() if x.startswith("sync; touch ")]
    assert line.endswith("; sync")
    return line.split()[2].rstrip(";").replace("$imex_sem", SEM_DIR)


@pytest.mark.parametrize("install", ["preinstalled", "find-links:http://wheels.internal/"])
def test_setup_is_committed_between_two_syncs_before_anything_starts(install: str) -> None:
    o = opts(install=opt.InstallSource.parse(install))
    joined = [" ".join(line) for line in script_lines(o)]
    commit = next(i for i, x in enumerate(joined) if x.startswith("sync; touch "))
    # every install and enable step before it, every (re)start after it
    assert joined.index("systemctl daemon-reload") < commit
    enable = "systemctl enable imex-guest-agent.service imex-domain-ready.service"
    assert joined.index(enable) < commit
    assert all("restart" not in x for x in joined[:commit])
    assert joined[commit + 1] == "systemctl restart imex-guest-agent.service"


def test_bootcmd_rearms_write_files_and_runcmd_unless_the_setup_is_committed() -> None:
    o = opts(install=opt.InstallSource.parse("find-links:http://wheels.internal/"), token=TOKEN)
    doc = yaml.safe_load(ci.render_user_data(o, UNIT))
    sem = committed_sem(doc["runcmd"][0])
    assert sem == setup_script.setup_sem(o, UNIT)
    digest = sem.removeprefix(f"{SEM_DIR}/imex_ensemble_setup_")
    assert len(digest) == setup_script.SETUP_DIGEST_CHARS and int(digest, 16) >= 0
    (bootcmd,) = doc["bootcmd"]
    assert bootcmd == setup_script.render_bootcmd(o, UNIT)
    assign, check, rearm = bootcmd.splitlines()
    assert assign == f"imex_sem={SEM_DIR}"
    assert check.startswith("[ -d $imex_sem ] || imex_sem=$(python3 -c ")
    assert check.endswith("exit 1; }")
    assert setup_script.SEM_DIR_PROBE in check
    expanded = rearm.replace("$imex_sem", SEM_DIR).split()
    assert expanded == [
        "[", "-e", sem, "]", "||", "rm", "-fv",
        f"{SEM_DIR}/config_write_files",
        f"{SEM_DIR}/config_runcmd",
        f"{SEM_DIR}/config_scripts_user",
    ]
    subprocess.run(["sh", "-n", "-c", bootcmd], check=True)


def test_digest_changes_with_any_file_or_install_step() -> None:
    base = opts(install=opt.InstallSource.parse("find-links:http://wheels.internal/"))

    def sem(o: opt.Options, unit: str | None = UNIT) -> str:
        return committed_sem(setup_script.render_setup_script(o, unit))

    same = sem(base)
    assert sem(base) == same  # a pure function of the user-data
    changed = [
        sem(base, UNIT + "# edited\n"),  # the unit file
        sem(base, None),  # no unit file written
        sem(opts(install=base.install, token=TOKEN)),  # a token file
        sem(opts(install=base.install, mode="ips")),  # the nodes file
        sem(opts(install=opt.InstallSource.parse("find-links:http://other.internal/"))),
        sem(opts(install=base.install, package="imex-ensemble[guest]==9.9")),
    ]
    assert same not in changed and len(set(changed)) == len(changed)
    # what only the IMEX restart changes is not part of the setup on disk
    assert sem(opts(install=base.install, restart_imex=False)) == same


# --- inline or Secret -----------------------------------------------------


def test_small_output_stays_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Since the semaphore directory is checked (and asked of cloud-init when elsewhere),
    # even the smallest user-data (baked image, no registry, one member) is over 2048
    # bytes: the inline branch is exercised with a larger limit.
    assert ci.generate(opts(max_members=1), None).is_secret
    monkeypatch.setattr(ci, "INLINE_USERDATA_LIMIT", 4096)
    out = ci.generate(opts(), None)
    assert not out.is_secret
    assert out.text == out.user_data
    assert len(out.text.encode()) <= ci.INLINE_USERDATA_LIMIT
    assert out.text.startswith("#cloud-config\n")


def test_token_with_a_baked_image_is_over_the_inline_limit() -> None:
    # the crash-safe setup (bootcmd, commit) took the common case over 2048 bytes,
    # which is where a token belongs anyway
    out = ci.generate(opts(token=TOKEN, registry_url="http://r.example:8080"), None)
    assert out.is_secret
    assert len(out.user_data.encode()) > ci.INLINE_USERDATA_LIMIT
    sha = hashlib.sha256(TOKEN.encode()).hexdigest()
    assert any(sha in n for n in out.notes)


def test_large_output_becomes_a_secret() -> None:
    o = opts(token=TOKEN, install=opt.InstallSource.parse("find-links:http://w.internal/"))
    out = ci.generate(o, UNIT)
    assert len(out.user_data.encode()) > ci.INLINE_USERDATA_LIMIT
    assert out.is_secret
    doc = yaml.safe_load(out.text)
    assert doc["kind"] == "Secret"
    assert doc["metadata"] == {
        "name": "gb200-userdata",
        "namespace": "gpu-jobs",
        "labels": {"imex-ensemble.io/ensemble": "gb200"},
    }
    assert doc["stringData"] == {"userdata": out.user_data}
    assert any("2048" in n and "Secret" in n for n in out.notes)


def test_secret_on_request_and_raw_on_request() -> None:
    forced = ci.generate(opts(output_secret="my-ud"), None)
    assert forced.is_secret
    assert yaml.safe_load(forced.text)["metadata"]["name"] == "my-ud"
    big = opts(install=opt.InstallSource.parse("find-links:http://w.internal/"), raw=True)
    raw = ci.generate(big, UNIT)
    assert not raw.is_secret and raw.text == raw.user_data
    assert any("too big" in n for n in raw.notes)


# --- flags ----------------------------------------------------------------


def test_flags_map_to_options(tmp_path: Path) -> None:
    tf = tmp_path / "token"
    tf.write_text(TOKEN + "\n")
    o = parse(
        [
            "--ensemble=e1",
            "--namespace=ns1",
            "--max-members=8",
            "--registry-url=http://r:8080",
            f"--token-file={tf}",
            "--install=find-links:file:///srv/wheels",
            "--mode=ips",
            "--imex-port=50010",
            "--imex-cmd-port=50011",
            "--wait-for-quorum=NONE",
            "--own-slot=published",
            "--nameserver=10.0.0.10",
            "--nameserver=10.0.0.11:5353",
            "--output-secret=ud",
        ]
    )
    assert o.token == TOKEN  # the file's newline is not part of the token
    assert (o.ensemble, o.namespace, o.max_members, o.mode, o.own_slot) == (
        "e1",
        "ns1",
        8,
        "ips",
        "published",
    )
    assert (o.imex_port, o.imex_cmd_port, o.wait_for_quorum) == (50010, 50011, "NONE")
    assert o.install == opt.InstallSource("find-links", "file:///srv/wheels")
    assert o.nameservers == ("10.0.0.10", "10.0.0.11:5353")
    assert o.output_secret == "ud"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--token", "two words"], "bearer token"),
        (["--token", "tok\nen"], "bearer token"),
        (["--install", "ftp:x"], "--install"),
        (["--install", "find-links:gopher://x"], "not an http(s) or file URL"),
        (["--install", "wheel:"], "--install"),
        (["--install", "find-links:http://w.internal/\u00e9"], "printable ASCII"),
        (["--install", "pip-index:http://w.internal/a b"], "printable ASCII"),
        (["--package", "imex-ensemble; rm -rf /"], "--package"),
        (["--package", "-e ."], "--package"),
        (["--imex-port", "70000"], "--imex-port"),
        (["--nameserver", "dns.example"], "--nameserver"),
        (["--registry-url", "reg:8080"], "registry_url"),
        (["--max-members", "0"], "max_members"),
        (["--output-secret", "Bad_Name"], "--output-secret"),
        (["--mode", "ips", "--own-slot", "local"], "own_slot"),
    ],
)
def test_bad_flags_are_refused_by_name(extra: list[str], needle: str) -> None:
    with pytest.raises(opt.CloudInitError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse(["--ensemble", "gb200", "--namespace", "gpu-jobs", *extra])


def test_bad_names_are_refused() -> None:
    with pytest.raises(opt.CloudInitError, match="--ensemble/--namespace"):
        parse(["--ensemble", "GB200", "--namespace", "gpu-jobs"])


def test_missing_token_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(opt.CloudInitError, match=str(missing)):
        parse(["--ensemble", "e", "--namespace", "n", "--token-file", str(missing)])


def test_main_reports_errors_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["--ensemble", "e", "--namespace", "n", "--imex-port", "0"])
    err = capsys.readouterr()
    assert rc == 2
    assert err.out == ""
    assert "error: --imex-port: 0 is not a port number" in err.err


def test_main_prints_inline_user_data(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["--ensemble", "e", "--namespace", "n", "--token", TOKEN])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out == ci.generate(opts(ensemble="e", namespace="n", token=TOKEN), None).text
    assert "token-sha256" in out.err


def test_install_source_needs_a_url_exactly_when_it_downloads() -> None:
    with pytest.raises(opt.CloudInitError, match="URL"):
        opt.InstallSource("wheel")
    with pytest.raises(opt.CloudInitError, match="URL"):
        opt.InstallSource("preinstalled", "http://x/")


# -- authEncryption (issue 19) -------------------------------------------------------------

CA_PIN = "ab" * 32


def _auth_args(*extra: str) -> list[str]:
    return ["--ensemble", "gb200", "--namespace", "gpu", "--registry-url", "http://r:8080",
            "--token", "t0k3n", "--auth-encryption", "--ca-sha256", CA_PIN, *extra]


def test_auth_encryption_writes_the_imex_tls_keys_and_the_pin() -> None:
    from guest_agent.tls.imex_config import imex_tls_settings

    opts = cli.options_from_args(cli.build_parser().parse_args(_auth_args()))
    imex = guest_files.render_imex_config(opts)
    for key, value in imex_tls_settings():
        assert f"\n{key}={value}\n" in imex
    assert "IMEX_SECURITY_TARGET_OVERRIDE" not in imex  # names mode: the dialled name matches
    settings = guest_files.check_agent_config(guest_files.render_agent_config(opts))
    assert settings.auth_encryption and settings.ca_sha256 == CA_PIN
    plain = cli.options_from_args(cli.build_parser().parse_args(_auth_args()[:8]))
    assert "AUTH" not in guest_files.render_imex_config(plain)  # unchanged without the flag


@pytest.mark.parametrize(("drop", "add", "words"), [
    ("--registry-url", (), "needs --registry-url"),
    ("--token", (), "needs --token"),
    ("--ca-sha256", (), "needs --ca-sha256"),
    (None, ("--mode", "ips"), "cannot be used with --mode ips"),
])
def test_auth_encryption_refuses_what_cannot_work(drop: str | None, add: tuple[str, ...],
                                                  words: str) -> None:
    argv = _auth_args(*add)
    if drop is not None:
        i = argv.index(drop)
        del argv[i:i + 2]
    with pytest.raises(opt.CloudInitError, match=words):
        cli.options_from_args(cli.build_parser().parse_args(argv))


def test_a_pin_without_auth_or_not_hex_is_refused() -> None:
    argv = _auth_args()
    argv.remove("--auth-encryption")
    with pytest.raises(opt.CloudInitError, match="only meaningful with --auth-encryption"):
        cli.options_from_args(cli.build_parser().parse_args(argv))
    bad = _auth_args()
    bad[bad.index(CA_PIN)] = "xyz"
    with pytest.raises(opt.CloudInitError, match="not 64 hex digits"):
        cli.options_from_args(cli.build_parser().parse_args(bad))
@pytest.mark.parametrize("kwargs", [{}, {"token": TOKEN}, {"raw": True, "token": TOKEN}])
def test_the_user_data_size_is_always_told(kwargs: dict[str, Any]) -> None:
    o = opts(install=opt.InstallSource.parse("find-links:http://w.internal/"), **kwargs)
    out = ci.generate(o, UNIT)
    size = len(out.user_data.encode())
    assert sum(f"{size} bytes" in n for n in out.notes) == 1


def test_user_data_with_the_installer_stays_small_for_a_secret() -> None:
    # a Secret holds 1 MiB; the installer is most of the user-data and is kept readable
    o = opts(token=TOKEN, registry_url="http://r.example:8080",
             install=opt.InstallSource.parse("find-links:http://w.internal/"))
    size = len(ci.generate(o, UNIT).user_data.encode())
    assert size < 32 * 1024
    assert size > len(guest_files.installer_source().encode())
