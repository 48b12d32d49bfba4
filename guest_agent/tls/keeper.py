"""When the guest asks for a certificate, and what the status says about it.

Pure and crypto-free (the agent imports it; the child that handles keys is
guest_agent/tls/creds_io.py, the task that runs it guest_agent/tls/keeper_io.py).

Schedule (:func:`renewal_due`): a request when there is no certificate, when it names
another slot, when the registry's CA bundle digest differs from ours (a rotation step),
or at two thirds of the lifetime left when the certificate came (:func:`renew_at`; not
from its notBefore, which the registry backdates by 5 minutes). A failed request is
retried with exponential backoff and jitter (``BACKOFF_FIRST`` doubling to
``BACKOFF_MAX``). Expiry within 24 h is ``expiring`` in the status (:class:`TlsStatus`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Final

EXPIRY_WARNING: Final = dt.timedelta(hours=24)
BACKOFF_FIRST: Final = 2.0
BACKOFF_MAX: Final = 300.0


class KeeperError(RuntimeError):
    """The child failed or could not run; ``refused``: a bundle or certificate refused;
    ``status``: the registry's HTTP error status, if it answered one."""

    def __init__(self, message: str, refused: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.refused = refused
        self.status = status


def retry_delay(exc: KeeperError, delay: float) -> tuple[float, float]:
    """(this wait, the next one): exponential from ``BACKOFF_FIRST`` to ``BACKOFF_MAX``,
    except a 404 (a registry without the ensemble, the member or the certificate route:
    an older or misconfigured host agent), which is asked again only every
    ``BACKOFF_MAX``, never in a tight loop."""
    if exc.status == 404:
        return BACKOFF_MAX, BACKOFF_MAX
    return delay, min(delay * 2, BACKOFF_MAX)


def _parse_iso(text: object) -> dt.datetime:
    return dt.datetime.strptime(str(text), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class CertFacts:
    """What the agent knows of its certificate (from the child's answer)."""

    cn: tuple[str, ...]
    not_before: dt.datetime
    not_after: dt.datetime

    @classmethod
    def of(cls, doc: object) -> CertFacts:
        if not isinstance(doc, dict):
            raise KeeperError("the TLS child's answer has no certificate facts")
        try:
            return cls(tuple(str(c) for c in doc.get("cn") or ()),
                       _parse_iso(doc["not_before"]), _parse_iso(doc["not_after"]))
        except (KeyError, ValueError) as exc:
            raise KeeperError(f"the TLS child's certificate facts are malformed: {exc}") \
                from exc


def renew_at(facts: CertFacts, obtained: dt.datetime | None = None) -> dt.datetime:
    """Two thirds into the lifetime, counted from when we got it (see the docstring)."""
    start, end = facts.not_before, facts.not_after
    if obtained is not None:
        start = min(max(start, obtained), end)
    return start + (end - start) * 2 / 3


def expiring(facts: CertFacts | None, now: dt.datetime) -> bool:
    return facts is not None and facts.not_after - now <= EXPIRY_WARNING


@dataclass
class TlsStatus:
    """What the status file says about the credentials (``tls`` in status.json)."""

    cert_not_after: str | None = None
    renew_at: str | None = None
    ca_sha256: str | None = None
    bundle_sha256: str | None = None
    pinned: list[str] = field(default_factory=list)
    renewals: int = 0
    failures: int = 0
    expiring: bool = False
    last_error: str | None = None
    waiting: str | None = None


def renewal_due(cert: CertFacts | None, obtained: dt.datetime | None, slot: str | None,
                index: int | None, registry_bundle: str | None, our_bundle: str | None,
                now: dt.datetime) -> str | None:
    """Why a request is needed now (None: not yet); see the module docstring."""
    if slot is None or index is None:
        return None
    if cert is None:
        return "no certificate yet"
    if cert.cn != (slot,):
        return f"the certificate names {list(cert.cn)}, this guest is {slot}"
    if registry_bundle is not None and registry_bundle != our_bundle:
        return "the registry's CA bundle changed (rotation)"
    if now >= renew_at(cert, obtained):
        return "two thirds of its lifetime have passed"
    return None
