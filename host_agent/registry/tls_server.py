"""HTTPS beside plain HTTP: the same registry app on a second listener, its certificate
reloaded in place.

:class:`TlsServing` runs one task group: the certificate source
(host_agent/ca/registry_tls_io.py) and, once the first material is in, a uvicorn server
on ``--tls-listen`` whose ``ssl.SSLContext`` this module owns. A new certificate (a
renewal, cert-manager's rotation) is loaded into that same context
(``load_cert_chain``): new handshakes present it at once, connections already open keep
theirs, and nothing is restarted, so a parked long-poll is never dropped; guests reconnect
per request and see the new certificate on their next one.

The context offers TLS 1.2 and 1.3 only (``ssl.create_default_context``'s server side).
``load_cert_chain`` reads files, so the PEM is written to a private directory (0700, key
0600) for the moment of the load and removed at once. uvicorn marks requests on this
listener ``scheme = "https"``, which the token checks read (auth.py: an ensemble with
``registryTLS: Required`` refuses its token on plain HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import tempfile
from typing import Any

import uvicorn

from host_agent.ca.registry_tls import Material
from host_agent.ca.registry_tls_io import FileSource, SelfIssuedSource, TlsSource
from host_agent.ca.secret_io import SecretApi
from host_agent.kube.leadership import WriteGate
from host_agent.settings import HostSettings

log = logging.getLogger("imex.host.tls")


def server_context(material: Material, ctx: ssl.SSLContext | None = None) -> ssl.SSLContext:
    """``ctx`` (or a new server context) with ``material``'s chain and key loaded."""
    if ctx is None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="imex-registry-tls-") as d:
        cert, key = os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")
        with open(cert, "w", encoding="ascii") as f:
            f.write(material.chain_pem)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(material.key_pem)
        ctx.load_cert_chain(cert, key)
    return ctx


class TlsServing:
    """The HTTPS listener (see the module docstring)."""

    def __init__(self, source: TlsSource, sock: socket.socket,
                 make_server: Any, config: uvicorn.Config) -> None:
        #: ``make_server(config)``: the registry's server class (it answers parked
        #: long-polls at shutdown, as the plain listener's does)
        self.source = source
        self.sock = sock
        self.make_server = make_server
        self.config = config
        self.material: Material | None = None
        self.context: ssl.SSLContext | None = None
        #: set once the first certificate is loaded
        self.loaded = asyncio.Event()
        #: set on every certificate loaded (the caller clears it)
        self.changed = asyncio.Event()
        self.server: uvicorn.Server | None = None
        self.rotations = 0
        self._stop = asyncio.Event()

    @property
    def address(self) -> tuple[str, int]:
        name = self.sock.getsockname()
        return name[0], name[1]

    def ca_pem(self) -> str | None:
        return self.material.ca_pem if self.material is not None else None

    def ca_sha256(self) -> str | None:
        return self.material.ca_sha256 if self.material is not None else None

    def on_change(self, material: Material) -> None:
        try:
            self.context = server_context(material, self.context)
        except (ssl.SSLError, OSError, ValueError) as exc:
            log.error("registry TLS: cannot load the certificate: %s; serving the previous",
                      exc)
            return
        if self.material is not None:
            self.rotations += 1
            log.info("registry TLS: serving a new certificate (not after %s); open "
                     "connections keep theirs", f"{material.not_after:%Y-%m-%dT%H:%M:%SZ}")
        self.material = material
        self.loaded.set()
        self.changed.set()

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.should_exit = True

    async def run(self) -> None:
        """Serve HTTPS until :meth:`stop` (the certificate source runs beside it)."""
        async with asyncio.TaskGroup() as tg:
            source = tg.create_task(self.source.run(self.on_change), name="registry-tls-source")
            first = tg.create_task(self.loaded.wait(), name="registry-tls-first")
            stop = tg.create_task(self._stop.wait(), name="registry-tls-stop")
            await asyncio.wait((first, stop), return_when=asyncio.FIRST_COMPLETED)
            if self.loaded.is_set() and not self._stop.is_set():
                assert self.context is not None
                self.config.load()
                self.config.ssl = self.context
                self.server = self.make_server(self.config)
                host, port = self.address
                log.info("registry serving HTTPS on %s:%d (registry CA %s)", host, port,
                         (self.ca_sha256() or "unknown")[:16])
                serve = tg.create_task(self.server.serve(sockets=[self.sock]),
                                       name="registry-https")
                await asyncio.wait((serve, stop), return_when=asyncio.FIRST_COMPLETED)
                self.server.should_exit = True
                await serve
            for task in (source, first, stop):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await source


def make_tls_source(settings: HostSettings, secrets: SecretApi, gate: WriteGate) -> TlsSource:
    """The certificate source the flags ask for (``settings.tls_enabled``)."""
    import datetime as dt

    from host_agent.ca.registry_tls import service_names

    if settings.tls_self_issued:
        names = service_names(settings.tls_service, settings.agent_namespace,
                              settings.tls_sans)
        return SelfIssuedSource(secrets, settings.agent_namespace, gate, names,
                                lifetime=dt.timedelta(seconds=settings.registry_cert_lifetime),
                                recheck=settings.tls_recheck)
    assert settings.tls_cert_file is not None and settings.tls_private_key_file is not None
    return FileSource(settings.tls_cert_file, settings.tls_private_key_file,
                      settings.tls_ca_file, interval=settings.tls_file_interval)
