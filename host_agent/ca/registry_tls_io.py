"""Where the registry's certificate comes from, over time: the Secret, or files (I/O).

Two sources, one contract: ``run(on_change)`` calls ``on_change(material)`` with the
first usable :class:`~host_agent.ca.registry_tls.Material` and again whenever it changes
(a renewal, a rotation by cert-manager, a replaced Secret), and never returns. A source
that cannot produce material says why in the log, once per distinct reason, and keeps
trying; what was served stays served. What the material is and when it is renewed is
registry_tls.py (pure).

* :class:`SelfIssuedSource` (``--tls-self-issued``): the Secret ``imex-registry-tls`` in
  the agent's namespace (the same Role as the CA Secrets: get, create, update, nothing
  else). Only the leader creates it or renews the serving certificate, each write
  behind ``gate.ensure()``, an update carrying the resourceVersion it read; every
  replica reads it every ``recheck`` seconds and serves what it holds. A Secret that
  does not parse is never replaced (the guests pin its CA): it is reported until fixed.
* :class:`FileSource` (``--tls-cert-file``, ``--tls-private-key-file``, optional CA):
  the files' identity (inode, size, mtime: a kubelet Secret update swaps a symlink) is
  looked at every ``interval`` seconds and the files re-read when it changes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from host_agent.ca.secret_io import SecretApi
from host_agent.kube.leadership import WriteGate

if TYPE_CHECKING:
    from host_agent.ca.registry_tls import Material, Names, SelfIssued

log = logging.getLogger("imex.host.tls")

OnChange = Callable[["Material"], None]


class TlsSource(Protocol):
    async def run(self, on_change: OnChange) -> None: ...


class _Said:
    """Each distinct problem logged once (then at debug), until things are well again."""

    def __init__(self) -> None:
        self.last: str | None = None

    def problem(self, message: str, level: int = logging.ERROR) -> None:
        log.log(logging.DEBUG if message == self.last else level, "%s", message)
        self.last = message

    def ok(self) -> None:
        self.last = None


class SelfIssuedSource:
    """The registry CA and serving certificate in their Secret (module docstring)."""

    def __init__(self, api: SecretApi, namespace: str, gate: WriteGate, names: Names, *,
                 lifetime: dt.timedelta, recheck: float = 30.0,
                 clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.api = api
        self.namespace = namespace
        self.gate = gate
        self.names = names
        self.lifetime = lifetime
        self.recheck = recheck
        self.clock = clock
        self.current: SelfIssued | None = None
        self._said = _Said()

    @property
    def where(self) -> str:
        from host_agent.ca.registry_tls import SECRET_NAME

        return f"Secret {self.namespace}/{SECRET_NAME}"

    async def step(self) -> float:
        """One look at the Secret (create or renew it when leading); seconds to the next."""
        from host_agent.ca import registry_tls as rt

        obj = await self.api.get_secret(self.namespace, rt.SECRET_NAME)
        now = self.clock()
        rv = obj.get("metadata", {}).get("resourceVersion") if obj is not None else None
        if obj is None:
            if not self.gate.may_write():
                self._said.problem(f"registry TLS: {self.where} does not exist yet; the "
                                   "leader creates it (HTTPS waits for it)", logging.INFO)
                return min(self.recheck, 2.0)
            tls = rt.first(self.namespace, self.names, now, self.lifetime)
            self.gate.ensure()
            await self.api.create_secret(rt.secret_body(tls, self.namespace))
            log.info("registry TLS: created the registry CA %s and a serving certificate for "
                     "%s in %s", tls.ca.sha256[:16], ", ".join(self.names.dns + self.names.ips),
                     self.where, extra={"registry_ca_sha256": tls.ca.sha256})
        else:
            try:
                tls = rt.parse(obj, now)
            except rt.RegistryTlsError as exc:
                self._said.problem(f"registry TLS: {exc}; not replacing it (guests pin its "
                                   "CA): fix the Secret, or delete it to start a new registry "
                                   "CA (guests then need the new registryCASHA256)")
                return self.recheck
            reason = rt.renewal_due(tls, self.names, now)
            if reason is not None and self.gate.may_write():
                tls = rt.renew(tls, self.names, now, self.lifetime)
                self.gate.ensure()
                await self.api.replace_secret(rt.secret_body(tls, self.namespace,
                                                             rv if isinstance(rv, str) else None))
                log.info("registry TLS: renewed the serving certificate (%s): not after %s",
                         reason, f"{tls.cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}")
        self._said.ok()
        self.current = tls
        until = (rt.renew_at(tls.cert) - now).total_seconds()
        return max(0.05, min(self.recheck, until))

    async def run(self, on_change: OnChange) -> None:
        served: str | None = None
        while True:
            try:
                wait = await self.step()
            except Exception as exc:  # the API, a conflict with another replica's write
                self._said.problem(f"registry TLS: {self.where}: {type(exc).__name__}: {exc}")
                wait = min(self.recheck, 5.0)
            if self.current is not None:
                material = self.current.material()
                if material.cert_sha256 != served:
                    served = material.cert_sha256
                    on_change(material)
            await asyncio.sleep(wait)


class FileSource:
    """``--tls-cert-file``/``--tls-private-key-file`` (and a CA file), re-read on change."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str | None = None, *,
                 interval: float = 5.0,
                 clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        beside = Path(cert_file).with_name("ca.crt")
        self.ca_file = ca_file or (str(beside) if beside.exists() else None)
        self.interval = interval
        self.clock = clock
        self._said = _Said()

    def identity(self) -> tuple[object, ...]:
        out: list[object] = []
        for path in (self.cert_file, self.key_file, self.ca_file):
            try:
                st = os.stat(path) if path else None
            except OSError:
                st = None
            out.append((st.st_ino, st.st_size, st.st_mtime_ns) if st else None)
        return tuple(out)

    def read(self) -> Material:
        from host_agent.ca.registry_tls import RegistryTlsError, material_from_files

        what = f"--tls-cert-file {self.cert_file}"
        try:
            chain = Path(self.cert_file).read_bytes()
            key = Path(self.key_file).read_bytes()
            ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        except OSError as exc:
            raise RegistryTlsError(f"{what}: cannot read {exc.filename}: {exc.strerror}") \
                from exc
        return material_from_files(chain, key, ca, self.clock(), what)

    async def run(self, on_change: OnChange) -> None:
        from host_agent.ca.registry_tls import RegistryTlsError

        seen: tuple[object, ...] | None = None
        served: str | None = None
        while True:
            now_id = self.identity()
            if now_id != seen:
                try:
                    material = self.read()
                except RegistryTlsError as exc:
                    self._said.problem(f"registry TLS: {exc}; serving what was loaded before")
                else:
                    seen = now_id
                    self._said.ok()
                    if material.ca_sha256 is None:
                        self._said.problem(
                            "registry TLS: no CA known for the certificate (give "
                            "--tls-ca-file, or a ca.crt beside it): guests cannot pin it")
                    if material.cert_sha256 != served:
                        served = material.cert_sha256
                        on_change(material)
            await asyncio.sleep(self.interval)
