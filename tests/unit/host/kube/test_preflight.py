"""What the agent's flags need before it may be ready (host_agent/kube/preflight.py), as a
table: the settings of each layout the manifests ship, and the rights, namespaces and
messages that follow from them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from host_agent.kube.preflight import (
    Need,
    Right,
    namespace_problem,
    needed_rights,
    own_namespaces,
    probe_object,
    rights_problem,
)
from host_agent.settings import HostSettings

BASE = HostSettings()
VMI = "kubevirt.io virtualmachineinstances"
SVC = " services"
SLICE = "discovery.k8s.io endpointslices"
EVT = "events.k8s.io events"
CR = "imex-ensemble.io imexensembles"


def rows(settings: HostSettings) -> list[str]:
    """Each need as 'verb group resource[/sub] @namespace [if verb resource]'."""
    out = []
    for n in needed_rights(settings):
        r = n.right
        text = f"{r.verb} {r.group} {r.resource}" + (f"/{r.subresource}" if r.subresource else "")
        text = text.replace("  ", " ").strip() + f" @{r.namespace or '*'}"
        if n.only_if is not None:
            text += f" if {n.only_if.verb} {n.only_if.resource}"
        out.append(text)
    return out


def scope(ns: str, sidecar: bool = False) -> list[str]:
    common = [f"list {VMI} @{ns}", f"watch {VMI} @{ns}", f"list{SVC} @{ns}",
              f"watch{SVC} @{ns}", *(f"{v} {SLICE} @{ns}" for v in
                                     ("list", "watch", "create", "patch", "delete"))]
    if sidecar:
        return common
    return [*common, f"create{SVC} @{ns}", f"patch{SVC} @{ns}", f"create {EVT} @{ns}",
            f"patch {EVT} @{ns}", f"watch {CR} @{ns} if list imexensembles",
            f"patch {CR}/status @{ns} if list imexensembles"]


def own(ns: str) -> list[str]:
    return [f"create configmaps @{ns}", f"patch configmaps @{ns}",
            f"get secrets @{ns}", f"create secrets @{ns}", f"update secrets @{ns}"]


def lease(ns: str) -> list[str]:
    return [f"{v} coordination.k8s.io leases @{ns}" for v in ("get", "create", "update")]


@pytest.mark.parametrize(("settings", "want"), [
    # outside the cluster, one replica, every namespace
    (BASE, [*scope("*"), *own("imex-system")]),
    # manifests/base: the Deployment elects (--leader-elect), its namespace from the SA
    (replace(BASE, leader_elect=True), [*scope("*"), *own("imex-system"),
                                        *lease("imex-system")]),
    # manifests/overlays/namespaced: one namespace watched, the agent's own elsewhere
    (replace(BASE, leader_elect=True, namespaces=("gpu-jobs",)),
     [*scope("gpu-jobs"), *own("imex-system"), *lease("imex-system")]),
    # two namespaces: every scope right in each
    (replace(BASE, namespaces=("a", "b"), agent_namespace="ops"),
     [*scope("a"), *scope("b"), *own("ops")]),
    # the Lease in a namespace of its own
    (replace(BASE, leader_elect=True, leader_elect_namespace="leases"),
     [*scope("*"), *own("imex-system"), *lease("leases")]),
    # manifests/overlays/sidecar: one VMI, nothing of its own anywhere
    (replace(BASE, vmi="gb200-0", namespaces=("gpu-jobs",)), scope("gpu-jobs", sidecar=True)),
], ids=["plain", "base", "namespaced", "two-namespaces", "lease-elsewhere", "sidecar"])
def test_needed_rights(settings: HostSettings, want: list[str]) -> None:
    assert rows(settings) == want


@pytest.mark.parametrize(("settings", "want"), [
    (BASE, [("imex-system", "configmaps", "its guest-report ConfigMaps, its CA Secrets")]),
    (replace(BASE, leader_elect=True),
     [("imex-system", "configmaps",
       "its guest-report ConfigMaps, its CA Secrets, its leader-election Lease")]),
    (replace(BASE, leader_elect=True, leader_elect_namespace="leases"),
     [("imex-system", "configmaps", "its guest-report ConfigMaps, its CA Secrets"),
      ("leases", "leases", "its leader-election Lease")]),
    (replace(BASE, vmi="gb200-0", namespaces=("gpu-jobs",)), []),
])
def test_own_namespaces(settings: HostSettings, want: list[tuple[str, str, str]]) -> None:
    got = own_namespaces(settings)
    assert [(o.namespace, o.create.resource, o.holds) for o in got] == want
    for o in got:  # the dry run is the create the rights above allow
        assert o.create in {n.right for n in needed_rights(settings)}
        body = probe_object(o.create)
        assert body["metadata"] == {"name": "imex-host-agent-preflight",
                                    "namespace": o.namespace}


def test_messages_name_the_cause_and_the_way_out() -> None:
    s = replace(BASE, leader_elect=True, leader_elect_namespace="leases")
    first, second = own_namespaces(s)
    assert namespace_problem(first, s, terminating=False) == (
        "namespace imex-system does not exist: the agent keeps its guest-report ConfigMaps, "
        "its CA Secrets there; create it, or pass --agent-namespace (env IMEX_AGENT_NAMESPACE)")
    assert namespace_problem(second, s, terminating=True) == (
        "namespace leases is being deleted: the agent keeps its leader-election Lease there; "
        "create it, or pass --leader-elect-namespace")
    denied = [Need(Right("get", "coordination.k8s.io", "leases", "imex-system"),
                   "leader election"),
              Need(Right("patch", "imex-ensemble.io", "imexensembles", "", "status"),
                   "ImexEnsemble status")]
    assert rights_problem(denied) == (
        "RBAC refuses 2 rights the agent needs: get leases.coordination.k8s.io in namespace "
        "imex-system (leader election); patch imexensembles.imex-ensemble.io/status in "
        "every namespace (ImexEnsemble status)")
    assert rights_problem([]) is None


def test_the_review_asks_exactly_the_right() -> None:
    r = Right("patch", "imex-ensemble.io", "imexensembles", "gpu", "status")
    assert r.review() == {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"verb": "patch", "group": "imex-ensemble.io",
                                        "resource": "imexensembles", "namespace": "gpu",
                                        "subresource": "status"}}}
    assert Right("list", "", "services").review()["spec"] == {
        "resourceAttributes": {"verb": "list", "resource": "services"}}


async def test_the_checks_run_again_after_1_2_4_then_every_5_seconds(tmp_path: Path,
                                                                     caplog: Any) -> None:
    """The schedule docs/host-agent.md states, and the cause said once (a token file that
    cannot be read: the first check, so no API is asked)."""
    import asyncio
    import logging

    from host_agent.kube.preflight_io import Preflight

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 6:
            raise asyncio.CancelledError

    caplog.set_level(logging.WARNING, "imex.host")
    missing = tmp_path / "token"
    preflight = Preflight(None, BASE, str(missing), sleep=sleep)
    with pytest.raises(asyncio.CancelledError):
        await preflight.run()
    assert slept == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert preflight.problem is not None
    assert preflight.problem.startswith(f"token file {missing} cannot be read: [Errno 2]")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not ready")]
    assert said == [f"not ready: {preflight.problem}"]
    missing.write_text("\n")
    assert await preflight.check() == f"token file {missing} is empty"


def test_the_self_issued_registry_certificate_needs_secrets_in_the_agent_namespace() -> None:
    alone = replace(BASE, namespaces=("a",), tls_self_issued=True, tls_listen_port=8443,
                    vmi="a/vm-0")
    rights = [n.right for n in needed_rights(alone)]
    assert [r.verb for r in rights if r.resource == "secrets"] == ["get", "create", "update"]
    (own,) = [o for o in own_namespaces(alone) if o.namespace == alone.agent_namespace]
    assert own.create.resource == "secrets" and "registry TLS Secret" in own.holds
    assert probe_object(own.create)["kind"] == "Secret"
    both = replace(BASE, namespaces=("a",), tls_self_issued=True, tls_listen_port=8443)
    asked = [n.right for n in needed_rights(both)]
    assert len(asked) == len(set(asked))  # the CA Secrets' rights are not asked twice
    assert [r.verb for r in asked if r.resource == "secrets"] == ["get", "create", "update"]
