"""Ensemble Service JSON -> ``EnsembleSpec`` plus the problems found on the way.

Pure: no I/O, no clock. The reconciler calls it on every pass with the
Service as the informer last saw it.

Failure rules (DESIGN.md "Names"):
- ``imex-ensemble.io/max-members``, ``mode`` and ``auth-encryption`` shape the
  domain itself (how many lines every guest's nodes file has, what is in
  them, whether peers speak TLS). Guessing one wrong could split a domain, so
  a malformed value is a **refusal** (``spec`` is None); the reconciler then
  keeps the last valid spec it had, if any. So is ``auth-encryption: "true"``
  with ``mode: ips``: IMEX checks a peer's certificate against the name it
  dialled, and in ips mode there are no names (the ImexEnsemble CRD refuses
  the same pair with a CEL rule; ``check_spec`` is the agent's copy of it).
- ``port``, ``network``, ``token-sha256`` and ``ca-rotation`` have safe
  fallbacks: the default port, the default network choice, no token (guest
  reports refused), no rotation. Each fallback is reported as a problem
  naming the annotation and the value.
- A Service not labelled ``imex-ensemble.io/ensemble=<its own name>`` is not
  an ensemble (refusal). One that has a selector or a cluster IP still
  publishes, with a problem: DNS then serves it wrongly or twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from host_agent.state.snapshot import EnsembleSpec
from imex_shared.ensemble_crd import SPEC_FIELDS
from imex_shared.model import (
    DEFAULT_MAX_MEMBERS,
    DEFAULT_PORT,
    MAX_MEMBERS_LIMIT,
    EnsembleId,
    ModelError,
    is_sha256_hex,
)
from imex_shared.render import MODES, Mode

PREFIX: Final = "imex-ensemble.io/"
ENSEMBLE_LABEL: Final = PREFIX + "ensemble"
INDEX_LABEL: Final = PREFIX + "index"
MAX_MEMBERS_ANNOTATION: Final = PREFIX + "max-members"
NETWORK_ANNOTATION: Final = PREFIX + "network"
PORT_ANNOTATION: Final = PREFIX + "port"
TOKEN_ANNOTATION: Final = PREFIX + "token-sha256"
MODE_ANNOTATION: Final = PREFIX + "mode"
AUTH_ENCRYPTION_ANNOTATION: Final = PREFIX + "auth-encryption"
CA_ROTATION_ANNOTATION: Final = PREFIX + "ca-rotation"
#: spec.registryTLS's twin: "Required" refuses the token over plain HTTP
REGISTRY_TLS_ANNOTATION: Final = PREFIX + "registry-tls"
#: ``ca-rotation`` is an opaque trigger (a date, a counter); the CRD's bound, so that
#: a Service and an ImexEnsemble accept the same values.
CA_ROTATION_MAX: Final[int] = SPEC_FIELDS["caRotation"]["max_length"]

# KubeVirt network names (spec.networks[].name) are DNS-label-like; be a bit
# more lenient (upper case, dots) but refuse blanks and control characters.
_NETWORK_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, (dict, Mapping)) else {}


def _str_map(value: object) -> dict[str, str]:
    return {str(k): v for k, v in _mapping(value).items() if isinstance(v, str)}


def _decimal(text: str) -> int | None:
    text = text.strip()
    if not text.isascii() or not text.isdigit():
        return None
    return int(text)


def service_key(service: Mapping[str, object]) -> tuple[str, str]:
    """(namespace, name) of a Service object; empty strings when absent."""
    meta = _mapping(service.get("metadata"))
    ns = meta.get("namespace")
    name = meta.get("name")
    return (ns if isinstance(ns, str) else "", name if isinstance(name, str) else "")


def parse_ensemble_service(service: Mapping[str, object]) -> tuple[EnsembleSpec | None, list[str]]:
    """The ensemble a Service declares, and every problem with it.

    Returns (None, problems) when the Service cannot be an ensemble or its
    size is unreadable; otherwise a spec, possibly with safe fallbacks that
    the problems describe.
    """
    namespace, name = service_key(service)
    what = f"Service {namespace}/{name}" if namespace or name else "Service"
    meta = _mapping(service.get("metadata"))
    labels = _str_map(meta.get("labels"))
    annotations = _str_map(meta.get("annotations"))
    spec_json = _mapping(service.get("spec"))
    problems: list[str] = []

    try:
        ens = EnsembleId(namespace, name)
    except ModelError as exc:
        return None, [f"{what}: {exc}"]

    label = labels.get(ENSEMBLE_LABEL)
    if label != name:
        return None, [
            f"{what} is labelled {ENSEMBLE_LABEL}={label!r}; an ensemble Service must carry "
            f"its own name ({name!r}) there"
        ]

    max_members = DEFAULT_MAX_MEMBERS
    raw = annotations.get(MAX_MEMBERS_ANNOTATION)
    if raw is not None:
        value = _decimal(raw)
        if value is None or not 1 <= value <= MAX_MEMBERS_LIMIT:
            return None, [
                f"{what}: annotation {MAX_MEMBERS_ANNOTATION}={raw!r} is not an integer in "
                f"1..{MAX_MEMBERS_LIMIT}; refusing to guess the ensemble size (it fixes every "
                "guest's nodes file)"
            ]
        max_members = value

    mode: Mode = "names"
    raw = annotations.get(MODE_ANNOTATION)
    if raw is not None:
        if raw.strip() not in MODES:
            return None, [
                f"{what}: annotation {MODE_ANNOTATION}={raw!r} is not 'names' or 'ips'; "
                "refusing to guess what every guest's nodes file holds"
            ]
        mode = "ips" if raw.strip() == "ips" else "names"

    auth_encryption = False
    raw = annotations.get(AUTH_ENCRYPTION_ANNOTATION)
    if raw is not None:
        flag = parse_bool(raw)
        if flag is None:
            return None, [
                f"{what}: annotation {AUTH_ENCRYPTION_ANNOTATION}={raw!r} is not 'true' or "
                "'false'; refusing to guess whether the peers speak TLS"
            ]
        auth_encryption = flag

    clash = check_spec(mode, auth_encryption)
    if clash is not None:
        return None, [f"{what}: {clash}"]

    port = DEFAULT_PORT
    raw = annotations.get(PORT_ANNOTATION)
    if raw is not None:
        value = _decimal(raw)
        if value is None or not 1 <= value <= 65535:
            problems.append(
                f"{what}: annotation {PORT_ANNOTATION}={raw!r} is not a port number "
                f"(1..65535); publishing port {DEFAULT_PORT}"
            )
        else:
            port = value

    network: str | None = None
    raw = annotations.get(NETWORK_ANNOTATION)
    if raw is not None:
        if _NETWORK_NAME.match(raw.strip()):
            network = raw.strip()
        else:
            problems.append(
                f"{what}: annotation {NETWORK_ANNOTATION}={raw!r} is not a network name; "
                "using the VMI's 'default' network, else its first interface"
            )

    token: str | None = None
    raw = annotations.get(TOKEN_ANNOTATION)
    if raw is not None:
        if is_sha256_hex(raw.strip().lower()):  # hand-written: upper case is accepted
            token = raw.strip().lower()
        else:
            problems.append(
                f"{what}: annotation {TOKEN_ANNOTATION} is not 64 hex digits; "
                "guest status reports are refused until it is fixed"
            )

    ca_rotation: str | None = None
    raw = annotations.get(CA_ROTATION_ANNOTATION)
    if raw is not None:
        if not raw.strip() or len(raw) > CA_ROTATION_MAX or not raw.isprintable():
            problems.append(
                f"{what}: annotation {CA_ROTATION_ANNOTATION} must be 1-{CA_ROTATION_MAX} "
                "printable characters; no CA rotation is started until it is fixed"
            )
        else:
            ca_rotation = raw.strip()

    registry_tls_required = False
    raw = annotations.get(REGISTRY_TLS_ANNOTATION)
    if raw is not None:
        word = raw.strip().lower()
        registry_tls_required = word != "optional"
        if word not in ("optional", "required"):
            problems.append(
                f"{what}: annotation {REGISTRY_TLS_ANNOTATION}={raw!r} is not Optional or "
                "Required; taken as Required (the token is refused over plain HTTP) until "
                "it is fixed"
            )

    if spec_json.get("selector"):
        problems.append(
            f"{what} has a selector; an ensemble Service must be selector-less, or "
            "Kubernetes publishes its own endpoints beside ours"
        )
    cluster_ip = spec_json.get("clusterIP")
    if cluster_ip is not None and cluster_ip != "None":
        problems.append(
            f"{what} is not headless (clusterIP {cluster_ip!r}); per-member DNS names "
            "need clusterIP: None"
        )

    uid = meta.get("uid")
    spec = EnsembleSpec(
        ens=ens,
        max_members=max_members,
        port=port,
        network=network,
        token_sha256=token,
        uid=uid if isinstance(uid, str) and uid else None,
        mode=mode,
        auth_encryption=auth_encryption,
        ca_rotation=ca_rotation,
        registry_tls_required=registry_tls_required,
        source="service",
    )
    return spec, problems


def parse_bool(text: str) -> bool | None:
    """``true`` / ``false`` (any case, surrounding blanks ignored); None for anything else."""
    value = text.strip().lower()
    return True if value == "true" else False if value == "false" else None


def check_spec(mode: Mode, auth_encryption: bool) -> str | None:
    """Why settings that each parse cannot go together (None when they can).

    The ImexEnsemble CRD has the same rule in CEL; Service-only ensembles get it here.
    """
    if auth_encryption and mode == "ips":
        return (
            "authEncryption needs mode names: IMEX checks peer certificates against "
            "host names, which mode ips does not write"
        )
    return None


def service_annotations(spec: EnsembleSpec) -> dict[str, str]:
    """The annotations that declare ``spec`` on a Service (``parse_ensemble_service``'s inverse).

    An ImexEnsemble's own Service carries them too, so the Service alone says what the
    ensemble is: ``kubectl get svc -o yaml`` shows it, and a CR deleted with
    ``--cascade=orphan`` leaves a Service-only ensemble with the same settings (no
    nodes file changes, no IMEX restart). ``memberSelector`` has no annotation: an
    orphaned Service takes every VMI labelled with its name.
    """
    out = {
        MAX_MEMBERS_ANNOTATION: str(spec.max_members),
        PORT_ANNOTATION: str(spec.port),
        MODE_ANNOTATION: spec.mode,
        AUTH_ENCRYPTION_ANNOTATION: "true" if spec.auth_encryption else "false",
    }
    if spec.network is not None:
        out[NETWORK_ANNOTATION] = spec.network
    if spec.token_sha256 is not None:
        out[TOKEN_ANNOTATION] = spec.token_sha256
    if spec.ca_rotation is not None:
        out[CA_ROTATION_ANNOTATION] = spec.ca_rotation
    if spec.registry_tls_required:  # only when set: no write for every existing ensemble
        out[REGISTRY_TLS_ANNOTATION] = "Required"
    return out
