"""What this guest reports: the status fields, the status PUT's body, when it carries
the domain view.

Pure; the sender is :mod:`guest_agent.report.report_io` (``Reporter``), the collector of
the domain view :mod:`guest_agent.report.collect`, the status file
:mod:`guest_agent.report.status_file`. The agent feeds every change through here:

- an applied pass (:func:`take_applied`): own slot, source, generation, members, the
  files' digests;
- IMEX's state and counters (:func:`take_imex`) and a collection pass
  (:func:`take_collected`): the domain view, fabric and channels; an error either brings
  becomes ``last_error`` once;
- the status PUT's body (:func:`status_body`) is built from the status and the last
  collection pass. ``imex_domain`` is this member's own entry of the view with its
  top-level fields (:func:`imex_shared.imex_domain.own_view`: ~1.3 KB of an 18-node
  view's ~23 KB), sent only when the registry needs it (:func:`send_domain`): when it
  changed since the last report the registry accepted with it (the top-level
  ``timestamp`` aside, :func:`domain_key`), at least once a minute, on the first report
  after start, and after any failure or an answer from a replica that is shutting down.
  Otherwise the key is left out, which the registry reads as "unchanged" (null would
  mean "no domain view").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from guest_agent.config import Settings
from guest_agent.pins.merge import Known, PinPlan
from guest_agent.report.status_file import Status
from imex_shared.imex_domain import Fabric, own_row, own_view
from imex_shared.model import EnsembleId

#: The registry gets the full domain view at least this often (seconds), so a replica
#: that restarted or joined has every member's link row within a minute.
DOMAIN_REFRESH = 60.0
#: A field an older registry refused is left out of reports this long, then tried again
#: (the host agent may have been upgraded meanwhile).
FIELD_RETRY = 600.0
#: pydantic's word for a field a 0.1 registry does not know (``extra="forbid"``)
_EXTRA_FORBIDDEN = "Extra inputs are not permitted"
#: never left out: what every registry since 0.1 knows
CORE_FIELDS = frozenset({"imex_state", "generation_applied", "nodes_config_sha256",
                         "hosts_sha256", "signals", "restarts", "agent_version"})


def refused_fields(answer: bytes) -> frozenset[str]:
    """Top-level report fields a registry's 422 refused as unknown (a 0.1 registry's
    ``{"detail": [{"loc": ["<field>"], "msg": "Extra inputs are not permitted"}]}``)."""
    try:
        doc = json.loads(answer)
    except (UnicodeDecodeError, ValueError):
        return frozenset()
    detail = doc.get("detail") if isinstance(doc, dict) else None
    out = set()
    for entry in detail if isinstance(detail, list) else ():
        if not isinstance(entry, dict) or entry.get("msg") != _EXTRA_FORBIDDEN:
            continue
        loc = entry.get("loc")
        if isinstance(loc, list) and len(loc) == 1 and isinstance(loc[0], str):
            out.add(loc[0])
    return frozenset(out - CORE_FIELDS)


def left_out(dropped: dict[str, float], now: float, retry: float = FIELD_RETRY) -> set[str]:
    """The refused fields still left out at ``now`` (each for ``retry`` seconds)."""
    return {name for name, at in dropped.items() if now - at < retry}

@dataclass(frozen=True, slots=True)
class Report:
    index: int
    body: dict[str, Any]


def domain_key(doc: object) -> str:
    """What "the domain view changed" compares: sha256 of the view's canonical JSON
    without its top-level ``timestamp`` (IMEX stamps every print of ``-N -j``; a
    connection's ``changed`` moves only with its state, so it stays in). ``None``
    (no view) has a key of its own."""
    if isinstance(doc, dict):
        doc = {k: v for k, v in doc.items() if k != "timestamp"}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class DomainAccepted:
    """The domain view the registry last accepted (its :func:`domain_key`) and when
    (monotonic seconds)."""

    key: str
    at: float


def send_domain(
    key: str, accepted: DomainAccepted | None, now: float, refresh: float = DOMAIN_REFRESH
) -> bool:
    """Whether the next report carries ``imex_domain``.

    Yes when nothing is known to be accepted (the first report after start, or after a
    failure or a closing replica: ``accepted`` is None), when the view differs from the
    accepted one, or when the accepted one is ``refresh`` seconds old or more.
    """
    return accepted is None or accepted.key != key or now - accepted.at >= refresh


def domain_refresh(report_interval: float) -> float:
    """The age at which the view is resent: one report interval early, so the last
    report due inside the minute carries it (the next one could come after it)."""
    return max(0.0, DOMAIN_REFRESH - report_interval)


def status_url(settings: Settings, index: int) -> str:
    assert settings.registry_url is not None
    return (
        f"{settings.registry_url}/v1/ensembles/{settings.namespace}/{settings.ensemble}"
        f"/members/{index}/status"
    )


@dataclass
class Collected:
    """The latest pass; ``fabric_known`` False until nvidia-smi answered once."""

    imex_domain: dict[str, Any] | None = None
    fabric: Fabric | None = None
    fabric_known: bool = False
    #: the configured IMEX channels whose device nodes are correct (channels_io)
    channels: list[int] = field(default_factory=list)
    errors: int = 0
    last_error: str | None = None
    at: float = 0.0
    passes: int = 0
    fabric_checked_at: float | None = field(default=None, repr=False)


def take_applied(status: Status, ens: EnsembleId, plan: PinPlan, known: Known,
                 nodes_sha256: str, hosts_sha256: str) -> None:
    """An applied pass into ``status``: what was written, for whom, from which View."""
    s, own = status, plan.own
    s.applies += 1
    s.own_index = own.index
    s.own_slot = ens.slot(own.index) if own.index is not None else None
    s.own_slot_how = own.how
    s.own_slot_note = own.note
    s.own_ip = own.pin_ip
    s.source = known.source
    s.generation_applied = known.generation
    s.members = [
        {"index": i, "slot": ens.slot(i), "ip": ip, "local_ip": plan.hosts_pins.get(i),
         "clique": known.cliques.get(i)}
        for i, ip in sorted(known.published.items())
    ]
    s.nodes_config_sha256 = nodes_sha256
    s.hosts_sha256 = hosts_sha256


#: IMEX as the supervisor counts it: (state, signals, restarts, starts, pid)
ImexCounters = tuple[str, int, int, int, int | None]


def take_imex(status: Status, imex: ImexCounters, error: str | None,
              now: float) -> tuple[bool, bool]:
    """IMEX's counters and its last error into ``status``: (whether the status changed,
    whether ``error`` was taken as the new ``last_error``, so the caller drops it)."""
    s = status
    old = (s.imex_state, s.signals, s.restarts, s.starts, s.imex_pid)
    taken = bool(error) and error != s.last_error
    if taken:
        s.last_error, s.last_error_at = error, now
    elif imex == old:
        return False, False
    s.imex_state, s.signals, s.restarts, s.starts, s.imex_pid = imex
    return True, taken


def take_collected(status: Status, result: Collected, own_index: int | None,
                   now: float) -> None:
    """A collection pass into ``status``; its new ``last_error`` is taken once (cleared
    in ``result``)."""
    s = status
    doc = result.imex_domain
    row = own_row(doc, own_index) if doc is not None and own_index is not None else None
    s.imex_domain_status = doc.get("status") if doc is not None else None
    s.imex_row = {str(k): v for k, v in sorted(row.items())} if row is not None else None
    s.fabric = result.fabric.to_json() if result.fabric is not None else None
    s.clique = result.fabric.key if result.fabric is not None else None
    s.imex_channels = list(result.channels)
    s.imex_channel0 = 0 in result.channels
    s.domain_errors = result.errors
    s.domain_at = result.at
    if result.last_error is not None and result.last_error != s.last_error:
        s.last_error, s.last_error_at = result.last_error, now
        result.last_error = None


def status_body(status: Status, collected: Collected | None,
                with_cert: bool) -> dict[str, Any]:
    """The status PUT's body (``with_cert``: authEncryption, the certificate's expiry)."""
    s = status
    body: dict[str, Any] = {
        "imex_state": s.imex_state,
        "generation_applied": s.generation_applied,
        "nodes_config_sha256": s.nodes_config_sha256,
        "hosts_sha256": s.hosts_sha256,
        "signals": s.signals,
        "restarts": s.restarts,
        "agent_version": s.agent_version,
        **({"cert_not_after": (s.tls or {}).get("cert_not_after")} if with_cert else {}),
        **({"preflight": s.preflight} if s.preflight else {}),
    }
    c = collected
    if c is not None:
        # null: no view (the registry drops the row); the reporter leaves the key
        # out while the view is unchanged (the registry keeps the row); only the own
        # entry goes, the only part any registry keeps (own_view)
        doc = c.imex_domain
        body["imex_domain"] = own_view(doc, s.own_index) if doc is not None else None
        if c.fabric_known:
            body["fabric"] = c.fabric.to_json() if c.fabric is not None else None
        body["imex_channels"] = list(c.channels)
        body["imex_channel0"] = 0 in c.channels  # beside imex_channels for this release
    return body
