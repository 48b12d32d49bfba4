"""Ensemble Service JSON -> ``EnsembleSpec`` plus the problems found on the way.

Pure: no I/O, no clock. The reconciler calls it on every pass with the
Service as the informer last saw it.

Failure rules (DESIGN.md "Names"):
- ``imex-ensemble.io/max-members`` decides how many lines every guest's
  nodes file has. Guessing it wrong could split a domain, so a malformed
  value is a **refusal** (``spec`` is None); the reconciler then keeps the
  last valid spec it had, if any.
- ``port``, ``network`` and ``token-sha256`` have safe fallbacks: the default
  port, the default network choice, and no token (guest reports refused).
  Each fallback is reported as a problem naming the annotation and the value.
- A Service not labelled ``imex-ensemble.io/ensemble=<its own name>`` is not
  an ensemble (refusal). One that has a selector or a cluster IP still
  publishes, with a problem: DNS then serves it wrongly or twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from guest_agent.model import (
    DEFAULT_MAX_MEMBERS,
    DEFAULT_PORT,
    MAX_MEMBERS_LIMIT,
    EnsembleId,
    ModelError,
)
from host_agent.state import EnsembleSpec

PREFIX: Final = "imex-ensemble.io/"
ENSEMBLE_LABEL: Final = PREFIX + "ensemble"
INDEX_LABEL: Final = PREFIX + "index"
MAX_MEMBERS_ANNOTATION: Final = PREFIX + "max-members"
NETWORK_ANNOTATION: Final = PREFIX + "network"
PORT_ANNOTATION: Final = PREFIX + "port"
TOKEN_ANNOTATION: Final = PREFIX + "token-sha256"

_SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
# KubeVirt network names (spec.networks[].name) are DNS-label-like; be a bit
# more lenient (upper case, dots) but refuse blanks and control characters.
_NETWORK_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


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
        if _SHA256_HEX.match(raw.strip()):
            token = raw.strip().lower()
        else:
            problems.append(
                f"{what}: annotation {TOKEN_ANNOTATION} is not 64 hex digits; "
                "guest status reports are refused until it is fixed"
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
    )
    return spec, problems
