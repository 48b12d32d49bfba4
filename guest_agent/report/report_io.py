"""Report this guest's IMEX status to the registry (``PUT .../members/{index}/status``).

Concurrency and failure rules:

- ``submit`` only stores the latest report and sets an event; it never
  awaits, so discovery and applying never wait on the registry.
- ``run`` is one task: it sends the latest report, retrying transient
  failures (connect errors, timeouts, 5xx, 408, 429) with exponential
  backoff and jitter (tenacity). A newer report cuts the retry short: the
  stale one is dropped and the newer one sent at once, so at most one
  request is in flight and the registry always ends with the latest state.
  News waits ``REPORT_SETTLE`` (0.75 s) before it is sent, so a change, the IMEX
  signal it sets off and the domain view taken after it go in one PUT.
- 401/403/404/409/422 are not retried (a wrong token or address will not fix
  itself by repetition); each distinct refusal is logged once (then at debug level)
  and recorded as ``last_error``. The next report tries again.
- Version skew (docs/install.md "Upgrades"): after its first delivered report (never
  in the way of one) the reporter asks the host agent's ``GET /version``, at most once
  a minute until it answers, and says once what it makes of it
  (``imex_shared.version.host_verdict``; a 404 is a 0.1 host agent). A field an older
  registry refuses as unknown (its 422 says "Extra inputs are not permitted") is left
  out and the report sent again at once; the field is tried again after
  ``FIELD_RETRY`` (10 min), and said once. Whatever the host says of itself, reports go.
- ``https://``: every request is checked against the pinned registry CA
  (guest_agent/registry_trust.py) before the token is written; the ``registry``
  section of status.json shows the transport, the pin, the server certificate last
  seen and the host agent's version.
- The bearer token is read from ``token_file`` for every send, so a rotated
  Secret is picked up without a restart.
- Every PUT carries ``sent`` (this boot's id and ``CLOCK_BOOTTIME``, taken for each
  attempt): a request that timed out here may still be handled by a stopped replica
  after the report that replaced it, and the registry orders a member's reports by
  this stamp, not by when it handled them (a 409 answers such a late one).
- ``imex_domain`` (the member's own entry of the view, ~1.3 KB at 18 nodes) goes
  only when the registry needs it (``guest_agent.report.report.send_domain``); the
  registry's answer says whether it was accepted (a replica that is shutting down
  does not count), and an answer with ``"domain_needed": true`` to a report that left
  the view out sends the same report again at once, with the view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception,
    stop_never,
    wait_exponential,
    wait_random,
)

from guest_agent import http
from guest_agent.config import Settings
from guest_agent.registry_trust import RegistryTrust, trust_for
from guest_agent.report.collect import KICK_SETTLE
from guest_agent.report.report import (
    FIELD_RETRY,
    DomainAccepted,
    Report,
    domain_key,
    domain_refresh,
    left_out,
    refused_fields,
    send_domain,
    status_url,
)
from imex_shared.imex_domain import own_entry
from imex_shared.version import BAD, GUEST_TOO_OLD, OLDER_HOST, TOO_OLD, host_verdict

log = logging.getLogger("guest_agent.reporter")  # logger name pinned

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})

#: How long the reporter lets news settle before it sends (s). An applied change, the
#: SIGUSR1 it sets off (milliseconds later) and the domain collector's kicked pass
#: (``KICK_SETTLE`` after it, plus one ``nvidia-imex-ctl -N -j``) each bring a new
#: report; waiting for the last of them sends one PUT per change instead of two or
#: three. It also keeps the PUTs out of the moments after a change, when every guest of
#: the ensemble is rewriting its files on a host agent that is answering all of them.
REPORT_SETTLE = KICK_SETTLE + 0.25

#: The status PUT answer header of a replica that is shutting down.
CLOSING_HEADER = "x-imex-registry"


class ReportError(RuntimeError):
    """A report could not be delivered (and will not be retried)."""


def read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ReportError(f"token_file {path}: cannot read: {exc.strerror}") from exc
    if not token:
        raise ReportError(f"token_file {path}: empty")
    return token


def not_published_yet(exc: BaseException) -> bool:
    """The registry's 404 for a member it has not published yet: every boot's first report
    can race the host agent's slice, so this is news (INFO), not an error."""
    return (isinstance(exc, http.HttpStatusError) and exc.status == 404
            and b"has no published member" in exc.body)


def asks_for_domain(resp: http.Response) -> bool:
    """The registry's ``"domain_needed": true`` (older registries never send it): it has
    no link row that a report leaving the view out could keep."""
    try:
        doc = resp.json()
    except http.HttpJsonError:
        return False
    return isinstance(doc, dict) and doc.get("domain_needed") is True


def lists_itself(report: Report) -> bool:
    """Whether the report's view has this member's own entry, the only part of it the
    registry keeps: resending a view without it cannot give the registry a row, so an
    answer asking for one is not followed (else every heartbeat would be sent twice)."""
    return own_entry(report.body.get("imex_domain"), report.index) is not None


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, http.HttpStatusError):
        return exc.status in RETRY_STATUSES
    return isinstance(exc, http.HttpError)


BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_stamper(path: Path = BOOT_ID_PATH) -> Callable[[], dict[str, Any] | None]:
    """The ``sent`` stamp of each PUT: this boot's id and ``CLOCK_BOOTTIME`` in ns, which
    only grows while the guest runs (across agent restarts and live migrations), so the
    registry can order a member's reports as they were sent even when an old request is
    handled late (host_agent.state.snapshot.sent_after). No readable boot id: no stamp."""
    try:
        boot_id = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        boot_id = ""
    if not boot_id:
        return lambda: None
    return lambda: {"boot_id": boot_id,
                    "boottime_ns": time.clock_gettime_ns(time.CLOCK_BOOTTIME)}


class _Superseded(Exception):
    """A newer report arrived while this one was being retried."""


class Reporter:
    """Latest-wins sender of status reports; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        on_error: Callable[[str | None], None] | None = None,
        max_wait: float = 30.0,
        initial_wait: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        on_registry: Callable[[dict[str, Any]], None] | None = None,
        agent_version: str = "0+unknown",
        settle: float = REPORT_SETTLE,
        stamp: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        self.settings = settings
        self.settle = settle
        self.stamp = stamp if stamp is not None else boot_stamper()
        self.on_error = on_error
        self.on_registry = on_registry
        self.agent_version = agent_version
        self.trust: RegistryTrust | None = (
            trust_for(settings.registry_url, settings.registry_ca_sha256)
            if settings.registry_url else None)
        #: fields the registry refused as unknown -> when (``clock``)
        self.dropped: dict[str, float] = {}
        #: what the host agent's /version said: {"version", "skew", "note"}; None: not asked
        self.host: dict[str, Any] | None = None
        self._said: set[str] = set()
        self._host_asked_at = -1e9
        self._registry_doc: dict[str, Any] | None = None
        self.max_wait = max_wait
        self.initial_wait = initial_wait
        self.clock = clock
        #: the view the registry last accepted; None: send it with the next report
        self.domain_accepted: DomainAccepted | None = None
        self.domain_sent = 0
        self.domain_left_out = 0
        #: answers that asked for a view the report had left out (``domain_needed``)
        self.domain_asked = 0
        self._resend = False
        self._latest: Report | None = None
        self._sent: Report | None = None
        self._news = asyncio.Event()
        self.delivered = 0
        self.failures = 0

    def submit(self, index: int, body: dict[str, Any], force: bool = False) -> None:
        """Store the latest report; ``force``: send it even if equal to the last one sent
        (the periodic heartbeat that keeps the registry's copy fresh)."""
        report = Report(index, dict(body))
        if report == self._latest and not force:
            return
        if force:
            self._sent = None
        self._latest = report
        self._news.set()

    async def _sleep(self, seconds: float) -> None:
        """tenacity's sleep, cut short by a newer report."""
        try:
            await asyncio.wait_for(self._news.wait(), seconds)
        except TimeoutError:
            return
        raise _Superseded

    def wire_body(self, report: Report) -> tuple[dict[str, Any], str | None]:
        """The body to PUT, and the key of the domain view it carries (None: left out)."""
        body = dict(report.body)
        # 0.2: the registry CA this guest pins (null: plain HTTP); a 0.1 registry refuses
        # it, and it is left out there (module docstring)
        body["registry_ca_sha256"] = self.settings.registry_ca_sha256
        # 0.2: stamped for each attempt, so a retry is ordered after what it replaces
        sent = self.stamp()
        if sent is not None:
            body["sent"] = sent
        for name in left_out(self.dropped, self.clock()):
            body.pop(name, None)
        if "imex_domain" not in body:
            return body, None
        key = domain_key(body["imex_domain"])
        refresh = domain_refresh(self.settings.report_interval)
        if send_domain(key, self.domain_accepted, self.clock(), refresh):
            return body, key
        return {k: v for k, v in body.items() if k != "imex_domain"}, None

    def _say_once(self, level: int, message: str) -> None:
        if message in self._said:
            log.debug("%s", message)
            return
        if len(self._said) < 256:
            self._said.add(message)
        log.log(level, "%s", message)

    async def check_host(self) -> None:
        """Ask the host agent's ``/version`` once and say what this guest makes of it."""
        assert self.settings.registry_url is not None and self.trust is not None
        try:
            resp = await http.request(
                "GET", f"{self.settings.registry_url}/version", read_timeout=5.0,
                connect_timeout=min(5.0, self.settings.dns_timeout * 2),
                ssl_context=await self.trust.context(), max_body=4096)
        except http.HttpError as exc:
            log.debug("host agent version not known yet: %s", exc)
            return  # asked again before the next report
        doc: object = None
        if resp.status != 404:
            try:
                doc = resp.json() if resp.status == 200 else {"status": resp.status}
            except http.HttpJsonError as exc:
                doc = str(exc)
        verdict, note = host_verdict(doc, self.agent_version)
        host = doc.get("version") if isinstance(doc, dict) else None
        self.host = {"version": host if isinstance(host, str) else None, "skew": verdict,
                     "note": note}
        level = {OLDER_HOST: logging.WARNING, TOO_OLD: logging.ERROR,
                 GUEST_TOO_OLD: logging.ERROR, BAD: logging.ERROR}.get(verdict, logging.INFO)
        self._say_once(level, f"registry: {note}")
        if level == logging.ERROR and self.on_error is not None:
            self.on_error(f"registry: {note}")
        self._publish_registry()

    def _publish_registry(self) -> None:
        if self.on_registry is None or self.trust is None:
            return
        doc = {"url": self.settings.registry_url, **self.trust.describe(),
               "host": self.host, "refused_fields": sorted(self.dropped)}
        if doc != self._registry_doc:
            self._registry_doc = doc
            self.on_registry(doc)

    async def _put(self, report: Report) -> tuple[http.Response, str | None]:
        """The PUT; a body field the registry refuses as unknown is left out and the
        report sent again at once (module docstring)."""
        assert self.trust is not None
        for _ in range(2):
            body, key = self.wire_body(report)
            token = read_token(self.settings.token_file)
            try:
                resp = await http.json_request(
                    "PUT",
                    status_url(self.settings, report.index),
                    body,
                    token=token,
                    connect_timeout=min(5.0, self.settings.dns_timeout * 2),
                    read_timeout=10.0,
                    ssl_context=await self.trust.context(),
                )
            except http.HttpStatusError as exc:
                refused = refused_fields(exc.body) & set(body) if exc.status == 422 else set()
                if not refused:
                    raise
                now = self.clock()
                for name in sorted(refused):
                    self.dropped[name] = now
                    self._say_once(logging.WARNING, (
                        f"registry refuses report field {name!r} (a host agent older than "
                        f"this guest): reports go without it, and it is tried again every "
                        f"{FIELD_RETRY:.0f} s"))
                self._publish_registry()
                continue
            self.trust.observe(resp)
            return resp, key
        raise ReportError("the registry kept refusing report fields as unknown")

    async def send(self, report: Report) -> None:
        """One PUT (raises http.HttpError / ReportError); remembers what was accepted."""
        sent_at = self.clock()
        try:
            resp, key = await self._put(report)
        except BaseException:
            self.domain_accepted = None  # whatever happened, the next report carries it
            raise
        self._publish_registry()
        if key is not None:
            self.domain_sent += 1
        elif "imex_domain" in report.body:
            self.domain_left_out += 1
        closing = resp.headers.get(CLOSING_HEADER, "").strip().lower() == "closing"
        if resp.status != 200 or closing:
            self.domain_accepted = None  # another replica answers next: tell it again
        elif key is not None:
            self.domain_accepted = DomainAccepted(key, sent_at)
        elif lists_itself(report) and asks_for_domain(resp):
            # left out as unchanged, but the registry holds no row from this VM (it moved,
            # or this replica never saw the view): send it now, not at the minute's refresh
            self.domain_accepted = None
            self.domain_asked += 1
            self._resend = True

    async def _deliver(self, report: Report) -> None:
        retrying = AsyncRetrying(
            retry=retry_if_exception(_transient),
            wait=wait_exponential(multiplier=self.initial_wait, max=self.max_wait)
            + wait_random(0, self.initial_wait),
            stop=stop_never,
            sleep=self._sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                try:
                    await self.send(report)
                except http.HttpError as exc:
                    self.failures += 1
                    if not not_published_yet(exc):
                        self._say_once(logging.WARNING, f"status report failed: {exc}")
                        if self.on_error is not None:
                            self.on_error(f"status report: {exc}")
                    raise

    async def run(self) -> None:
        """Forever: wait for a report, deliver the latest one."""
        if self.settings.registry_url is None:
            await asyncio.Event().wait()
        while True:
            await self._news.wait()
            if self.settle > 0:
                await asyncio.sleep(self.settle)  # one PUT for a change and what it set off
            self._news.clear()
            report = self._latest
            if report is None or report == self._sent:
                continue
            try:
                await self._deliver(report)
            except _Superseded:
                continue
            except (http.HttpError, ReportError, RetryError) as exc:
                if not isinstance(exc, http.HttpError):  # HTTP failures counted per attempt
                    self.failures += 1
                if not_published_yet(exc):
                    self._say_once(logging.INFO, (
                        f"status report waits for this member's publication ({exc}); "
                        "the next view or heartbeat sends it again"))
                    continue
                self._say_once(logging.ERROR, f"status report not delivered: {exc}")
                if self.on_error is not None:
                    self.on_error(f"status report: {exc}")
                continue
            self._sent = report
            self.delivered += 1
            if self._resend:  # at most once per answer that asked: the resend carries it
                self._resend = False
                self._sent = None
                self._news.set()
            log.debug("status report delivered", extra={"index": report.index})
            if self.host is None and self.clock() - self._host_asked_at >= 60.0:
                # after a delivered report, never before one: a slow /version must not
                # hold up what the registry needs first
                self._host_asked_at = self.clock()
                await self.check_host()
