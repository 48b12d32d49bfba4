"""The host agent: watches VMIs and publishes each ensemble (EndpointSlices, the registry,
ImexEnsemble status and Events).

Stages, top to bottom (each may import the ones below it, never one above; the
import-linter ``layers`` contract in pyproject.toml holds the order):
cli -> main -> status | reconcile | sidecar -> registry -> persist | ca | ensembles
-> state -> kube -> crd -> settings | metrics | logs | workqueue | backoff.
docs/architecture.md walks one VMI through them. Nothing here imports guest_agent;
what both agents share is imex_shared.
"""
