"""``imex-host-agent``: flags and environment -> HostSettings -> the agent.

Every flag has an environment variable ``IMEX_HOST_AGENT_<FLAG>`` (dashes as
underscores); a flag given on the command line wins. Repeatable flags take a
comma-separated list in the environment. Sidecar scope (``--vmi``) reads the
namespace from ``POD_NAMESPACE`` (the downward API), or ``--namespace``.
Bad values exit with status 2 and a message naming the flag; nothing starts.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Final

from host_agent.settings import (
    DEFAULT_LISTEN,
    DEFAULT_TLS_LISTEN,
    HostSettings,
    SettingsError,
    default_agent_namespace,
    default_identity,
    parse_listen,
)
from imex_shared.model import ModelError, check_dns_label
from imex_shared.version import VersionAction

ENV_PREFIX: Final = "IMEX_HOST_AGENT_"
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off", ""})
_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")

log = logging.getLogger("imex.host")


def _env_list(environ: Mapping[str, str], name: str) -> list[str]:
    raw = environ.get(ENV_PREFIX + name, "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    def env(name: str, default: str | None = None) -> str | None:
        return environ.get(ENV_PREFIX + name, default)

    p = argparse.ArgumentParser(
        prog="imex-host-agent",
        description="Publish KubeVirt VMI ensembles as EndpointSlices and serve the "
        "ensemble registry. Every flag can also be set as IMEX_HOST_AGENT_<FLAG>.",
    )
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--namespace", action="append", default=None, metavar="NS",
                   help="namespace to watch (repeatable; default: every namespace; "
                   "env: comma-separated)")
    p.add_argument("--listen", default=env("LISTEN", DEFAULT_LISTEN), metavar="HOST:PORT",
                   help=f"registry plain HTTP address (default {DEFAULT_LISTEN}; \"\": no "
                   "plain HTTP, once every guest uses HTTPS)")
    p.add_argument("--tls-listen", default=env("TLS_LISTEN", DEFAULT_TLS_LISTEN),
                   metavar="HOST:PORT", help=f"registry HTTPS address (default "
                   f"{DEFAULT_TLS_LISTEN}), served when a certificate is given below; \"\": "
                   "no HTTPS")
    p.add_argument("--tls-cert-file", default=env("TLS_CERT_FILE"), metavar="PATH",
                   help="the registry's certificate (PEM, chain after it), re-read when it "
                   "changes (cert-manager, a mounted Secret)")
    p.add_argument("--tls-private-key-file", default=env("TLS_PRIVATE_KEY_FILE"),
                   metavar="PATH", help="its private key (PEM), re-read when it changes")
    p.add_argument("--tls-ca-file", default=env("TLS_CA_FILE"), metavar="PATH",
                   help="the CA guests pin (default: ca.crt beside --tls-cert-file, else the "
                   "chain's self-signed root)")
    p.add_argument("--tls-self-issued", action="store_true", default=None,
                   help="keep a registry CA and serving certificate in the Secret "
                   "imex-registry-tls of the agent's namespace (env "
                   "IMEX_HOST_AGENT_TLS_SELF_ISSUED=true)")
    p.add_argument("--tls-service", default=env("TLS_SERVICE", "imex-host-agent"),
                   metavar="NAME", help="--tls-self-issued: the registry Service whose DNS "
                   "names the certificate carries (default imex-host-agent, in the agent's "
                   "namespace)")
    p.add_argument("--tls-san", action="append", default=None, metavar="NAME|IP",
                   help="--tls-self-issued: a further DNS name or IP address of the registry "
                   "(repeatable; env: comma-separated)")
    p.add_argument("--kubeconfig", default=env("KUBECONFIG"), metavar="PATH",
                   help="kubeconfig file (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--vmi", default=env("VMI"), metavar="NAME",
                   help="sidecar scope: publish only this VMI (namespace from POD_NAMESPACE)")
    p.add_argument("--json", action="store_true", default=None, help="JSON log lines")
    p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"),
                   type=str.upper, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--trusted-proxy", action="append", default=None, metavar="CIDR",
                   help="proxy whose X-Forwarded-For the registry believes (repeatable)")
    p.add_argument("--report-stale-after", default=env("REPORT_STALE_AFTER", "120"),
                   metavar="SECONDS", help="a guest report older than this is stale (120)")
    p.add_argument("--hook-socket", default=env("HOOK_SOCKET"), metavar="PATH",
                   help="KubeVirt hook sidecar: answer virt-launcher's hook Info call on this "
                   "unix socket (e.g. /var/run/kubevirt-hooks/imex-host-agent.sock)")
    p.add_argument("--agent-namespace", default=None, metavar="NS",
                   help="the agent's own namespace, for its Lease and its CA Secrets (env "
                   "IMEX_AGENT_NAMESPACE; default: the service account's namespace, else "
                   "imex-system)")
    p.add_argument("--identity", default=env("IDENTITY"), metavar="NAME",
                   help="this replica's name in Leases, Events and the User-Agent "
                   "(default: POD_NAME, else the host name)")
    p.add_argument("--cert-lifetime", default=env("CERT_LIFETIME", "604800"), metavar="SECONDS",
                   help="authEncryption: validity of issued member certificates (7 days)")
    p.add_argument("--ca-overlap", default=env("CA_OVERLAP", "3600"), metavar="SECONDS",
                   help="authEncryption: how long the old CA stays trusted after a rotation")
    p.add_argument("--leader-elect", action="store_true", default=None,
                   help="elect a leader through a Lease: only the leader writes to the API, "
                   "every replica serves the registry (default off; on in the manifests; "
                   "env IMEX_HOST_AGENT_LEADER_ELECT=true)")
    p.add_argument("--leader-elect-namespace", default=env("LEADER_ELECT_NAMESPACE"),
                   metavar="NS", help="namespace of the Lease (default: --agent-namespace)")
    p.add_argument("--leader-elect-name", default=env("LEADER_ELECT_NAME", "imex-host-agent"),
                   metavar="NAME", help="name of the Lease (default imex-host-agent)")
    for flag, default, what in (
        ("lease-duration", "15", "how long candidates wait after the lease last changed"),
        ("renew-deadline", "10", "how long a leader keeps writing without a renewal"),
        ("retry-period", "2", "between two reads or renewals of the lease (jittered x1.2)"),
    ):
        env_name = "LEADER_ELECT_" + flag.upper().replace("-", "_")
        p.add_argument(f"--leader-elect-{flag}", default=env(env_name, default),
                       metavar="SECONDS", help=f"{what} (default {default})")
    return p


def _seconds_flag(flag: str, text: str, lo: float, hi: float) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise SettingsError(f"{flag} {text!r} is not a number of seconds") from exc
    if not lo <= value <= hi:
        raise SettingsError(f"{flag} {value:g}: must be between {lo:g} and {hi:g} seconds")
    return value


def _seconds(flag: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError as exc:
        raise SettingsError(f"--{flag} {value!r} is not a number of seconds") from exc
    if not 0 < number < 10**6:
        raise SettingsError(f"--{flag} {number:g}: must be a positive number of seconds")
    return number


def build_settings(argv: Sequence[str] | None, environ: Mapping[str, str]) -> HostSettings:
    """Parse flags over the environment; raises SettingsError naming the bad value."""
    args = build_parser(environ).parse_args(argv)
    namespaces = args.namespace if args.namespace is not None else _env_list(environ, "NAMESPACE")
    vmi = args.vmi or None
    if vmi is not None:
        try:
            check_dns_label(vmi, "--vmi")
        except ModelError as exc:
            raise SettingsError(str(exc)) from exc
        if not namespaces:
            pod_ns = environ.get("POD_NAMESPACE", "").strip()
            if not pod_ns:
                raise SettingsError(
                    "--vmi needs the VMI's namespace: set POD_NAMESPACE from the downward API "
                    "(fieldRef metadata.namespace) or pass --namespace"
                )
            namespaces = [pod_ns]
        if len(namespaces) != 1:
            raise SettingsError("--vmi watches one VMI: give exactly one namespace")
    for ns in namespaces:
        try:
            check_dns_label(ns, "--namespace")
        except ModelError as exc:
            raise SettingsError(str(exc)) from exc

    http_enabled = bool(args.listen.strip())
    host, port = parse_listen(args.listen) if http_enabled else ("0.0.0.0", 0)
    tls = _tls_settings(args, environ)
    if not http_enabled and tls.get("tls_listen_port") is None:
        raise SettingsError('--listen "": no plain HTTP needs HTTPS instead: give '
                            "--tls-self-issued or --tls-cert-file (and a --tls-listen)")

    json_logs = args.json
    if json_logs is None:
        raw = environ.get(ENV_PREFIX + "JSON", "").strip().lower()
        if raw not in _TRUE | _FALSE:
            raise SettingsError(f"{ENV_PREFIX}JSON={raw!r}: expected true or false")
        json_logs = raw in _TRUE
    if args.log_level not in _LEVELS:
        raise SettingsError(f"--log-level {args.log_level!r}: expected one of {', '.join(_LEVELS)}")

    proxies = args.trusted_proxy if args.trusted_proxy is not None else _env_list(
        environ, "TRUSTED_PROXY")
    for cidr in proxies:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError as exc:
            raise SettingsError(f"--trusted-proxy {cidr!r} is not a CIDR") from exc
    try:
        stale = float(args.report_stale_after)
    except ValueError as exc:
        raise SettingsError(
            f"--report-stale-after {args.report_stale_after!r} is not a number of seconds"
        ) from exc
    if not 0 < stale < 10**7:
        raise SettingsError(f"--report-stale-after {stale}: must be positive")

    hook_socket = args.hook_socket or None
    if hook_socket is not None:
        from host_agent.sidecar.hook import HookSidecarError, check_socket_path

        try:
            check_socket_path(hook_socket)
        except HookSidecarError as exc:
            raise SettingsError(f"--hook-socket: {exc}") from exc

    agent_namespace = (args.agent_namespace or environ.get(ENV_PREFIX + "AGENT_NAMESPACE", "")
                       or default_agent_namespace(environ))
    try:
        check_dns_label(agent_namespace, "--agent-namespace")
    except ModelError as exc:
        raise SettingsError(str(exc)) from exc
    identity = (args.identity or "").strip() or default_identity(environ)
    if not 0 < len(identity) <= 128 or not identity.isprintable() or " " in identity:
        raise SettingsError(f"--identity {identity!r}: 1-128 printable characters, no spaces")

    cert_lifetime = _seconds_flag("--cert-lifetime", args.cert_lifetime, 60, 366 * 86400)
    ca_overlap = _seconds_flag("--ca-overlap", args.ca_overlap, 1, 366 * 86400)

    leader_elect = args.leader_elect
    if leader_elect is None:
        raw = environ.get(ENV_PREFIX + "LEADER_ELECT", "").strip().lower()
        if raw not in _TRUE | _FALSE:
            raise SettingsError(f"{ENV_PREFIX}LEADER_ELECT={raw!r}: expected true or false")
        leader_elect = raw in _TRUE
    if leader_elect and vmi is not None:
        raise SettingsError("--leader-elect and --vmi: a sidecar publishes its own VMI and "
                            "never elects; drop one of them")
    lease_ns = (args.leader_elect_namespace or "").strip()
    if lease_ns:
        try:
            check_dns_label(lease_ns, "--leader-elect-namespace")
        except ModelError as exc:
            raise SettingsError(str(exc)) from exc
    lease_name = (args.leader_elect_name or "").strip()
    if not lease_name or len(lease_name) > 253 or not all(
            (c.isalnum() and c.islower()) or c.isdigit() or c in "-." for c in lease_name):
        raise SettingsError(f"--leader-elect-name {lease_name!r}: not a valid object name "
                            "(lower-case letters, digits, '-' and '.')")
    lease = _seconds("leader-elect-lease-duration", args.leader_elect_lease_duration)
    renew = _seconds("leader-elect-renew-deadline", args.leader_elect_renew_deadline)
    retry = _seconds("leader-elect-retry-period", args.leader_elect_retry_period)
    from host_agent.kube.election import ElectionConfig

    try:
        ElectionConfig(lease, renew, retry).check()
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc

    return HostSettings(
        cert_lifetime_seconds=cert_lifetime,
        ca_overlap_seconds=ca_overlap,
        leader_elect=bool(leader_elect),
        leader_elect_namespace=lease_ns,
        leader_elect_name=lease_name,
        leader_elect_lease_duration=lease,
        leader_elect_renew_deadline=renew,
        leader_elect_retry_period=retry,
        agent_namespace=agent_namespace,
        identity=identity,
        namespaces=tuple(dict.fromkeys(namespaces)),
        listen_host=host,
        listen_port=port,
        kubeconfig=args.kubeconfig or None,
        vmi=vmi,
        json_logs=bool(json_logs),
        log_level=args.log_level,
        trusted_proxies=tuple(proxies),
        report_stale_after=stale,
        hook_socket=hook_socket,
        http_enabled=http_enabled,
        **tls,  # type: ignore[arg-type]
    )


def _tls_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, object]:
    """The registry's HTTPS flags, checked (HostSettings' tls_* fields)."""
    self_issued = args.tls_self_issued
    if self_issued is None:
        raw = environ.get(ENV_PREFIX + "TLS_SELF_ISSUED", "").strip().lower()
        if raw not in _TRUE | _FALSE:
            raise SettingsError(f"{ENV_PREFIX}TLS_SELF_ISSUED={raw!r}: expected true or false")
        self_issued = raw in _TRUE
    cert = (args.tls_cert_file or "").strip() or None
    key = (args.tls_private_key_file or "").strip() or None
    ca = (args.tls_ca_file or "").strip() or None
    if (cert is None) != (key is None):
        missing = "--tls-private-key-file" if key is None else "--tls-cert-file"
        raise SettingsError(f"{missing} is missing: --tls-cert-file and "
                            "--tls-private-key-file go together")
    if cert is not None and self_issued:
        raise SettingsError("--tls-self-issued and --tls-cert-file: the certificate comes "
                            "from one of them; drop the other")
    if ca is not None and cert is None:
        raise SettingsError("--tls-ca-file goes with --tls-cert-file")
    for flag, path in (("--tls-cert-file", cert), ("--tls-private-key-file", key),
                       ("--tls-ca-file", ca)):
        if path is not None and not os.path.isabs(path):
            raise SettingsError(f"{flag} {path!r}: an absolute path, please")
    out: dict[str, object] = {"tls_cert_file": cert, "tls_private_key_file": key,
                              "tls_ca_file": ca, "tls_self_issued": bool(self_issued)}
    listen = args.tls_listen.strip()
    if listen and (self_issued or cert is not None):
        out["tls_listen_host"], out["tls_listen_port"] = parse_listen(listen, "--tls-listen")
    try:
        out["tls_service"] = check_dns_label(args.tls_service.strip(), "--tls-service")
    except ModelError as exc:
        raise SettingsError(str(exc)) from exc
    sans = args.tls_san if args.tls_san is not None else _env_list(environ, "TLS_SAN")
    for san in sans:
        try:
            ipaddress.ip_address(san)
        except ValueError:
            labels = san.lower().rstrip(".").split(".")
            if not all(lbl and len(lbl) <= 63 and lbl.strip("abcdefghijklmnopqrstuvwxyz"
                                                             "0123456789-") == ""
                       and not lbl.startswith("-") and not lbl.endswith("-")
                       for lbl in labels):
                raise SettingsError(f"--tls-san {san!r} is neither an IP address nor a DNS "
                                    "name") from None
    out["tls_sans"] = tuple(dict.fromkeys(sans))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from host_agent.kube.client import KubeConfigError
    from host_agent.logs import setup_logging
    from host_agent.main import run
    from host_agent.sidecar.hook import HookSidecarError

    try:
        settings = build_settings(argv, os.environ)
    except SettingsError as exc:
        print(f"imex-host-agent: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.json_logs)
    try:
        return run(settings)
    except KubeConfigError as exc:
        log.error("%s", exc)
        return 2
    except HookSidecarError as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:
        log.error("cannot listen on %s: %s", settings.listen if settings.http_enabled
                  else f"{settings.tls_listen_host}:{settings.tls_listen_port}", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
