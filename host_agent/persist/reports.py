"""Guest reports that land on any replica and are never lost: one ConfigMap per ensemble.

Why this path (docs/host-agent.md "Guest reports across replicas"): the replica that
receives a status PUT authenticates it itself (token, and the caller's address as
its own TCP peer: forwarding would change the peer, and trusting forwarded headers
from the pod network would let any pod spoof one). It then records the report in
the API itself, in an object the leader never writes: ``imex-reports-<hash>`` in
the agent's own namespace, one ``data`` key per member index. So a report cannot
overwrite the leader's membership writes (those live on the Service or the CR),
needs no hop to the leader (no inter-replica credentials, nothing lost while the
lease moves), and survives a restart of every replica. Each replica watches these
ConfigMaps and shows every report from the API within one watch event.

Writes are JSON merge patches of the members' own keys (``{"data": {"3": ...}}``), so
two replicas writing reports of different members never undo each other. For one
member, the API's last write wins; a guest sends its next report only after the
previous one was answered (or timed out), and a replica answers only after the write
landed, so the API sees one member's reports in the order the guest sent them, except
for a request that waited unhandled past the guest's timeout: that one is refused by a
replica that holds a later report (409), else written and then replaced by the later
one (``after_api_change``).

What is written (``persist_reason``, pure): a guest reports every
``report_interval`` (10 s) even when nothing changed, and a heartbeat carries no
news, so only a report with *news* against the copy in the API (as this replica's
informer shows it) is written, before its answer: a new member, different fields,
links or address (``report_content``: everything but ``received_at``), or a report
that counts for the member where the persisted one no longer does (it came before
the slot's ``since``). A heartbeat without news is answered at once and held. The
only thing other replicas take from a heartbeat is ``received_at`` (their age and
staleness), so the persisted copy is *refreshed* once it is ``refresh_after`` old
(a third of ``--report-stale-after``): a follower then sees a live member's copy at
most ``refresh_after + report_interval`` (+ the write's 5 s) old, under
``stale_after`` with room for a whole failed refresh, and a member that went silent
is stale on every replica at most ``stale_after`` after its last report (a follower
up to ``refresh_after`` earlier than the receiving replica, never later). Every
write of an ensemble also carries the held heartbeats of its other members
(``riders``: same content as their persisted copy, newer), so an ensemble's members
refresh together in one write rather than in 18.

A replica judges news against its informer's copy, which may lag: a later report
can then be held while an older one lands in the API over it. When the informer
shows such a copy, the replica that holds the later report writes it back
(``after_api_change``), so the API and every replica end with a member's latest
report whichever replica received it. "Later" is the order the guest sent them in
(each report carries the guest's ``sent`` stamp, persisted with it), not the order
replicas handled them: a request that waited on a stopped replica is handled after
the report that replaced it.

Budget: per ensemble and replica at most one write per ``interval`` (0.5 s): the
first report is written at once, reports arriving while a write is in flight or
within the interval wait together and are all answered by the next one. So no
report waits more than ``interval`` plus one write for its answer (issue 27: a boot
storm of 20 ensembles x 18 guests answered with p99 <= 1 s; at 1 s a report that
just missed a write waited a whole second, and an answer later than a second spread
the storm's status writes over more seconds). A boot storm of 18 guests reporting to
one replica within a second costs 3 writes; a quiet ensemble costs one write per
``refresh_after - report_interval`` or so (30 s at the defaults, was ~1 a second:
docs/benchmarks.md "Report writes").

What each replica takes from its own clock: ``received_at`` is the receiving
replica's wall clock (persisted with the report); ``age_s`` and ``stale`` are
computed by the serving replica from its own clock, so with skewed clocks two
replicas may show ages that differ by the skew (and a refresh comes up to the skew
early or late).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

from host_agent.state.snapshot import GuestReport, sent_after
from imex_shared.model import EnsembleId, is_decimal

REPORTS_LABEL: Final = "imex-ensemble.io/reports"
ENSEMBLE_ANNOTATION: Final = "imex-ensemble.io/ensemble"
FIELD_MANAGER: Final = "imex-host-agent-reports"


def configmap_name(ens: EnsembleId) -> str:
    """``imex-reports-<first 16 hex of sha256("ns/name")>``: one per ensemble, any length."""
    return "imex-reports-" + hashlib.sha256(ens.key.encode()).hexdigest()[:16]


def encode_report(report: GuestReport) -> str:
    doc: dict[str, object] = {"fields": dict(report.fields), "received_at": report.received_at,
                              "from_ip": report.from_ip}
    if report.links is not None:  # the member's own -N -j row, reduced (issue 17)
        doc["links"] = list(report.links)
    if report.sent is not None:  # the guest's stamp: orders one member's reports
        doc["sent"] = list(report.sent)
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def _sent(value: object) -> tuple[str, int] | None:
    """A persisted ``[boot_id, boottime_ns]``; anything else: none (ordered by receipt)."""
    if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and 0 < len(value[0]) <= 64 and type(value[1]) is int and value[1] >= 0):
        return value[0], value[1]
    return None


def _links(value: object) -> tuple[str | None, ...] | None:
    """A persisted link row: state words (or null) by peer index; anything else: none."""
    if not isinstance(value, list) or len(value) > 1000:
        return None
    if not all(v is None or (isinstance(v, str) and 0 < len(v) <= 32) for v in value):
        return None
    return tuple(sys.intern(v) if isinstance(v, str) else None for v in value)


def decode_report(text: object) -> GuestReport | None:
    if not isinstance(text, str):
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, Mapping):
        return None
    fields, at, ip = doc.get("fields"), doc.get("received_at"), doc.get("from_ip")
    if not isinstance(fields, Mapping) or not isinstance(at, int | float) or not isinstance(
            ip, str):
        return None
    return GuestReport(float(at), ip, dict(fields), _links(doc.get("links")),
                       _sent(doc.get("sent")))


def reports_of(obj: Mapping[str, Any]) -> tuple[EnsembleId | None, dict[int, GuestReport]]:
    """(the ensemble, index -> report) of one reports ConfigMap; junk keys are skipped."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), Mapping) else {}
    assert isinstance(annotations, Mapping)
    key = annotations.get(ENSEMBLE_ANNOTATION)
    ens: EnsembleId | None = None
    if isinstance(key, str) and key.count("/") == 1:
        try:
            ens = EnsembleId(*key.split("/"))
        except Exception:
            ens = None
    if ens is not None and meta.get("name") != configmap_name(ens):
        ens = None  # not the one this ensemble's reports go to
    data = obj.get("data") if isinstance(obj.get("data"), Mapping) else {}
    assert isinstance(data, Mapping)
    out: dict[int, GuestReport] = {}
    for k, v in data.items():
        if is_decimal(k):
            report = decode_report(v)
            if report is not None:
                out[int(k)] = report
    return ens, out


#: The persisted copy of a member's report is refreshed once it is this part of
#: ``--report-stale-after`` old: a follower's worst age for a live member is then
#: ``refresh_after + report_interval`` + one write, and even a whole refresh lost
#: (the API down for one period) keeps it under ``stale_after`` while
#: ``report_interval < stale_after / 3`` (module docstring).
REFRESH_FRACTION: Final = 1 / 3


def report_content(report: GuestReport) -> str:
    """Everything of a report anyone derives something from, canonical: all but
    ``received_at`` (the views, /domain, the status and the UI read its fields, its
    link row, and its address through ``report_applies``)."""
    links = list(report.links) if report.links is not None else None
    return json.dumps([report.from_ip, report.fields, links], separators=(",", ":"),
                      sort_keys=True, default=str)


def persist_reason(report: GuestReport, persisted: GuestReport | None, *, since: float,
                   refresh_after: float) -> str | None:
    """Why ``report`` must be in the API before its answer, or None: a heartbeat.

    ``persisted``: the member's copy in the API as this replica sees it; ``since``:
    when the slot got its current address (a report before it does not count).
    ``refresh_after <= 0`` writes every report (the behaviour before heartbeats were
    told apart; the benchmark's baseline).
    """
    if persisted is None:
        return "new"
    if report_content(report) != report_content(persisted):
        return "changed"
    if persisted.received_at < since <= report.received_at:
        return "counts"  # the persisted one is from before the member's address
    if report.received_at - persisted.received_at >= refresh_after:
        return "refresh"
    return None


def riders(held: Mapping[int, GuestReport], persisted: Mapping[int, GuestReport]
           ) -> dict[int, GuestReport]:
    """The held heartbeats that may ride along a write of their ensemble: the same
    content as their persisted copy and newer, so writing one only moves its
    ``received_at`` on, as far as this replica's informer knows (a copy it has not
    seen yet may be newer: then the replica holding that one writes it back,
    ``after_api_change``)."""
    out: dict[int, GuestReport] = {}
    for index, report in held.items():
        before = persisted.get(index)
        if (before is not None and sent_after(report, before)
                and report_content(report) == report_content(before)):
            out[index] = report
    return out


#: What a replica does when a member's copy in the API changed (``after_api_change``).
ADOPT: Final = "adopt"
KEEP: Final = "keep"
WRITE_BACK: Final = "write back"


def after_api_change(persisted: GuestReport, shown: GuestReport | None) -> str:
    """What a replica does when the member's copy in the API changed to ``persisted``,
    given the report it shows: ``ADOPT`` it (nothing shown, or the copy is as recent);
    ``KEEP`` the shown one, a later heartbeat of the same content (held here, not
    written); or ``WRITE_BACK`` the shown one: it is later and says something else.

    How an older copy lands after a later report: a guest's reports go to whichever
    replica the Service picks. One replica writes the guest's news (a link down); the
    next report (the link back) reaches a replica whose informer has not shown that
    write yet, which judges it a heartbeat of the copy it knows and holds it. The
    news then lands in its informer, older than the report it holds. A rider (a held
    heartbeat judged against a lagging copy) can land over a newer report the same
    way. The later report is the guest's state; the guest leaves an unchanged link
    row out of its reports for up to a minute, so nothing else would correct it.

    "Later" is as the guest sent them (``sent_after``: its own stamps). Not by
    ``received_at``: a guest that timed out on a replica sends its next report to
    another, and the first replica may handle the old request later still (it was
    stopped or starved), stamping it later than the report that replaced it. Reports
    without stamps (guests before 0.2) are ordered by ``received_at``: a guest sends its
    next report after the previous one was answered or timed out, so that order holds
    while no request waits unhandled past the guest's timeout."""
    if shown is None or not sent_after(shown, persisted):
        return ADOPT
    if report_content(shown) == report_content(persisted):
        return KEEP
    return WRITE_BACK


class PersistedReports:
    """What the reports ConfigMaps say, as the informer shows them: ensemble -> index -> report.

    ``changed(old, new)`` is the informer's handler; it hands each report whose
    persisted value changed to ``apply(ens, index, report)`` (the State), and the
    reconciler asks ``of(ens)`` when an ensemble (re)appears.
    """

    def __init__(self, apply: Callable[[EnsembleId, int, GuestReport], None]) -> None:
        self._apply = apply
        self._by_ens: dict[EnsembleId, dict[int, GuestReport]] = {}

    def of(self, ens: EnsembleId) -> Mapping[int, GuestReport]:
        return self._by_ens.get(ens, {})

    def changed(self, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> None:
        before_ens, before = reports_of(old) if old is not None else (None, {})
        if new is None:
            if before_ens is not None:
                self._by_ens.pop(before_ens, None)
            return
        ens, now = reports_of(new)
        if ens is None:
            return
        self._by_ens[ens] = now
        for index, report in now.items():
            if before.get(index) != report:
                self._apply(ens, index, report)


def report_applies(report: GuestReport, ip: str, addresses: frozenset[str]) -> bool:
    """A persisted report belongs to the member as it is now: it came from one of the
    addresses its VMI has (a VM that came back with a new IP starts without one)."""
    return report.from_ip == ip or report.from_ip in addresses
