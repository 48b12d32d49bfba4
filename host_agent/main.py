"""The host agent as one asyncio program.

Task layout (one TaskGroup, every task's lifetime visible here):
  informers (VMIs, ensemble Services, our EndpointSlices, ImexEnsembles; one
  each per watched namespace) -> reconciler (workers) -> State <- registry
  HTTP server. The ImexEnsemble informer is optional: without the CRD (or
  without RBAC for it) Service-only ensembles work as before. A sidecar
  (``--vmi``) does not watch ImexEnsembles: it reads the Service, which
  carries the same settings, and never creates one. With ``--leader-elect``:
  the election loop, and a watch of its one Lease that only wakes that loop
  (optional too: without list/watch rights the loop polls).

Start: the HTTP server answers at once (/healthz 200, /readyz 503 until the
start-up checks hold, kube/preflight_io.py: its namespaces exist, its token file
reads, RBAC allows what its flags need; and until the first full picture is
reconciled); nothing is written before every informer has listed once. Stop
(SIGTERM/SIGINT set an event): parked long-polls are answered
(``state.close()``), the server drains for a few seconds, informers and
reconciler are cancelled, the client is closed. The EndpointSlices stay
as they are: a restarted agent rebuilds its state from the API and writes
nothing that is already right.

Hook sidecar (``hook_socket`` set): the KubeVirt hook server starts before
the informers (virt-launcher waits for its Info answer before it starts the
VM; the answer needs nothing from the API) and is stopped, its socket
removed, after them. virt-launcher's Shutdown hook call sets ``stop`` after
``hook_shutdown_linger`` seconds, so the agent can still see its VMI go.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib
import ipaddress
import logging
import signal
import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import uvicorn
from lightkube import AsyncClient, operators
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import ConfigMap
from prometheus_client import CollectorRegistry

from host_agent.ca.registry_tls_io import TlsSource
from host_agent.ca.secret_io import CaManager
from host_agent.ensembles.cr_spec import Declaration
from host_agent.ensembles.owned_service_io import ServiceApplier
from host_agent.ensembles.service_spec import ENSEMBLE_LABEL
from host_agent.ensembles.slices_io import SliceApplier
from host_agent.kube.cache import Store
from host_agent.kube.client import (
    ALL_NAMESPACES,
    EndpointSlice,
    ImexEnsemble,
    ListWatcher,
    Service,
    VirtualMachineInstance,
    api_call,
    count_requests,
    make_client,
    token_file,
)
from host_agent.kube.election import ElectionConfig
from host_agent.kube.election_io import KubeLeaseApi, LeaseElection
from host_agent.kube.informer import Informer
from host_agent.kube.leadership import ALWAYS, LeaseGate, WriteGate
from host_agent.kube.preflight_io import Preflight
from host_agent.kube.writers import (
    EnsembleStatusWriter,
    EventWriter,
    SecretWriter,
    ServiceWriter,
    SliceWriter,
)
from host_agent.metrics import HostMetrics
from host_agent.persist.pair_io import Pairs, ServiceAnnotationSource, StatusPairSource
from host_agent.persist.reports import (
    ADOPT,
    REFRESH_FRACTION,
    REPORTS_LABEL,
    WRITE_BACK,
    PersistedReports,
    after_api_change,
    report_applies,
)
from host_agent.persist.reports_io import ReportPersister
from host_agent.reconcile.reconcile import managed_slice_labels, new_stores
from host_agent.reconcile.reconcile_io import Reconciler
from host_agent.registry.config import CertConfig, RegistryConfig
from host_agent.registry.serving import RegistryServer, server_config
from host_agent.registry.tls_server import TlsServing, make_tls_source
from host_agent.settings import HostSettings
from host_agent.state.snapshot import GuestReport
from host_agent.state.store import State
from host_agent.status.events_io import EventRecorder
from host_agent.status.status_io import StatusWriter
from imex_shared.model import EnsembleId

if TYPE_CHECKING:
    from host_agent.sidecar.hook_io import HookServer

log = logging.getLogger("imex.host")


class _Server(RegistryServer):
    """The registry's server without uvicorn's own signal handlers (ours set ``stop``)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound here so port 0 is known before serving)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, reuse_port=False, backlog=1024)
    sock.setblocking(False)
    return sock


class HostAgent:
    """Everything one agent process holds; ``run`` drives it until ``stop`` is set."""

    def __init__(self, settings: HostSettings, client: AsyncClient | None = None) -> None:
        self.settings = settings
        self.state = State()
        self.metrics_registry = CollectorRegistry()
        self.metrics = HostMetrics(self.metrics_registry)
        self._client = client
        self.vmis, self.services, self.slices = new_stores()
        self.crs = Store("imexensemble")
        #: ImexEnsemble status and Events (None in sidecar scope, which writes neither)
        self.status: StatusWriter | None = None
        self.events: EventRecorder | None = None
        self.reconciler: Reconciler | None = None
        self.informers: list[Informer] = []
        self.address: tuple[str, int] | None = None
        self.serving = asyncio.Event()
        #: who may write (ha replaces ALWAYS with the leader election's gate)
        self.gate: WriteGate = ALWAYS
        self.cas: CaManager | None = None
        self.election: LeaseElection | None = None
        #: wakes the election loop on a release (not in ``informers``: readiness and the
        #: reconciler do not wait for it)
        self.lease_watch: Informer | None = None
        self.reports: ReportPersister | None = None
        #: the start-up checks (namespace, token file, RBAC); /readyz waits for them
        self.preflight: Preflight | None = None
        #: the registry's HTTPS listener (--tls-listen with a certificate source)
        self.tls: TlsServing | None = None
        self._tls_source: TlsSource | None = None

    def _build(self, client: AsyncClient) -> None:
        s = self.settings
        self.metrics.leader_elect.set(1 if s.leader_elect else 0)
        if s.leader_elect:
            self.election = LeaseElection(
                KubeLeaseApi(client, s.lease_namespace, s.leader_elect_name), s.identity,
                ElectionConfig(s.leader_elect_lease_duration, s.leader_elect_renew_deadline,
                               s.leader_elect_retry_period),
                metrics=self.metrics,
                on_started_leading=lambda: self.reconciler.resync_all()
                if self.reconciler is not None else None,
            )
            self.gate = LeaseGate(self.election, s.identity)
            # a release is taken within a GET and a PUT instead of the next jittered read;
            # without list/watch rights the loop polls as before (said once)
            self.lease_watch = Informer(
                "lease", ListWatcher(client, Lease, namespace=s.lease_namespace,
                                     fields={"metadata.name": s.leader_elect_name},
                                     timeout_seconds=s.watch_timeout_seconds),
                Store("lease"), self.election.lease_changed, self.metrics, s, s.lease_namespace,
                optional=True,
                absent_note=f"leader election polls the Lease every retry period instead; "
                f"grant list and watch on leases in namespace {s.lease_namespace} for a "
                f"handover within a second")
        else:
            self.metrics.set_leader(True)
        writer = SliceWriter(client, s.field_manager, self.gate)
        applier = SliceApplier(writer, self.slices.get)
        async def patch_service(namespace: str, name: str, body: dict[str, object]) -> object:
            return await api_call(client, "PATCH",
                                  f"/api/v1/namespaces/{namespace}/services/{name}",
                                  body=body, content_type="application/merge-patch+json",
                                  params={"fieldManager": s.field_manager})

        if s.tls_enabled:
            self._tls_source = make_tls_source(s, SecretWriter(client, s.field_manager),
                                               self.gate)
        self.cas = CaManager(SecretWriter(client, s.field_manager), s.agent_namespace,
                             self.gate, overlap=dt.timedelta(seconds=s.ca_overlap_seconds),
                             patch_service=patch_service)
        sidecar = s.vmi is not None
        owned = None if sidecar else ServiceApplier(
            ServiceWriter(client, s.field_manager, self.gate), self.services.get)
        # An ImexEnsemble's own Service as the applier knows it: the informer's copy, or
        # the object our create returned while the informer has not caught up (the pair
        # is written onto that Service in the same pass that creates it).
        services = owned.view if owned is not None else self.services.get
        persisted: PersistedReports | None = None
        if s.persists_membership:
            persisted = PersistedReports(self._adopt_report)
            # heartbeats without news are not written; the copy in the API is refreshed
            # well before other replicas would call it stale (host_agent/persist/reports.py)
            self.reports = ReportPersister(
                client, s.agent_namespace, persisted=persisted.of,
                refresh_after=s.report_stale_after * REFRESH_FRACTION,
                on_decision=lambda d: self.metrics.report_decisions.labels(d).inc(),
                on_write=self.metrics.report_writes.inc)
            self.state.subscribe(self._forget_reports)
        if not sidecar:
            self.events = EventRecorder(EventWriter(client, s.field_manager, self.gate),
                                        s.identity, self.metrics)
            self.status = StatusWriter(
                EnsembleStatusWriter(client, s.field_manager, self.gate), self.crs, self.state,
                self.metrics, stale_after=s.report_stale_after,
                backoff=(s.backoff_initial, s.backoff_max), events=self.events)
            self.state.subscribe(self.status.on_state)
        pairs: Pairs | None = None
        if s.persists_membership:
            # a Service-only ensemble's pair rides on its Service, an ImexEnsemble's in its
            # status, written by the status writer with the rest of the status
            annotations = ServiceAnnotationSource(client, services, self.gate)
            pairs = Pairs(annotations, self.state, self.gate, self.metrics,
                          StatusPairSource(self.status, annotations)
                          if self.status is not None else None)
        self.reconciler = rec = Reconciler(
            s, self.state, self.vmis, self.services, self.slices, applier, self.metrics,
            self.cas, crs=self.crs, owned=owned, gate=self.gate, pairs=pairs,
            persisted_reports=persisted.of if persisted is not None else None,
            on_declared=self._declared,
        )
        if persisted is not None:
            # every replica shows every report stored in the API (any replica stored it)
            self.informers.append(Informer(
                "reports", ListWatcher(client, ConfigMap, namespace=s.agent_namespace,
                                       labels={REPORTS_LABEL: "true"},
                                       timeout_seconds=s.watch_timeout_seconds),
                Store("configmap"), persisted.changed, self.metrics, s, s.agent_namespace,
                optional=True))  # no rights on them: say so, serve without persisted reports
        namespaces: list[str | None] = list(s.namespaces) or [None]
        vmi_fields = {"metadata.name": s.vmi} if s.vmi else None
        has_label = {ENSEMBLE_LABEL: operators.exists()}
        for ns in namespaces:
            scope = ns if ns is not None else ALL_NAMESPACES
            suffix = f"@{ns}" if ns is not None else ""

            def watcher(
                res: type, labels: Mapping[str, object], fields: Mapping[str, str] | None = None
            ) -> ListWatcher:
                return ListWatcher(client, res, namespace=scope, labels=labels, fields=fields,  # noqa: B023
                                   timeout_seconds=s.watch_timeout_seconds)

            self.informers += [
                Informer("vmi" + suffix, watcher(VirtualMachineInstance, has_label, vmi_fields),
                         self.vmis, rec.on_vmi, self.metrics, s, ns),
                Informer("service" + suffix, watcher(Service, has_label),
                         self.services, rec.on_service, self.metrics, s, ns),
                Informer("endpointslice" + suffix, watcher(EndpointSlice, managed_slice_labels()),
                         self.slices, rec.on_slice, self.metrics, s, ns),
            ]
            if not sidecar:
                self.informers.append(
                    Informer("imexensemble" + suffix, watcher(ImexEnsemble, {}), self.crs,
                             rec.on_cr, self.metrics, s, ns, optional=True))

    def _forget_reports(self, ens: EnsembleId) -> None:
        """An ensemble dropped from the state: its held heartbeats go too."""
        if self.reports is not None and self.state.get(ens) is None:
            self.reports.forget(ens)

    def _adopt_report(self, ens: EnsembleId, index: int, report: GuestReport) -> None:
        """A report whose value in the API changed, if it is the member's now: show it,
        keep a later heartbeat of it, or write a later report back (``after_api_change``)."""
        snap = self.state.get(ens)
        pub = snap.member(index) if snap is not None else None
        if pub is None or not report_applies(report, pub.member.ip, pub.addresses):
            return
        assert snap is not None
        shown = snap.reports.get(index)
        if shown is not None and not report_applies(shown, pub.member.ip, pub.addresses):
            shown = None  # from the slot's VM before: the copy from the API replaces it
        decision = after_api_change(report, shown)
        if decision == ADOPT:
            self.state.report(ens, index, report)
        elif decision == WRITE_BACK and self.reports is not None:
            assert shown is not None
            self.reports.write_back(ens, index, shown)
        # KEEP: this replica has a later heartbeat of the same (held, not written)

    def _declared(self, key: tuple[str, str], declaration: Declaration | None) -> None:
        """A reconcile pass's conclusion: to the status writer, the Events' one source."""
        if self.status is not None:
            self.status.declare(key, declaration)

    async def _registry_app(self) -> object:
        """The registry's app. Its module (FastAPI and pydantic: ~0.3 s of CPU) is imported
        in a worker thread once the informers have asked for their first lists, so the
        API server builds those meanwhile instead of after it (issue 27: a 10,000-VMI
        sync was the start-up, then the lists, end to end)."""
        registry = await asyncio.get_running_loop().run_in_executor(
            None, importlib.import_module, "host_agent.registry.app")
        config = RegistryConfig(
            trusted_proxies=tuple(
                ipaddress.ip_network(c, strict=False) for c in self.settings.trusted_proxies
            ),
            report_stale_after=self.settings.report_stale_after,
        )
        app: object = registry.create_app(
            self.state, config, self.metrics_registry, ca_source=self.cas, reports=self.reports,
            cert_config=CertConfig(lifetime=dt.timedelta(
                seconds=self.settings.cert_lifetime_seconds)),
            not_ready=lambda: self.preflight.problem if self.preflight is not None else None,
            registry_ca=self.tls.ca_pem if self.tls is not None else None,
        )
        return app

    async def run(self, stop: asyncio.Event, sock: socket.socket | None = None,
                  tls_sock: socket.socket | None = None) -> None:
        s = self.settings
        client = self._client or make_client(s)
        own_client = self._client is None
        count_requests(client, self.metrics.count_request)
        self.preflight = Preflight(client, s, token_file(s) if own_client else None)
        self._build(client)
        assert self.reconciler is not None
        if sock is None and s.http_enabled:
            sock = bind(s.listen_host, s.listen_port)
        if self._tls_source is not None:
            tls_sock = tls_sock or bind(s.tls_listen_host, s.tls_listen_port or 0)
            self.tls = TlsServing(self._tls_source, tls_sock, lambda c: _Server(c, self.state),
                                  self._server_config(s.tls_listen_host, tls_sock))
            if self.status is not None:
                self.status.registry_ca_sha256 = self.tls.ca_sha256
        addr = sock.getsockname() if sock is not None else ("-", 0)
        self.address = (addr[0], addr[1])
        server = _Server(self._server_config(s.listen_host, sock), self.state)
        log.info(
            "imex-host-agent serving on %s; watching %s%s",  # the line as 0.1 wrote it
            (f"{addr[0]}:{addr[1]}" if sock is not None else "HTTPS only")
            + (f" (HTTPS on {self.tls.address[0]}:{self.tls.address[1]} once its "
               "certificate is in)" if self.tls is not None else ""),
            ", ".join(s.namespaces) if s.namespaces else "all namespaces",
            f" (sidecar scope: VMI {s.vmi})" if s.vmi else "",
        )
        hook: HookServer | None = None
        linger: asyncio.TimerHandle | None = None

        def launcher_done() -> None:
            nonlocal linger
            if linger is None:
                log.info("virt-launcher called the Shutdown hook: stopping in %g s",
                         s.hook_shutdown_linger)
                linger = asyncio.get_running_loop().call_later(s.hook_shutdown_linger, stop.set)

        try:
            if s.hook_socket:
                # grpc costs ~10 MB of RSS; only the sidecar deployment loads it.
                from host_agent.sidecar.hook_io import HookServer

                hook = HookServer(s.hook_socket, launcher_done)
                await hook.start()
            async with asyncio.TaskGroup() as tg:
                loops = [tg.create_task(i.run(), name=f"informer {i.name}") for i in self.informers]
                loops.append(tg.create_task(self.preflight.run(), name="start-up checks"))
                loops.append(tg.create_task(
                    self.reconciler.run([i.synced for i in self.informers]), name="reconciler"))
                election = None
                if self.election is not None:
                    election = tg.create_task(self.election.run(), name="leader election")
                if self.lease_watch is not None:
                    loops.append(tg.create_task(self.lease_watch.run(), name="lease watch"))
                if self.status is not None:
                    loops.append(tg.create_task(self.status.run(), name="status writer"))
                if self.events is not None:
                    loops.append(tg.create_task(self.events.run(), name="event recorder"))
                if self.reports is not None:
                    loops.append(tg.create_task(self.reports.run(), name="report writers"))
                # after every informer's task exists: they send their lists while it loads
                app = await self._registry_app()
                server.config.app = app  # type: ignore[assignment]
                if self.tls is not None:
                    self.tls.config.app = app  # type: ignore[assignment]
                https = None
                if self.tls is not None:
                    https = tg.create_task(self.tls.run(), name="https")
                    loops.append(tg.create_task(self._on_tls_ready(), name="https-ready"))
                serve = tg.create_task(server.serve(sockets=[sock]), name="http") \
                    if sock is not None else https
                assert serve is not None
                self.serving.set()
                stopped = tg.create_task(stop.wait(), name="stop")
                await asyncio.wait((stopped, serve), return_when=asyncio.FIRST_COMPLETED)
                await self._hand_over(election, serve)
                server.should_exit = True
                if self.tls is not None:
                    self.tls.stop()
                for task in loops:
                    task.cancel()
                stopped.cancel()
        finally:
            if linger is not None:
                linger.cancel()
            if hook is not None:
                await hook.stop()
            for listening in (sock, tls_sock):
                if listening is not None:
                    listening.close()
            if own_client:
                await client.close()
            log.info("stopped")


    def _server_config(self, host: str, sock: socket.socket | None,
                       app: object = None) -> uvicorn.Config:
        return server_config(
            app,
            host,
            sock.getsockname()[1] if sock is not None else 0,
            log_config=None,
            lifespan="on",
            timeout_graceful_shutdown=max(1, round(self.settings.shutdown_grace)),
        )

    async def _on_tls_ready(self) -> None:
        """Every ImexEnsemble's status shows registryCASHA256 once HTTPS is served (and
        again if the CA changed): each is evaluated again."""
        assert self.tls is not None
        shown: str | None = None
        while True:
            await self.tls.changed.wait()
            self.tls.changed.clear()
            if self.tls.ca_sha256() != shown and self.status is not None:
                shown = self.tls.ca_sha256()
                for snap in self.state.all():
                    self.status.on_state(snap.ens)

    async def _hand_over(self, election: asyncio.Task[None] | None,
                         serve: asyncio.Task[None]) -> None:
        """Graceful stop, in this order: readiness off and every parked long-poll answered
        with the current state (``state.close``: guests ask again at once, through the
        Service, and land on another replica); the lease released at once, so another
        replica leads as soon as its Lease watch shows the release (else within a retry
        period) rather than after a lease duration; then the listener stays open
        ``shutdown_drain`` seconds for connections a balancer still sends here before it
        has seen readiness go."""
        log.info("stopping: readiness off, answering long-polls, releasing the lease")
        self.state.close()
        if election is not None and self.election is not None:
            election.cancel()
            await asyncio.gather(election, return_exceptions=True)
            await self.election.release()
        drain = self.settings.shutdown_drain if self.settings.leader_elect else 0.0
        if drain > 0 and not serve.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain):
                    await asyncio.shield(serve)
        log.info("stopping: draining HTTP, cancelling watches")


def run(settings: HostSettings) -> int:
    """Run until SIGTERM/SIGINT; the process exit code."""

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await HostAgent(settings).run(stop)

    asyncio.run(_main())
    return 0
