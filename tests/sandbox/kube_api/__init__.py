"""A Kubernetes API server double for tests (TEST STAND-IN, never product code).

It speaks the real REST protocol (discovery, list/watch with resourceVersion
and selectors, get/create/update/patch/server-side apply, the status
subresource, delete with garbage collection) over plain HTTP on loopback, so
tests drive it with the real client libraries (lightkube, kubectl). It
validates what it stores (kubernetes-validate schemas for core/discovery
kinds, KubeVirt's OpenAPI for KubeVirt kinds, FACTS.md's EndpointSlice
rules) and injects faults (watch drops, 500/429, delays, compaction -> 410,
outages, restarts). Product code never imports it.

Entry points: `KubeApiServer` (asyncio), `ThreadedKubeApi` (own thread,
blocking methods), the pytest fixtures in `fixtures.py`, and the CLI
`python -m tests.sandbox kube-api`.
"""

from .server import KubeApiServer, ThreadedKubeApi, kubeconfig_document

__all__ = ["KubeApiServer", "ThreadedKubeApi", "kubeconfig_document"]
