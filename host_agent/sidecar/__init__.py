"""The KubeVirt hook sidecar: the hook protocol's messages (``hook.py``, pure) and
the server virt-launcher calls (``hook_io.py``).

Imports nothing else of the agent: grpc is loaded only where the sidecar runs.
"""
