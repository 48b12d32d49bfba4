"""The command line of ``imex-guest-agent cloudinit``: flags in, user-data (or a Secret) out.

Every flag is checked here or by the agent's own config validator before anything is
printed, so a value the guest would refuse is refused on the workstation, naming the flag
(exit 2). The rendering itself is :mod:`guest_agent.installer.userdata`; this module only reads
the token file and the package's unit, and prints the result (or, with ``--output``,
writes it by rename: never a half-written or emptied file; exit 1 when it cannot) and
its notes (the user-data's size among them) on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from guest_agent.config import ConfigError, parse_nameserver
from guest_agent.files.safewrite import FileWriteError, replace_file
from guest_agent.installer.from_ensemble import (
    FromEnsembleError,
    apply_to_flags,
    load_document,
    settings_from_object,
)
from guest_agent.installer.guest_files import UNIT_RESOURCE, render_agent_config
from guest_agent.installer.options import (
    DEFAULT_IMEX_CMD_PORT,
    K8S_NAME_PATTERN,
    REQUIREMENT_PATTERN,
    TOKEN_PATTERN,
    CloudInitError,
    InstallSource,
    Options,
)
from guest_agent.installer.userdata import generate
from imex_shared.model import DEFAULT_MAX_MEMBERS, DEFAULT_PORT, ModelError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="imex-guest-agent cloudinit",
        description=(
            "Print #cloud-config user-data that installs and configures the imex guest agent "
            "and IMEX for one ensemble member (or a Secret holding it, when it is over "
            "KubeVirt's 2048-byte inline limit)."
        ),
    )
    p.add_argument("--ensemble", help="ensemble (Service) name (required without "
                   "--from-ensemble)")
    p.add_argument("--namespace", help="namespace of the Service and the VMs (required "
                   "without --from-ensemble)")
    p.add_argument(
        "--from-ensemble",
        metavar="FILE",
        help="take the ensemble, namespace, max-members, port and mode from an ImexEnsemble "
        "(`kubectl get imexensemble NAME -o json`; '-' reads standard input; YAML needs "
        "PyYAML); a flag that says otherwise is refused",
    )
    p.add_argument("--max-members", type=int, default=None, help="default 18")
    p.add_argument("--cluster-domain", help="cluster DNS zone (agent default: cluster.local)")
    p.add_argument(
        "--registry-url",
        help="host agent registry, e.g. https://imex-host-agent.imex-system.svc.cluster.local"
        ":8443 (with --registry-ca-sha256), or http://...:8080",
    )
    p.add_argument(
        "--registry-ca-sha256",
        metavar="HEX",
        help="the registry CA's fingerprint an https:// registry is pinned to: the "
        "ImexEnsemble's status.registryCASHA256 (--from-ensemble fills it in)",
    )
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", help="ensemble token (prefer --token-file: argv is visible)")
    tok.add_argument("--token-file", help="file holding the ensemble token")
    p.add_argument(
        "--install",
        default="preinstalled",
        help="pip-index:URL | wheel:URL | find-links:URL | preinstalled (default)",
    )
    p.add_argument(
        "--package",
        help="pip requirement to install (default: imex-ensemble[guest]==<this version>)",
    )
    p.add_argument("--mode", choices=("names", "ips"), default=None, help="default names")
    p.add_argument("--imex-port", type=int, default=None, help="IMEX SERVER_PORT (default "
                   f"{DEFAULT_PORT})")
    p.add_argument("--imex-cmd-port", type=int, default=DEFAULT_IMEX_CMD_PORT)
    p.add_argument("--wait-for-quorum", choices=("RECOVERY", "NONE"), default="RECOVERY")
    p.add_argument("--own-slot", choices=("auto", "published", "local"), default="auto")
    p.add_argument(
        "--nameserver",
        action="append",
        default=[],
        metavar="IP[:PORT]",
        help="DNS server for the agent's fallback (repeatable; default resolv.conf)",
    )
    p.add_argument(
        "--no-restart-imex",
        action="store_true",
        help="do not enable and restart nvidia-imex.service at first boot",
    )
    p.add_argument(
        "--expected-members", type=int, default=None, metavar="N",
        help="members `wait --for domain` (imex-domain-ready.service) needs published "
        "(default: --max-members)")
    p.add_argument(
        "--imex-channel0-module-param",
        action="store_true",
        help="also set NVreg_CreateImexChannel0=1 in /etc/modprobe.d: the driver makes "
        "channel 0 (only) at its next load, without the agent (docs/guest-agent.md)",
    )
    p.add_argument(
        "--auth-encryption",
        action="store_true",
        help="IMEX mutual TLS: certificates from the registry (needs --registry-url, --token "
        "and --ca-sha256; mode names only)",
    )
    p.add_argument(
        "--ca-sha256",
        metavar="HEX",
        help="the ensemble CA's fingerprint guests pin: the ImexEnsemble's status.caSHA256 "
        "(or the Service's imex-ensemble.io/ca-sha256 annotation)",
    )
    p.add_argument(
        "--output",
        metavar="PATH",
        help="write to PATH instead of standard output: a temp file (mode 0600) in PATH's "
        "directory renamed over PATH, so PATH is never left empty or half written; on "
        "any error it is left as it was",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--output-secret", metavar="NAME", help="always print a Secret named NAME")
    out.add_argument(
        "--raw",
        action="store_true",
        help="always print plain user-data, even over the inline limit",
    )
    return p


def _port(flag: str, value: int) -> int:
    if not 1 <= value <= 65535:
        raise CloudInitError(f"{flag}: {value} is not a port number (1..65535)")
    return value


def _read_token(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CloudInitError(f"--token-file {path}: cannot read: {exc}") from exc
    return text.strip()


def from_ensemble_args(args: argparse.Namespace) -> list[str]:
    """``--from-ensemble``: fill the flags from the ImexEnsemble (refusing contradictions);
    returns notes for stderr. Without it, nothing changes."""
    if getattr(args, "from_ensemble", None) is None:
        return []
    token: str | None = args.token
    if args.token_file is not None:
        token = _read_token(args.token_file)
    dests = ["ensemble", "namespace", "max_members", "imex_port", "mode", "registry_url",
             "registry_ca_sha256",
             *(d for d in ("auth_encryption", "ca_sha256") if hasattr(args, d))]
    source = "standard input" if args.from_ensemble == "-" else args.from_ensemble
    try:
        settings = settings_from_object(load_document(args.from_ensemble))
        filled, notes = apply_to_flags(settings, {d: getattr(args, d) for d in dests},
                                       token, source)
    except FromEnsembleError as exc:
        raise CloudInitError(f"--from-ensemble: {exc}") from exc
    for dest, value in filled.items():
        setattr(args, dest, value)
    return notes


def options_from_args(args: argparse.Namespace) -> Options:
    """Turn parsed flags into Options, refusing anything the guest would refuse later."""
    if args.ensemble is None or args.namespace is None:
        raise CloudInitError("--ensemble and --namespace are required (or --from-ensemble)")
    token: str | None = args.token
    if args.token_file is not None:
        token = _read_token(args.token_file)
    if token is not None and not TOKEN_PATTERN.match(token):
        raise CloudInitError(
            "the token must be one line of letters, digits and -._~+/ (a bearer token), "
            "e.g. from `openssl rand -hex 32`"
        )
    if args.output_secret is not None and not K8S_NAME_PATTERN.match(args.output_secret):
        raise CloudInitError(f"--output-secret {args.output_secret!r} is not a Kubernetes name")
    for ns in args.nameserver:
        try:
            parse_nameserver("--nameserver", ns)
        except ConfigError as exc:
            raise CloudInitError(str(exc)) from exc
    if args.package is not None and not REQUIREMENT_PATTERN.match(args.package):
        raise CloudInitError(
            f"--package {args.package!r} is not a pip requirement such as "
            "'imex-ensemble[guest]==0.1.0'"
        )
    ca_sha256 = getattr(args, "ca_sha256", None)
    auth = bool(getattr(args, "auth_encryption", False))
    if ca_sha256 is not None:
        ca_sha256 = ca_sha256.strip().lower()
        if len(ca_sha256) != 64 or any(c not in "0123456789abcdef" for c in ca_sha256):
            raise CloudInitError(f"--ca-sha256 {ca_sha256!r} is not 64 hex digits")
    if auth:
        if args.mode == "ips":
            raise CloudInitError(
                "--auth-encryption cannot be used with --mode ips: IMEX then dials IP "
                "addresses, which a slot-named certificate cannot match")
        if args.registry_url is None:
            raise CloudInitError(
                "--auth-encryption needs --registry-url: certificates come from the registry "
                "(a DNS-only guest cannot get a first certificate)")
        if token is None:
            raise CloudInitError("--auth-encryption needs --token or --token-file: the "
                                 "certificate request is authenticated like the status PUT")
        if ca_sha256 is None:
            raise CloudInitError(
                "--auth-encryption needs --ca-sha256 (the ensemble's status.caSHA256): guests "
                "never trust a CA because the registry sent it")
    elif ca_sha256 is not None:
        raise CloudInitError("--ca-sha256 is only meaningful with --auth-encryption")
    registry_ca = args.registry_ca_sha256
    if registry_ca is not None:
        registry_ca = registry_ca.strip().lower()
        if len(registry_ca) != 64 or any(c not in "0123456789abcdef" for c in registry_ca):
            raise CloudInitError(f"--registry-ca-sha256 {registry_ca!r} is not 64 hex digits")
        if not (args.registry_url or "").startswith("https://"):
            raise CloudInitError(
                "--registry-ca-sha256 pins the registry's TLS CA: --registry-url must be an "
                f"https:// URL (it is {args.registry_url or 'not given'})")
    opts = Options(
        registry_ca_sha256=registry_ca,
        auth_encryption=auth,
        ca_sha256=ca_sha256,
        ensemble=args.ensemble,
        namespace=args.namespace,
        max_members=DEFAULT_MAX_MEMBERS if args.max_members is None else args.max_members,
        cluster_domain=args.cluster_domain,
        registry_url=args.registry_url,
        token=token,
        install=InstallSource.parse(args.install),
        package=args.package,
        mode=args.mode or "names",
        imex_port=_port("--imex-port", DEFAULT_PORT if args.imex_port is None
                        else args.imex_port),
        imex_cmd_port=_port("--imex-cmd-port", args.imex_cmd_port),
        wait_for_quorum=args.wait_for_quorum,
        own_slot=args.own_slot,
        nameservers=tuple(args.nameserver),
        restart_imex=not args.no_restart_imex,
        output_secret=args.output_secret,
        raw=args.raw,
        imex_channel0_module_param=bool(getattr(args, "imex_channel0_module_param", False)),
        expected_members=getattr(args, "expected_members", None),
    )
    try:
        opts.ens  # noqa: B018 - validates both names
    except ModelError as exc:
        raise CloudInitError(f"--ensemble/--namespace: {exc}") from exc
    render_agent_config(opts)  # the agent's validator has the last word on every key
    return opts


def load_unit() -> str:
    """The agent's systemd unit, shipped as package data of guest_agent."""
    try:
        return resources.files("guest_agent").joinpath(UNIT_RESOURCE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CloudInitError(
            f"the agent's systemd unit (guest_agent/{UNIT_RESOURCE}) is missing from this "
            f"installation: {exc}"
        ) from exc


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        for note in from_ensemble_args(args):
            print(f"imex-guest-agent cloudinit: {note}", file=sys.stderr)
        opts = options_from_args(args)
        unit = None if opts.install.kind == "preinstalled" else load_unit()
        out = generate(opts, unit)
    except CloudInitError as exc:
        kept = f"; {args.output} is unchanged" if args.output is not None else ""
        print(f"imex-guest-agent cloudinit: error: {exc}{kept}", file=sys.stderr)
        return 2
    if args.output is not None:
        try:
            replace_file(args.output, out.text.encode("utf-8"), mode=0o600)
        except FileWriteError as exc:
            print(f"imex-guest-agent cloudinit: error: {exc}; {args.output} is unchanged",
                  file=sys.stderr)
            return 1
    for note in out.notes:
        if args.from_ensemble is not None and note.startswith("annotate the ensemble Service"):
            continue  # the ImexEnsemble already says it (and its agent annotates the Service)
        print(f"imex-guest-agent cloudinit: {note}", file=sys.stderr)
    if args.output is not None:
        print(f"imex-guest-agent cloudinit: wrote {args.output}", file=sys.stderr)
        return 0
    try:
        _print(out.text)
    except OSError as exc:
        print(f"imex-guest-agent cloudinit: error: standard output cut short: {exc}",
              file=sys.stderr)
        return 1
    return 0


def _print(text: str) -> None:
    """``text`` on standard output, every byte or an OSError: a buffered stdout can lose a
    short write's remainder without a word (a full disk, a file size limit)."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stdout (tests): no descriptor
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    view = memoryview(text.encode("utf-8"))
    while view:
        view = view[os.write(fd, view):]
