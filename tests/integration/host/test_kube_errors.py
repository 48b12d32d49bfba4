"""KubeError keeps the API's Status (reason, message, details), over real HTTP to the double.

The double answers errors as the real apiserver does (a ``kind: Status`` body;
tests/realk8s compares the two), so a caller can tell an existing object from a
stale precondition without parsing messages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from lightkube import AsyncClient

from host_agent.kube.client import AlreadyExists, KubeError, api_call, translate
from host_agent.kube.writers import SecretWriter
from tests.sandbox.kube_api.fixtures import (  # noqa: F401
    kube_api_fixture,
    lightkube_client_fixture,
)

pytestmark = pytest.mark.timeout(30)

SECRET = {"apiVersion": "v1", "kind": "Secret",
          "metadata": {"name": "s1", "namespace": "default"}, "data": {"k": "dg=="}}


async def test_a_create_over_an_existing_object_keeps_reason_and_details(
        client: AsyncClient) -> None:
    writer = SecretWriter(client, "test")
    await writer.create_secret(SECRET)
    with pytest.raises(AlreadyExists) as err:
        await writer.create_secret(SECRET)
    assert err.value.status == 409
    assert err.value.reason == "AlreadyExists"
    assert err.value.details is not None and err.value.details.get("name") == "s1"
    assert err.value.api_message is not None and "s1" in err.value.api_message
    assert "create Secret default/s1: 409 Conflict" in str(err.value)


async def test_a_raw_call_refused_by_a_precondition_says_conflict(client: AsyncClient) -> None:
    created = await SecretWriter(client, "test").create_secret(SECRET)
    rv = created["metadata"]["resourceVersion"]
    with pytest.raises(KubeError) as err:
        await api_call(client, "DELETE", "/api/v1/namespaces/default/secrets/s1",
                       body={"apiVersion": "v1", "kind": "DeleteOptions",
                             "preconditions": {"resourceVersion": rv + "0"}})
    assert err.value.status == 409
    assert err.value.reason == "Conflict"
    assert err.value.api_status is not None and err.value.api_status["kind"] == "Status"
    assert str(err.value).startswith("DELETE /api/v1/namespaces/default/secrets/s1: 409: ")


async def test_no_answer_has_no_status() -> None:
    err = KubeError("get x: ConnectError: refused")
    assert (err.status, err.api_status, err.reason, err.details) == (0, None, None, None)


def test_a_refused_watch_whose_body_is_an_unread_stream_translates() -> None:
    """A watch's error response is a stream nobody has read: the Status cannot be had
    without reading it, and asking for it must not turn the 403 into another error (the
    informer's retry and its list-only mode read ``status``; realk8s caught this)."""
    import httpx2

    request = httpx2.Request("GET", "https://127.0.0.1/apis/coordination.k8s.io/v1/leases")

    async def body() -> AsyncIterator[bytes]:
        yield b'{"kind":"Status","reason":"Forbidden"}'

    streamed = httpx2.Response(403, request=request, content=body())
    exc = httpx2.HTTPStatusError("403 Forbidden", request=request, response=streamed)
    err = translate(exc, "watch Lease in namespace imex-system")
    assert (err.status, err.api_status, err.reason) == (403, None, None)
    assert str(err).startswith("watch Lease in namespace imex-system: 403: ")
