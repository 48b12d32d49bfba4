"""The agent's side of IMEX's credentials: the task that asks for certificates, and backoff.

Crypto-free on purpose: every key, CSR and certificate check runs in a short-lived
child, ``python -m guest_agent.tls`` (``inspect`` once at start, ``request`` for each
certificate), so ``cryptography`` (about 13 MB of RSS, measured in the guest
footprint; docs/guest-agent.md) is never resident in the daemon, which stays
inside its 40 MB budget. The child writes the files with the safe writer and
answers one JSON line: the certificate's names and validity, the bundle digest,
whether a CA was newly pinned; the trust rules are in guest_agent/tls/creds.py.

When to ask is guest_agent/tls/keeper.py (pure: ``renewal_due``, ``renew_at``). A
failed request keeps the current files and is retried with exponential backoff and
jitter (2 s doubling to 5 min). ``on_renewed`` tells the agent the files changed; the
IMEX supervisor then sends one SIGUSR1, in the same window as membership signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import logging
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from guest_agent.files.safewrite import read_bytes
from guest_agent.tls.imex_config import CA_FILE, CERT_FILE, PIN_FILE
from guest_agent.tls.keeper import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    CertFacts,
    KeeperError,
    TlsStatus,
    expiring,
    iso,
    renew_at,
    renewal_due,
    retry_delay,
)

log = logging.getLogger("guest_agent.certkeeper")  # logger name pinned

#: a child that takes longer than this is killed (a request has a 10 s HTTP timeout)
CHILD_TIMEOUT: Final = 60.0


def read_pins(tls_dir: Path, configured: str | None) -> list[str]:
    """The pinned fingerprints: the user-data's and the one pinned after a rotation."""
    pins = [configured.lower()] if configured else []
    raw = read_bytes(tls_dir / PIN_FILE)
    if raw is not None:
        text = raw.decode("ascii", "replace").strip().lower()
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text) and text not in pins:
            pins.append(text)
    return pins


async def run_child(argv: Sequence[str], timeout: float = CHILD_TIMEOUT) -> dict[str, Any]:
    """Run the TLS child; its JSON answer, or KeeperError."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        raise KeeperError(f"cannot run the TLS helper: {exc.strerror}") from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    try:
        doc = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = err.decode("utf-8", "replace").strip()[-300:]
        raise KeeperError(f"the TLS helper failed (exit {proc.returncode}): {tail}") from None
    if not isinstance(doc, dict):
        raise KeeperError("the TLS helper answered something that is not an object")
    if not doc.get("ok"):
        status = doc.get("http_status")
        raise KeeperError(str(doc.get("error") or "the TLS helper failed"),
                          bool(doc.get("refused")),
                          status if isinstance(status, int) else None)
    return doc


class CertKeeper:
    """One task: get the first certificate, then renew it; see the module docstring."""

    def __init__(
        self,
        *,
        tls_dir: str,
        ca_sha256: str | None,
        url_for: Callable[[int], str],
        token_file: str | None,
        on_renewed: Callable[[], None],
        on_status: Callable[[TlsStatus], None] | None = None,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        python: str = sys.executable,
        timeout: float = 10.0,
        registry_ca_sha256: str | None = None,
    ) -> None:
        #: the pinned registry CA, handed to the child for an https registry
        self.registry_ca_sha256 = registry_ca_sha256
        self.dir = Path(tls_dir)
        self.configured_pin = ca_sha256
        self.url_for = url_for
        self.token_file = token_file
        self.on_renewed = on_renewed
        self.on_status = on_status
        self.clock = clock
        self.python = python
        self.timeout = timeout
        self.cert: CertFacts | None = None
        #: when the current certificate was obtained (its file's mtime after a restart)
        self.obtained: dt.datetime | None = None
        self.status = TlsStatus()
        self.index: int | None = None
        self.slot: str | None = None
        self.registry_bundle: str | None = None
        self._news = asyncio.Event()
        self.ready = asyncio.Event()
        self.started = False

    def _argv(self, command: str, *extra: str) -> list[str]:
        pins = [a for p in read_pins(self.dir, self.configured_pin) for a in ("--pin", p)]
        return [self.python, "-m", "guest_agent.tls", command, "--tls-dir", str(self.dir),
                *pins, *extra]

    async def start(self) -> None:
        """Make the key if there is none and learn what the certificate on disk says."""
        doc = await run_child(self._argv("inspect"))
        self.started = True
        if doc.get("cert") is not None:
            self.cert = CertFacts.of(doc["cert"])
            mtime = (self.dir / CERT_FILE).stat().st_mtime
            self.obtained = dt.datetime.fromtimestamp(mtime, dt.UTC)
            if doc.get("ca") and self.cert.not_after > self.clock():
                self.ready.set()
        self._publish()

    # -- inputs

    def set_slot(self, index: int | None, slot: str | None) -> None:
        if (index, slot) != (self.index, self.slot):
            self.index, self.slot = index, slot
            self._news.set()

    def set_registry_bundle(self, digest: str | None) -> None:
        """The bundle digest the registry publishes; a change means renew now."""
        if digest != self.registry_bundle:
            self.registry_bundle = digest
            self._news.set()

    def creds_digest(self) -> str | None:
        """Changes whenever the files IMEX reads change (what the supervisor compares)."""
        cert, ca = read_bytes(self.dir / CERT_FILE), read_bytes(self.dir / CA_FILE)
        if cert is None or ca is None:
            return None
        return hashlib.sha256(cert + b"\0" + ca).hexdigest()

    # -- decisions

    def due(self, now: dt.datetime) -> str | None:
        """Why a request is needed now (None: not yet; :func:`renewal_due`)."""
        return renewal_due(self.cert, self.obtained, self.slot, self.index,
                           self.registry_bundle, self.status.bundle_sha256, now)

    async def request(self) -> None:
        """One certificate through the child; KeeperError when it fails or is refused."""
        assert self.slot is not None and self.index is not None
        extra = ["--url", self.url_for(self.index), "--slot", self.slot,
                 "--timeout", f"{self.timeout:g}"]
        if self.token_file:
            extra += ["--token-file", self.token_file]
        if self.registry_ca_sha256:
            extra += ["--registry-ca-sha256", self.registry_ca_sha256]
        doc = await run_child(self._argv("request", *extra))
        self.cert = CertFacts.of(doc.get("cert"))
        self.obtained = self.clock()
        self.status.bundle_sha256 = str(doc.get("bundle_sha256") or "") or None
        self.status.ca_sha256 = str(doc.get("ca_sha256") or "") or None
        self.status.renewals += 1
        self.status.last_error = None
        if doc.get("new_pin"):
            log.info("CA rotation: pinned the new CA %s (vouched for by the pinned CA)",
                     str(doc["new_pin"])[:16])
        log.info("certificate for %s renewed: not after %s, CA %s", self.slot,
                 iso(self.cert.not_after), (self.status.ca_sha256 or "?")[:16])
        self.ready.set()
        self.on_renewed()

    def _publish(self) -> None:
        s = self.status
        now = self.clock()
        if self.cert is not None:
            s.cert_not_after = iso(self.cert.not_after)
            s.renew_at = iso(renew_at(self.cert, self.obtained))
        s.expiring = expiring(self.cert, now)
        s.pinned = [p[:16] for p in read_pins(self.dir, self.configured_pin)]
        if self.on_status is not None:
            self.on_status(s)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._news.wait(), max(0.0, seconds))

    async def run(self) -> None:
        """Forever: request when due, back off on failure, sleep until due or news."""
        delay = BACKOFF_FIRST
        while not self.started:
            try:
                await self.start()
            except KeeperError as exc:
                self.status.last_error = str(exc)
                self._publish()
                log.error("%s; retrying in %.0f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
        delay = BACKOFF_FIRST
        while True:
            self._news.clear()
            now = self.clock()
            reason = self.due(now)
            if reason is None:
                self.status.waiting = None if self.slot else "own slot not known yet"
                self._publish()
                wake = ((renew_at(self.cert, self.obtained) - now).total_seconds()
                        if self.cert else 3600.0)
                await self._sleep(min(wake, 3600.0))  # the expiry warning: hourly at least
                continue
            log.info("requesting a certificate for %s: %s", self.slot, reason)
            try:
                await self.request()
            except KeeperError as exc:
                wait, delay = retry_delay(exc, delay)
                self.status.failures += 1
                self.status.waiting = f"retrying in {wait:.0f} s"
                level = logging.DEBUG if str(exc) == self.status.last_error else logging.WARNING
                self.status.last_error = str(exc)  # the same refusal again: said once
                log.log(level, "%s; keeping the current credentials, retrying in %.0f s",
                        exc, wait)
                self._publish()
                await asyncio.sleep(wait * random.uniform(0.8, 1.2))
                continue
            delay = BACKOFF_FIRST
            self._publish()
