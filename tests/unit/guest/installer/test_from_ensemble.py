"""``cloudinit --from-ensemble``: the CR's settings, its defaults, and refused contradictions."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from guest_agent.installer import cli
from guest_agent.installer.from_ensemble import (
    EnsembleSettings,
    FromEnsembleError,
    apply_to_flags,
    load_document,
    settings_from_object,
)
from imex_shared.ensemble_crd import SPEC_FIELDS

REPO = Path(__file__).resolve().parents[4]
TOKEN = "0123456789abcdef" * 4
TOKEN_SHA = hashlib.sha256(TOKEN.encode()).hexdigest()


def cr(spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    """As `kubectl get imexensemble gb200 -o json` prints it (the server's defaults in)."""
    full = {"maxMembers": 18, "port": 50000, "mode": "names", "authEncryption": False}
    full.update(spec or {})
    return {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": "gb200", "namespace": "gpu-jobs", "uid": "u", "generation": 1,
                         **meta},
            "spec": full, "status": {"publishedSummary": "0/18"}}


def test_settings_and_the_crds_defaults() -> None:
    got = settings_from_object(cr({"maxMembers": 4, "port": 50123, "mode": "ips",
                                   "tokenSHA256": TOKEN_SHA}))
    assert got == EnsembleSettings("gb200", "gpu-jobs", 4, 50123, "ips", TOKEN_SHA, False, None)
    bare = {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": "gb200", "namespace": "gpu-jobs"}}
    defaults = settings_from_object(bare)
    assert (defaults.max_members, defaults.port, defaults.mode, defaults.auth_encryption) == (
        SPEC_FIELDS["maxMembers"]["default"], SPEC_FIELDS["port"]["default"],
        SPEC_FIELDS["mode"]["default"], SPEC_FIELDS["authEncryption"]["default"])
    listed = {"apiVersion": "v1", "kind": "List", "items": [cr()]}
    assert settings_from_object(listed) == settings_from_object(cr())


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"apiVersion": "v1", "kind": "Service"},
         "the file holds 'v1' 'Service', not an imex-ensemble.io/v1alpha1 ImexEnsemble"),
        ({"apiVersion": "v1", "kind": "List", "items": [cr(), cr()]},
         "the file is a List of 2 objects; give one ImexEnsemble"),
        (cr(namespace=""), "metadata.namespace is missing"),
        (cr(name="GB200"), "metadata: ensemble name 'GB200' is not a lowercase RFC 1123 label"),
        (cr({"maxMembers": 0}), "spec.maxMembers=0 is not in 1..1000"),
        (cr({"port": "50000"}), "spec.port='50000' is not an integer"),
        (cr({"mode": "dns"}), "spec.mode='dns' is not one of names, ips"),
        (cr({"tokenSHA256": "AB" * 32}), "spec.tokenSHA256='ABAB"),
        (cr({"authEncryption": True, "mode": "ips"}), "spec.authEncryption needs spec.mode names"),
        ([1, 2], "the file does not hold an object"),
    ],
)
def test_unusable_objects_are_refused_naming_the_field(obj: Any, message: str) -> None:
    with pytest.raises(FromEnsembleError) as err:
        settings_from_object(obj)
    assert message in str(err.value)


FLAGS = {"ensemble": None, "namespace": None, "max_members": None, "imex_port": None,
         "mode": None}


def test_flags_are_filled_and_an_agreeing_flag_is_fine() -> None:
    s = settings_from_object(cr({"maxMembers": 4, "tokenSHA256": TOKEN_SHA}))
    filled, notes = apply_to_flags(s, {**FLAGS, "max_members": 4}, TOKEN, "cr.json")
    assert filled == {"ensemble": "gb200", "namespace": "gpu-jobs", "max_members": 4,
                      "imex_port": 50000, "mode": "names"}
    assert notes == []


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("max_members", 16, "--max-members 16 conflicts with spec.maxMembers 18 in cr.json"),
        ("imex_port", 50001, "--imex-port 50001 conflicts with spec.port 50000 in cr.json"),
        ("mode", "ips", "--mode 'ips' conflicts with spec.mode 'names' in cr.json"),
        ("namespace", "other", "--namespace 'other' conflicts with metadata.namespace "
         "'gpu-jobs' in cr.json"),
        ("ensemble", "gb300", "--ensemble 'gb300' conflicts with metadata.name 'gb200'"),
    ],
)
def test_a_contradicting_flag_is_refused(flag: str, value: Any, message: str) -> None:
    with pytest.raises(FromEnsembleError) as err:
        apply_to_flags(settings_from_object(cr()), {**FLAGS, flag: value}, None, "cr.json")
    assert str(err.value).startswith(message)
    assert "drop the flag (the ImexEnsemble decides) or change the ImexEnsemble" in str(err.value)


def test_the_token_must_hash_to_token_sha256() -> None:
    s = settings_from_object(cr({"tokenSHA256": TOKEN_SHA}))
    with pytest.raises(FromEnsembleError) as err:
        apply_to_flags(s, FLAGS, TOKEN + "x", "cr.json")
    assert f"spec.tokenSHA256 in cr.json is {TOKEN_SHA[:12]}..." in str(err.value)
    assert "hash the token without its newline" in str(err.value)
    _, notes = apply_to_flags(s, FLAGS, None, "cr.json")
    assert notes == ["cr.json has spec.tokenSHA256 but no --token/--token-file was given: the "
                     "registry will refuse this guest's status reports"]
    _, notes = apply_to_flags(settings_from_object(cr()), FLAGS, TOKEN, "cr.json")
    assert notes == [f"cr.json has no spec.tokenSHA256: set it to {TOKEN_SHA} so the registry "
                     "accepts this guest's reports"]


def test_auth_encryption_and_the_ca_fingerprint() -> None:
    obj = cr({"authEncryption": True})
    obj["status"]["caSHA256"] = "c" * 64
    s = settings_from_object(obj)
    assert (s.auth_encryption, s.ca_sha256) == (True, "c" * 64)
    with pytest.raises(FromEnsembleError, match="cannot configure IMEX authentication yet"):
        apply_to_flags(s, FLAGS, TOKEN, "cr.json")  # a generator without the flags
    flags = {**FLAGS, "auth_encryption": False, "ca_sha256": None}
    filled, _ = apply_to_flags(s, flags, TOKEN, "cr.json")
    assert (filled["auth_encryption"], filled["ca_sha256"]) == (True, "c" * 64)
    with pytest.raises(FromEnsembleError, match="--ca-sha256 'dd"):
        apply_to_flags(s, {**flags, "ca_sha256": "d" * 64}, TOKEN, "cr.json")
    off = settings_from_object(cr())
    with pytest.raises(FromEnsembleError, match="--auth-encryption True conflicts"):
        apply_to_flags(off, {**flags, "auth_encryption": True}, TOKEN, "cr.json")


def test_json_yaml_and_stdin(tmp_path: Path) -> None:
    (tmp_path / "cr.json").write_text(json.dumps(cr()))
    (tmp_path / "cr.yaml").write_text(yaml.safe_dump(cr()))
    assert load_document(str(tmp_path / "cr.json")) == cr()
    assert load_document(str(tmp_path / "cr.yaml")) == cr()
    assert load_document("-", io.StringIO(json.dumps(cr()))) == cr()
    with pytest.raises(FromEnsembleError, match="cannot read"):
        load_document(str(tmp_path / "missing.json"))
    (tmp_path / "bad").write_text("{: [")
    with pytest.raises(FromEnsembleError, match="neither JSON nor YAML"):
        load_document(str(tmp_path / "bad"))


def test_yaml_without_pyyaml_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cr.yaml").write_text(yaml.safe_dump(cr()))
    monkeypatch.setitem(sys.modules, "yaml", None)  # as on a guest: not installed
    with pytest.raises(FromEnsembleError) as err:
        load_document(str(tmp_path / "cr.yaml"))
    assert "YAML needs PyYAML, which is not installed here: pip install " \
        "'imex-ensemble[cloudinit]', or use `kubectl get imexensemble NAME -o json`" \
        in str(err.value)
    (tmp_path / "cr.json").write_text(json.dumps(cr()))
    assert load_document(str(tmp_path / "cr.json")) == cr()  # JSON needs nothing


def run_cli(*argv: str, no_yaml: bool = False, stdin: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    """The real CLI in a child process; ``no_yaml`` hides PyYAML as a bare guest lacks it."""
    pre = "import sys; sys.modules['yaml'] = None; " if no_yaml else ""
    code = pre + "from guest_agent.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", "import sys; " + code, "cloudinit", *argv],
                          capture_output=True, text=True, cwd=REPO, input=stdin, timeout=60)


def test_user_data_from_the_cr_is_byte_for_byte_that_of_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "cr.json"
    path.write_text(json.dumps(cr({"maxMembers": 4, "port": 50123, "mode": "ips",
                                   "tokenSHA256": TOKEN_SHA})))
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    common = ["--token-file", str(token), "--registry-url", "http://10.0.0.1:8080", "--raw"]
    from_cr = run_cli("--from-ensemble", str(path), *common, no_yaml=True)
    assert from_cr.returncode == 0, from_cr.stderr
    by_hand = run_cli("--ensemble", "gb200", "--namespace", "gpu-jobs", "--max-members", "4",
                      "--imex-port", "50123", "--mode", "ips", *common)
    assert by_hand.returncode == 0, by_hand.stderr
    assert from_cr.stdout == by_hand.stdout
    piped = run_cli("--from-ensemble", "-", *common, stdin=path.read_text())
    assert piped.stdout == by_hand.stdout


def test_the_cli_refuses_a_contradiction_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "cr.json"
    path.write_text(json.dumps(cr({"maxMembers": 4})))
    out = run_cli("--from-ensemble", str(path), "--max-members", "18")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        f"imex-guest-agent cloudinit: error: --from-ensemble: --max-members 18 conflicts with "
        f"spec.maxMembers 4 in {path}: drop the flag (the ImexEnsemble decides) or change the "
        "ImexEnsemble")
    missing = run_cli("--max-members", "4")
    assert missing.returncode == 2
    assert "--ensemble and --namespace are required (or --from-ensemble)" in missing.stderr


def test_without_from_ensemble_nothing_changes() -> None:
    args = cli.build_parser().parse_args(["--ensemble", "gb200", "--namespace", "gpu-jobs"])
    assert cli.from_ensemble_args(args) == []
    opts = cli.options_from_args(args)
    assert (opts.max_members, opts.imex_port, opts.mode) == (18, 50000, "names")


def test_the_registry_ca_fingerprint_is_pinned_for_an_https_registry_only() -> None:
    obj = cr({"registryTLS": "Optional"})
    obj["status"]["registryCASHA256"] = "e" * 64
    s = settings_from_object(obj)
    assert (s.registry_ca_sha256, s.registry_tls_required) == ("e" * 64, False)
    https = {**FLAGS, "registry_url": "https://imex-host-agent.imex-system.svc:8443",
             "registry_ca_sha256": None}
    filled, notes = apply_to_flags(s, https, None, "cr.json")
    assert filled["registry_ca_sha256"] == "e" * 64 and notes == []
    with pytest.raises(FromEnsembleError, match="--registry-ca-sha256 'ff"):
        apply_to_flags(s, {**https, "registry_ca_sha256": "f" * 64}, None, "cr.json")
    plain = {**https, "registry_url": "http://imex-host-agent.imex-system.svc:8080"}
    filled, notes = apply_to_flags(s, plain, None, "cr.json")
    assert filled["registry_ca_sha256"] is None
    assert notes and "give an https:// --registry-url" in notes[0]
    obj["spec"]["registryTLS"] = "Required"
    with pytest.raises(FromEnsembleError, match=r"spec\.registryTLS Required"):
        apply_to_flags(settings_from_object(obj), plain, None, "cr.json")


def test_the_generated_config_pins_the_registry_ca(tmp_path: Path) -> None:
    obj = cr({"tokenSHA256": TOKEN_SHA})
    obj["status"]["registryCASHA256"] = "e" * 64
    (tmp_path / "cr.json").write_text(json.dumps(obj))
    (tmp_path / "token").write_text(TOKEN)
    out = subprocess.run(
        [sys.executable, "-m", "guest_agent.cli", "cloudinit", "--from-ensemble",
         str(tmp_path / "cr.json"), "--token-file", str(tmp_path / "token"), "--raw",
         "--registry-url", "https://imex-host-agent.imex-system.svc:8443"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert f'registry_ca_sha256 = "{"e" * 64}"' in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "guest_agent.cli", "cloudinit", "--ensemble", "gb200",
         "--namespace", "gpu-jobs", "--registry-url", "http://r:8080",
         "--registry-ca-sha256", "e" * 64], capture_output=True, text=True, cwd=REPO,
        timeout=60, check=False)
    assert bad.returncode == 2 and "--registry-url must be an https:// URL" in bad.stderr
