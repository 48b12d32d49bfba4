"""pytest fixtures that start the Kubernetes API double (TEST STAND-IN).

Use from a test module or a conftest.py:

    from tests.sandbox.kube_api.fixtures import kube_api_fixture  # noqa: F401
    (likewise kube_api_factory_fixture, kube_api_async_fixture, lightkube_client_fixture)

(the functions are named `*_fixture` and registered under the fixture names
`kube_api` / `kube_api_factory` / `kube_api_async`, so the import does not
clash with test parameters). Or, suite-wide, `pytest_plugins = ["tests.sandbox.kube_api.fixtures"]`
in the root conftest.py.

    async def test_x(kube_api):
        client = lightkube.AsyncClient(KubeConfig.from_file(kube_api.kubeconfig_path))
        kube_api.fail(500, count=3)          # next three requests get 500
        assert kube_api.writes("endpointslices") == 1

`kube_api` yields a `KubeApiHandle`: `.url`, `.kubeconfig_path` (a file in
the test's tmp_path), `.token`, `.server` (the `ThreadedKubeApi`, whose
blocking methods are safe from sync and async tests alike), and every method
of `.server` directly on the handle (`fail`, `delay`, `clear_faults`,
`drop_watches`, `compact`, `outage`, `recover`, `restart`, `writes`,
`requests`, `faulted`, `changes`, `reset_counters`, `put`, `put_many`, `get`,
`list`, `delete`, `resource_version`, `call(fn)` to run `fn(KubeApiServer)`
on the server's thread).
The server runs on its own thread and event loop on an ephemeral loopback
port, so code under test may block or run in the test's loop freely.

`kube_api_factory` starts doubles with options (`bookmark_interval`,
`history_limit`, `token`, `port`, `crds`, ...) and stops them at teardown:
`kube_api_factory(bookmark_interval=0.1)` -> `KubeApiHandle`;
`kube_api_factory(crds=())` is a cluster without the ImexEnsemble CRD (every
double has it installed otherwise, from manifests/base).

`client` (import `lightkube_client_fixture`) yields a lightkube `AsyncClient` on
`kube_api`'s kubeconfig, closed at teardown.

`kube_api_async` yields a `KubeApiServer` on the test's own event loop
(async tests only; its `outage`/`recover`/`restart` are coroutines).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from lightkube import AsyncClient, KubeConfig

from .server import KubeApiServer, ThreadedKubeApi


@dataclass
class KubeApiHandle:
    url: str
    kubeconfig_path: Path
    token: str
    server: ThreadedKubeApi

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)


@pytest.fixture(name="kube_api")
def kube_api_fixture(tmp_path: Path) -> Iterator[KubeApiHandle]:
    with ThreadedKubeApi() as api:
        path = api.write_kubeconfig(tmp_path / "kubeconfig")
        yield KubeApiHandle(api.url, path, api.token, api)


KubeApiFactory = Callable[..., KubeApiHandle]


@pytest.fixture(name="kube_api_factory")
def kube_api_factory_fixture(tmp_path: Path) -> Iterator[KubeApiFactory]:
    """Start doubles with options, e.g. `kube_api_factory(bookmark_interval=0.1,
    history_limit=20)` (any `KubeApiServer` keyword); all stopped at teardown."""
    started: list[ThreadedKubeApi] = []

    def start(**kwargs: Any) -> KubeApiHandle:
        api = ThreadedKubeApi(**kwargs).start()
        started.append(api)
        path = api.write_kubeconfig(tmp_path / f"kubeconfig-{len(started)}")
        return KubeApiHandle(api.url, path, api.token, api)

    try:
        yield start
    finally:
        for api in started:
            api.stop()


@pytest_asyncio.fixture(name="client")
async def lightkube_client_fixture(kube_api: KubeApiHandle) -> AsyncIterator[AsyncClient]:
    c = AsyncClient(KubeConfig.from_file(kube_api.kubeconfig_path))
    try:
        yield c
    finally:
        await c.close()


@pytest_asyncio.fixture(name="kube_api_async")
async def kube_api_async_fixture(tmp_path: Path) -> AsyncIterator[KubeApiServer]:
    async with KubeApiServer() as srv:
        srv.write_kubeconfig(tmp_path / "kubeconfig")
        yield srv
