"""Bad input at the API double's HTTP surface: a clear 4xx Status, never a crash."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.sandbox.kube_api.fixtures import KubeApiHandle, kube_api_fixture  # noqa: F401

pytestmark = pytest.mark.timeout(30)
SVCS = "/api/v1/namespaces/default/services"


@pytest.fixture
def http(kube_api: KubeApiHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=kube_api.url, timeout=5,
                      headers={"Authorization": f"Bearer {kube_api.token}"}) as c:
        yield c


@pytest.mark.parametrize(("method", "path", "body", "ctype", "code", "words"), [
    ("POST", SVCS, b"not json", "application/json", 400, "could not be decoded"),
    ("POST", SVCS, b"[]", "application/json", 400, "JSON object"),
    ("POST", SVCS, b'{"metadata": 5}', "application/json", 400, "metadata"),
    ("POST", SVCS, b'{"kind": "Pod", "apiVersion": "v1"}', "application/json", 400,
     "does not match"),
    ("POST", SVCS, b"", "application/json", 400, "empty"),
    ("PATCH", SVCS + "/x", b"{}", "text/plain", 415, "unknown format"),
    ("PATCH", SVCS + "/x", b"a: [", "application/apply-patch+yaml", 400, "decoded"),
    ("PATCH", SVCS + "/x", b"kind: Service\napiVersion: v1\n", "application/apply-patch+yaml",
     422, "fieldManager"),
    ("PUT", SVCS, b"{}", "application/json", 400, "name is required"),
    ("GET", SVCS + "?labelSelector=a%20in%20(b", None, None, 400, "unable to parse requirement"),
    ("GET", SVCS + "?fieldSelector=spec.ports%3D1", None, None, 400,
     "field label not supported"),
    ("GET", SVCS + "?watch=true&resourceVersion=abc", None, None, 400, "resourceVersion"),
    ("POST", SVCS + "?dryRun=Sometimes", b"{}", "application/json", 400, "dryRun"),
])
def test_bad_requests_get_a_status(http: httpx.Client, method: str, path: str,
                                   body: bytes | None, ctype: str | None, code: int,
                                   words: str) -> None:
    headers = {"Content-Type": ctype} if ctype else {}
    r = http.request(method, path, content=body, headers=headers)
    assert r.status_code == code, r.text
    status = r.json()
    assert status["kind"] == "Status" and status["code"] == code
    assert words in status["message"]


def test_unknown_resources_get_the_muxs_plain_404(http: httpx.Client) -> None:
    for path in ("/apis/nope.io/v1/things", "/api/v1/namespaces/default/frobs",
                 SVCS + "/x/scale"):
        r = http.get(path)
        assert (r.status_code, r.text) == (404, "404 page not found\n")


def test_json_patch_errors_are_422(http: httpx.Client) -> None:
    http.post(SVCS, json={"metadata": {"name": "a"}, "spec": {"clusterIP": "None"}})
    r = http.patch(SVCS + "/a", content=b'[{"op": "remove", "path": "/nope"}]',
                   headers={"Content-Type": "application/json-patch+json"})
    assert r.status_code == 422 and "not found" in r.json()["message"]


def test_garbage_on_the_socket_then_service_as_usual(kube_api: KubeApiHandle,
                                                     http: httpx.Client) -> None:
    with socket.create_connection(("127.0.0.1", kube_api.port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01 this is not http\r\n\r\n")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", kube_api.port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
    assert http.get("/version").json()["gitVersion"].startswith("v1.33")


def test_discovery_documents(http: httpx.Client) -> None:
    assert http.get("/api").json()["versions"] == ["v1"]
    groups = {g["name"] for g in http.get("/apis").json()["groups"]}
    assert {"coordination.k8s.io", "discovery.k8s.io", "kubevirt.io",
            "pool.kubevirt.io"} <= groups
    kv = http.get("/apis/kubevirt.io/v1").json()
    vmi = next(r for r in kv["resources"] if r["name"] == "virtualmachineinstances")
    assert vmi["kind"] == "VirtualMachineInstance" and "vmi" in vmi["shortNames"]
    assert vmi["namespaced"] and "watch" in vmi["verbs"]
    assert any(r["name"] == "virtualmachineinstances/status" for r in kv["resources"])
    core = {r["name"] for r in http.get("/api/v1").json()["resources"]}
    assert {"namespaces", "services", "services/status", "pods", "configmaps", "events"} <= core
    assert http.get("/apis/discovery.k8s.io").json()["preferredVersion"]["version"] == "v1"
    index = http.get("/openapi/v3").json()["paths"]
    assert "apis/kubevirt.io/v1" in index
    doc = http.get("/" + index["api/v1"]["serverRelativeURL"].lstrip("/")).json()
    patch = doc["paths"]["/api/v1/namespaces/{namespace}/services/{name}"]["patch"]
    assert any(p["name"] == "fieldValidation" for p in patch["parameters"])
