"""A Kubernetes API server double for tests (TEST STAND-IN, never product code).

It speaks the real REST protocol (discovery, list/watch with resourceVersion
and selectors, get/create/update/patch/server-side apply, the status
subresource, delete with garbage collection) over plain HTTP on loopback, so
tests drive it with the real client libraries (lightkube, kubectl). It
validates what it stores (kubernetes-validate schemas for core/discovery
kinds, KubeVirt's OpenAPI for KubeVirt kinds, FACTS.md's EndpointSlice
rules), serves CustomResourceDefinitions written to it as the apiextensions
apiserver does (the ImexEnsemble CRD of manifests/base is installed at start
unless `crds=()`: structural defaulting, pruning and validation with the real
messages, the CEL its rules use, the status subresource, server-side apply of
list-type maps by key, printer columns), records events.k8s.io/v1 Events,
accepts the RBAC, apps, networking and admission-policy objects of
`kubectl apply -k manifests/base` (stored and validated; RBAC holds the
ServiceAccount tokens the TokenRequest API mints, and answers
SelfSubjectAccessReviews: rbac.py) and injects faults (watch drops, 500/429,
delays, compaction -> 410, outages, restarts). Product code never imports it.

Entry points: `KubeApiServer` (asyncio), `ThreadedKubeApi` (own thread,
blocking methods), the pytest fixtures in `fixtures.py`, and the CLI
`python -m tests.sandbox kube-api`.

Quick start (standalone, then any client):

    python -m tests.sandbox kube-api --listen 127.0.0.1:6443 --kubeconfig-out /tmp/kc
    kubectl --kubeconfig /tmp/kc apply -f vmi.yaml
    kubectl --kubeconfig /tmp/kc patch vmi gb200-0 --subresource=status --type=merge \
        -p '{"status": {"phase": "Running"}}'

In tests: see fixtures.py (`kube_api`: `.url`, `.kubeconfig_path`, fault
methods, write counters). Module map: resources (kinds, the per-server
TypeRegistry), selectors, patching (merge/JSON/strategic patch, server-side
apply), validation, crds (a stored CRD -> a served kind), structural (custom
resources under a structural schema), cel (the CEL subset), events
(events.k8s.io/v1 rules), store (objects, versions, watch history, GC), api
(REST routing, discovery), rbac (identities, RBAC, access reviews), tables
(kubectl columns), openapi (kubectl's probe), faults, http (the socket
layer), server (lifecycle, fault API, kubeconfig), cli.

Known simplifications (each documented where it lives): lists are atomic
in server-side apply except list-type maps of CRD-defined kinds; garbage
collection is synchronous; one version per API group (a CRD serves its
storage version); only the kinds in resources.py and those stored CRDs
define; no admission webhooks and no admission-policy enforcement
(ValidatingAdmissionPolicies are stored; the realk8s tier proves the real
server enforces ours); RBAC binds only the ServiceAccount tokens it minted:
the server's own token and requests without one are the superuser; plain HTTP,
anonymous requests allowed.
"""

from .server import KubeApiServer, ThreadedKubeApi, kubeconfig_document

__all__ = ["KubeApiServer", "ThreadedKubeApi", "kubeconfig_document"]
