"""The Kubernetes API double as its own process, pre-seeded with a large fleet.

``python -m tests.bench.kube_proc --kubeconfig-out PATH --ensembles E --per N``

Why a separate entry instead of ``python -m tests.sandbox kube-api --seed``:
10,000 VMIs as a YAML seed cost more to parse than the benchmark measures;
here they are built as dicts and stored straight into the double (validated
as any write) before it listens. The process prints
``kube-api ready url=<url> token=<token> objects=<n>`` once it accepts
requests and stops on SIGTERM. The objects are what KubeVirt and an admin
would have written: one headless ensemble Service (or, with ``--imexensembles``,
one ImexEnsemble) per ensemble, ``N`` Running
VMIs each with a pod-network IP (ensemble ``e``, member ``i``:
``10.<20 + e // 250>.<e % 250>.<i + 1>``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

from tests.host_support.kubevirt import service, vmi
from tests.sandbox.kube_api import KubeApiServer
from tests.sandbox.kube_api import api as kube_api_routes

NAMESPACE = "bench"


def json_first_bodies() -> None:
    """Decode request bodies as JSON before trying YAML (server-side apply bodies).

    The double decodes every ``application/apply-patch+yaml`` body with
    pure-Python ``yaml.safe_load``: about three quarters of the cost of one
    EndpointSlice apply, which made the double, not the host agent, the limit
    of this benchmark (1,000 applies queued behind it; the agent's requests
    timed out). Clients (lightkube, kubectl) send JSON, which is YAML; decoding
    it as JSON gives the same object. Anything that is not JSON still goes to
    the double's own decoder. Reported to the double's owner; done here so the
    double's files stay theirs.
    """
    original = kube_api_routes._body

    def body(req: Any, yaml_ok: bool = False) -> Any:
        if req.body:
            try:
                return json.loads(req.body)
            except ValueError:
                pass
        return original(req, yaml_ok)

    kube_api_routes._body = body


def json_copy(value: Any) -> Any:
    """``copy.deepcopy`` for JSON values (dicts, lists, scalars), about three times faster;
    anything else goes to ``copy.deepcopy``. The double's objects are JSON."""
    t = type(value)
    if t is dict:
        return {k: json_copy(v) for k, v in value.items()}
    if t is list:
        return [json_copy(v) for v in value]
    if t is str or t is int or t is float or t is bool or value is None:
        return value
    return copy.deepcopy(value)


def lean_double() -> None:
    """Make the double cost less per request where it spends on Python, not on API rules
    (issue 27: the host benchmark measures the agent, and the double's CPU was a co-limit
    of the 10,000-VMI sync). Same answers: deep copies of the stored objects with a copier
    for JSON values (the store and the patch code copy every object they render or
    change), and the responses and watch events encoded with msgspec's C encoder (same
    JSON; non-ASCII text as UTF-8 rather than \\u escapes, as the apiserver sends it).
    Done here, like ``json_first_bodies``, so the double's files stay theirs."""
    import types

    import msgspec

    from tests.sandbox.kube_api import patching, store

    lean = types.SimpleNamespace(deepcopy=json_copy)
    store.copy = lean  # type: ignore[assignment]
    patching.copy = lean  # type: ignore[assignment]
    encoder = msgspec.json.Encoder()
    kube_api_routes.encode = encoder.encode  # type: ignore[assignment]


def member_ip(e: int, i: int, generation: int = 0) -> str:
    """The IP of member ``i`` of ensemble ``e`` after ``generation`` moves.

    Second octet from 20 up: 10.0.2.2 is KubeVirt's masquerade guest address,
    which the host agent rightly refuses to publish.
    """
    return f"10.{20 + (e // 250) + 8 * (generation % 6)}.{e % 250}.{i + 1}"


#: The guests' token in the ImexEnsemble fleet (``--imexensembles``).
BENCH_TOKEN = "bench-guest-token"


def fleet(ensembles: int, per: int, imexensembles: bool = False) -> list[dict[str, Any]]:
    """``imexensembles``: each ensemble an ImexEnsemble (tokenSHA256 of ``BENCH_TOKEN``),
    whose Service the host agent creates, instead of a hand-made Service."""
    # the agent's own namespace (the guests' reports, the CAs): without it, it is not ready
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "imex-system"}}]
    token_sha = hashlib.sha256(BENCH_TOKEN.encode()).hexdigest()
    for e in range(ensembles):
        name = f"e{e}"
        if imexensembles:
            objs.append({"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
                         "metadata": {"name": name, "namespace": NAMESPACE},
                         "spec": {"maxMembers": 18, "tokenSHA256": token_sha}})
        else:
            objs.append(service(name, namespace=NAMESPACE,
                                uid=f"00000000-0000-4000-8000-{e:012d}",
                                annotations={"imex-ensemble.io/max-members": "18"}))
        for i in range(per):
            objs.append(vmi(f"{name}-{i}", namespace=NAMESPACE, ensemble=name,
                            ip=member_ip(e, i), node=f"node-{(e * per + i) % 64}"))
    return objs


async def serve(args: argparse.Namespace) -> int:
    json_first_bodies()
    lean_double()
    server = KubeApiServer("127.0.0.1", 0, token=args.token,
                           history_limit=max(100_000, 4 * args.ensembles * args.per))
    objs = fleet(args.ensembles, args.per, args.imexensembles)
    for obj in objs:
        server.put(obj)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    try:
        server.write_kubeconfig(args.kubeconfig_out, NAMESPACE)
        print(f"kube-api ready url={server.url} token={server.token} objects={len(objs)}",
              flush=True)
        await stop.wait()
    finally:
        await server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.kube_proc")
    p.add_argument("--kubeconfig-out", type=Path, required=True)
    p.add_argument("--ensembles", type=int, default=1000)
    p.add_argument("--per", type=int, default=10)
    p.add_argument("--token", default="bench-token")
    p.add_argument("--imexensembles", action="store_true",
                   help="declare the ensembles as ImexEnsembles (the agent makes the Services)")
    return asyncio.run(serve(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
