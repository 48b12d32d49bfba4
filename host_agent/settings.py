"""The host agent's one frozen settings object, built by cli.py and passed down.

Nothing below main.py reads flags, the environment or globals: every knob the
agent has is a field here, with the default the contract (DESIGN.md "Host
agent") gives it.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from imex_shared.version import package_version as agent_version

DEFAULT_LISTEN: Final = "0.0.0.0:8080"
DEFAULT_TLS_LISTEN: Final = "0.0.0.0:8443"
DEFAULT_AGENT_NAMESPACE: Final = "imex-system"
#: Where a pod's service account namespace is mounted (in-cluster).
SA_NAMESPACE_FILE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class SettingsError(ValueError):
    """A flag or environment value that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class HostSettings:
    #: Namespaces to watch; empty means every namespace the agent may see.
    namespaces: tuple[str, ...] = ()
    listen_host: str = "0.0.0.0"
    listen_port: int = 8080
    #: None: in-cluster config, else ~/.kube/config (and $KUBECONFIG).
    kubeconfig: str | None = None
    #: Sidecar scope: only this VMI (in ``namespaces[0]``, from POD_NAMESPACE).
    vmi: str | None = None
    json_logs: bool = False
    log_level: str = "INFO"
    #: Registry: proxies whose X-Forwarded-For is believed (CIDRs).
    trusted_proxies: tuple[str, ...] = ()
    #: Registry: a guest report older than this is shown as stale.
    report_stale_after: float = 120.0
    field_manager: str = "imex-host-agent"
    #: Ensembles reconciled at the same time.
    workers: int = 8
    #: How long an event waits for the rest of its burst (one that follows another
    #: event of its ensemble within ``quiet_seconds``).
    settle_seconds: float = 0.05
    #: An ensemble with no event for this long is quiet, and its next event is
    #: reconciled at once: an isolated change (a VM's new address) does not wait for
    #: company. A burst's events (a boot storm's VMIs, a relist) come closer than this.
    quiet_seconds: float = 0.25
    #: Server-side watch timeout (the server closes, the agent resumes).
    watch_timeout_seconds: int = 290
    #: Backoff with full jitter between failed list/watch/apply attempts.
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    #: How often an optional kind the cluster does not serve (the ImexEnsemble CRD not
    #: installed, or not permitted) is listed again.
    optional_kind_retry: float = 30.0
    #: How often a CR whose name is taken by a Service we cannot see is looked at again.
    conflict_recheck: float = 30.0
    #: ``--listen ""``: no plain HTTP (every guest uses HTTPS)
    http_enabled: bool = True
    #: The registry's HTTPS (docs/security.md): ``--tls-listen``, and where its
    #: certificate comes from: files (``--tls-cert-file``/``--tls-private-key-file``,
    #: re-read on change; ``--tls-ca-file``) or the agent itself (``--tls-self-issued``:
    #: the Secret imex-registry-tls, naming ``tls_service``'s DNS names and ``tls_sans``).
    tls_listen_host: str = "0.0.0.0"
    tls_listen_port: int | None = None
    tls_cert_file: str | None = None
    tls_private_key_file: str | None = None
    tls_ca_file: str | None = None
    tls_self_issued: bool = False
    tls_service: str = "imex-host-agent"
    tls_sans: tuple[str, ...] = ()
    #: self-issued: the serving certificate's lifetime (renewed at two thirds)
    registry_cert_lifetime: float = 30 * 86400.0
    #: self-issued: every replica reads the Secret this often; files: looked at this often
    tls_recheck: float = 30.0
    tls_file_interval: float = 5.0
    #: Seconds to finish in-flight work on SIGTERM before tasks are cancelled.
    shutdown_grace: float = 5.0
    #: KubeVirt hook sidecar: answer virt-launcher's hook Info call on this unix socket.
    hook_socket: str | None = None
    #: After virt-launcher's Shutdown hook call, keep running this long (seconds), then stop.
    hook_shutdown_linger: float = 5.0
    #: The agent's own namespace: its Lease (leader election) and its Secrets (the
    #: per-ensemble CAs) live here, and only here (a Role, nothing cluster-wide).
    agent_namespace: str = DEFAULT_AGENT_NAMESPACE
    #: Who this replica is (Lease holder, Event reportingInstance, User-Agent).
    identity: str = "imex-host-agent"
    #: authEncryption: how long an issued member certificate is valid (7 days).
    cert_lifetime_seconds: float = 7 * 86400.0
    #: authEncryption: how long the old CA stays trusted after a rotation.
    ca_overlap_seconds: float = 3600.0
    #: Leader election (a Lease): only the leader writes; every replica serves.
    leader_elect: bool = False
    #: Where the Lease lives; empty: ``agent_namespace``.
    leader_elect_namespace: str = ""
    leader_elect_name: str = "imex-host-agent"
    leader_elect_lease_duration: float = 15.0
    leader_elect_renew_deadline: float = 10.0
    leader_elect_retry_period: float = 2.0
    #: On SIGTERM: readiness off, lease released, long-polls answered at once; the
    #: listener stays open this long (seconds) so a balancer that still sends new
    #: connections here (until it saw readiness go) gets answers, not refusals.
    shutdown_drain: float = 2.0

    @property
    def lease_namespace(self) -> str:
        return self.leader_elect_namespace or self.agent_namespace

    @property
    def persists_membership(self) -> bool:
        """Whether the (generation, view) pair lives in the API: everywhere but the
        sidecar, which sees one VMI and cannot speak for the ensemble."""
        return self.vmi is None

    @property
    def user_agent(self) -> str:
        """Sent on every API call: replicas share one service account, and the
        audit log must still tell them apart."""
        return f"imex-host-agent/{agent_version()} ({self.identity})"

    @property
    def listen(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self.listen_port}"

    @property
    def tls_enabled(self) -> bool:
        """HTTPS is served: a listener and a certificate source."""
        return self.tls_listen_port is not None and (
            self.tls_self_issued or self.tls_cert_file is not None)


def default_agent_namespace(
    environ: Mapping[str, str], sa_file: Path = SA_NAMESPACE_FILE
) -> str:
    """``IMEX_AGENT_NAMESPACE``, else the service account's namespace file, else imex-system."""
    value = environ.get("IMEX_AGENT_NAMESPACE", "").strip()
    if value:
        return value
    try:
        value = sa_file.read_text(encoding="utf-8").strip()
    except OSError:
        value = ""
    return value or DEFAULT_AGENT_NAMESPACE


def default_identity(environ: Mapping[str, str]) -> str:
    """``POD_NAME`` (the downward API), else the host name."""
    return environ.get("POD_NAME", "").strip() or socket.gethostname()


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); raises SettingsError."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise SettingsError(f"{flag} {text!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise SettingsError(f"{flag} {text!r}: expected HOST:PORT")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise SettingsError(f"{flag} {text!r}: port {port_text!r} is not 0..65535")
    return host or "0.0.0.0", int(port_text)
