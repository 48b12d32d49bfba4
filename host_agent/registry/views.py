"""Pure views of an ensemble snapshot: the registry's JSON, table and file bodies.

Everything here is a function of (snapshot, now, stale_after) with no I/O and
no clock of its own, so the registry's answers can be tested byte for byte
without a server. The file bodies come from the guest's own renderers
(``imex_shared.render`` / ``imex_shared.hostsfile``): what the registry serves
is exactly what a guest with the same membership writes.

Field names follow DESIGN.md "Registry HTTP API". Times are RFC 3339 UTC
strings (``since``, ``received_at``); ages are seconds, rounded to 0.1 s.
A guest's report is *stale* when it is older than ``stale_after`` seconds:
it stays visible (the last thing that guest said), marked as such.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from host_agent.registry.domain_view import aggregate, membership_problems
from host_agent.state.shared import shared_messages
from host_agent.state.snapshot import EnsembleSnapshot, GuestReport, PublishedMember, served_cliques
from imex_shared.cliques import pins_for
from imex_shared.hostsfile import merge_hosts
from imex_shared.model import ABSENT_IP
from imex_shared.render import Mode, render_nodes_config

#: The fields a guest reports (PUT .../members/{index}/status), in display order.
REPORT_FIELDS: tuple[str, ...] = (
    "imex_state",
    "generation_applied",
    "nodes_config_sha256",
    "hosts_sha256",
    "signals",
    "restarts",
    "agent_version",
    "cert_not_after",
    # 0.2: the registry CA this guest pins (null: plain HTTP), and how its report came
    # (``transport``, http or https: the registry's own record, not the guest's word)
    "registry_ca_sha256",
    "transport",
)


def rfc3339(ts: float) -> str:
    """``2026-11-29T17:37:19.123Z`` for a Unix time."""
    moment = dt.datetime.fromtimestamp(ts, tz=dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def report_age(report: GuestReport, now: float) -> float:
    """Seconds since the report came in (never negative: clocks may step)."""
    return max(0.0, now - report.received_at)


def is_stale(report: GuestReport, now: float, stale_after: float) -> bool:
    return report_age(report, now) > stale_after


def guest_json(report: GuestReport | None, now: float, stale_after: float) -> dict[str, Any] | None:
    """The ``guest`` field of a member: its last report, its age and whether it is stale."""
    if report is None:
        return None
    out: dict[str, Any] = {name: report.fields.get(name) for name in REPORT_FIELDS}
    out["received_at"] = rfc3339(report.received_at)
    out["from_ip"] = report.from_ip
    out["age_s"] = round(report_age(report, now), 1)
    out["stale"] = is_stale(report, now, stale_after)
    return out


def member_json(
    snap: EnsembleSnapshot, pub: PublishedMember, now: float, stale_after: float,
    clique: str | None = None,
) -> dict[str, Any]:
    m = pub.member
    return {
        "index": m.index,
        "slot": snap.ens.slot(m.index),
        "ip": m.ip,
        "vmi": m.vmi,
        "node": m.node,
        "phase": m.phase,
        "ready": m.ready,
        "since": rfc3339(pub.since),
        "guest": guest_json(snap.reports.get(m.index), now, stale_after),
        "clique": clique,
    }


def ensemble_json(snap: EnsembleSnapshot, now: float, stale_after: float) -> dict[str, Any]:
    """``GET /v1/ensembles/{ns}/{name}``: the whole ensemble, members in index order.

    ``clique`` is the member's ``"<cluster_uuid>.<clique_id>"`` (null: unknown); the
    problems end with the domain's membership problems (a clique split, a member whose
    nodes file differs).
    """
    spec = snap.spec
    cliques = served_cliques(snap)
    return {
        "namespace": spec.ens.namespace,
        "name": spec.ens.name,
        "domain_id": spec.ens.domain_id,
        "generation": snap.generation,
        "max_members": spec.max_members,
        "port": spec.port,
        "members": [member_json(snap, p, now, stale_after, cliques.get(p.index))
                    for p in snap.members],
        "problems": all_problems(snap, now, stale_after),
        "tls": tls_json(snap),
    }


def tls_json(snap: EnsembleSnapshot) -> dict[str, Any] | None:
    """authEncryption: the CA's fingerprints (never the CA itself); None when off.

    ``ca_bundle_sha256`` changes when a rotation starts or its overlap ends: a
    guest whose bundle differs asks for a new certificate at once.
    """
    if not snap.spec.auth_encryption:
        return None
    return {
        "auth_encryption": True,
        "ca_sha256": snap.ca.sha256 if snap.ca is not None else None,
        "ca_bundle_sha256": snap.ca.bundle_sha256 if snap.ca is not None else None,
    }


def all_problems(snap: EnsembleSnapshot, now: float, stale_after: float) -> list[str]:
    """The reconciler's problems, then the domain's membership problems, then an NVLink
    clique another ensemble reports too (state/shared.py: informational)."""
    extra = membership_problems(aggregate(snap, now, stale_after)) if snap.reports else []
    return [*snap.problems, *extra, *shared_messages(snap)]


def summary_json(snap: EnsembleSnapshot) -> dict[str, Any]:
    """One item of ``GET /v1/ensembles``: ``members`` and ``ready`` are counts."""
    return {
        "namespace": snap.ens.namespace,
        "name": snap.ens.name,
        "generation": snap.generation,
        "members": len(snap.members),
        "ready": sum(1 for p in snap.members if p.member.ready),
    }


def list_json(snaps: list[EnsembleSnapshot]) -> dict[str, Any]:
    return {"items": [summary_json(s) for s in snaps]}


def format_age(seconds: float) -> str:
    """``4s``, ``3m07s``, ``2h05m``, ``3d04h``: short, for a table cell."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


_COLUMNS = ("INDEX", "SLOT", "IP", "VMI", "NODE", "PHASE", "READY", "IMEX", "REPORTED")


def ensemble_table(snap: EnsembleSnapshot, now: float, stale_after: float) -> str:
    """``?format=table``: a header line, one row per published member, then gaps and problems.

    REPORTED is the age of the member's last report, ``STALE`` appended when
    it is older than ``stale_after``; ``-`` when the guest never reported.
    """
    spec = snap.spec
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for pub in snap.members:
        m = pub.member
        report = snap.reports.get(m.index)
        if report is None:
            imex, reported = "-", "-"
        else:
            imex = _cell(report.fields.get("imex_state"))
            reported = format_age(report_age(report, now)) + " ago"
            if is_stale(report, now, stale_after):
                reported += " STALE"
        rows.append(
            (
                str(m.index),
                snap.ens.slot(m.index),
                m.ip,
                _cell(m.vmi),
                _cell(m.node),
                _cell(m.phase),
                _cell(m.ready),
                imex,
                reported,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(_COLUMNS))]
    lines = [
        f"ensemble {spec.ens.key}  domain {spec.ens.domain_id}  generation {snap.generation}  "
        f"max-members {spec.max_members}  port {spec.port}",
        "",
    ]
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    published = {p.member.index for p in snap.members}
    absent = [str(i) for i in range(spec.max_members) if i not in published]
    lines.append("")
    lines.append(f"{len(published)} of {spec.max_members} slots published")
    if absent:
        lines.append(f"absent (pinned to {ABSENT_IP}): " + ", ".join(absent))
    problems = all_problems(snap, now, stale_after)
    if problems:
        lines.append("problems:")
        lines += [f"  - {p}" for p in problems]
    return "\n".join(lines) + "\n"


def nodes_config(snap: EnsembleSnapshot, mode: Mode = "names") -> bytes:
    """The ``nodes_config.cfg`` a guest of this ensemble writes (raises ModelError)."""
    return render_nodes_config(snap.ens, snap.spec.max_members, mode, snap.pins())


def hosts(snap: EnsembleSnapshot, member: int | None = None) -> bytes:
    """The managed ``/etc/hosts`` block a guest writes (merged into an empty file).

    ``member``: the block that member writes, where the ensemble spans NVLink cliques
    (members of other cliques at 127.0.0.2; ``imex_shared.cliques``, the guest's rule).
    """
    pins = snap.pins()
    if member is not None:
        pins = pins_for(pins, dict(snap.cliques), member)
    return merge_hosts(b"", snap.ens, snap.spec.max_members, pins)
