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

Quick start (standalone, then any client):

    python -m tests.sandbox kube-api --listen 127.0.0.1:6443 --kubeconfig-out /tmp/kc
    kubectl --kubeconfig /tmp/kc apply -f vmi.yaml
    kubectl --kubeconfig /tmp/kc patch vmi gb200-0 --subresource=status --type=merge \
        -p '{"status": {"phase": "Running"}}'

In tests: see fixtures.py (`kube_api`: `.url`, `.kubeconfig_path`, fault
methods, write counters). Module map: resources (kinds), selectors,
patching (merge/JSON/strategic patch, server-side apply), validation,
store (objects, versions, watch history, GC), api (REST routing,
discovery), tables (kubectl columns), openapi (kubectl's probe), faults,
http (the socket layer), server (lifecycle, fault API, kubeconfig), cli.

Known simplifications (each documented where it lives): lists are atomic
in server-side apply; garbage collection is synchronous; one version per
API group; only the kinds in resources.py; no admission webhooks (KubeVirt's
mutating/validating webhooks are not imitated beyond its OpenAPI schema);
plain HTTP, anonymous requests allowed.
"""

from .server import KubeApiServer, ThreadedKubeApi, kubeconfig_document

__all__ = ["KubeApiServer", "ThreadedKubeApi", "kubeconfig_document"]
