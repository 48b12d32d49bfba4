"""What the agent needs before it may call itself ready, derived from its settings (pure).

An agent that cannot do its work must not say it is ready: run outside the cluster
without ``--agent-namespace`` it used ``imex-system``, and where that namespace did not
exist it reported ready and then answered every guest report with 503. So at start
(``preflight_io.py`` asks, this module decides what to ask and how to say it):

- every namespace it creates objects in exists (its own: report ConfigMaps, CA
  Secrets; the Lease's, when that is elsewhere);
- its token file, when its configuration reads one, can be read;
- RBAC allows every verb its configuration uses (``needed_rights``: one table, by
  flag), as SelfSubjectAccessReviews answer it.

Only what the agent cannot work without is asked. The optional informers keep their
own, said-once, judgement: the ImexEnsemble list (no CRD, or no rights: Service-only
ensembles work; when the agent may list ImexEnsembles, though, it needs to watch them
and write their status), the Lease watch (without it the election polls), the
reports' ConfigMap watch (without it a replica shows the reports it received). Rights
that depend on the cluster rather than on the agent's flags are not asked either:
``imexensembles/finalizers`` update matters only where OwnerReferencesPermissionEnforcement
is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from host_agent.settings import HostSettings

VMI_GROUP: Final = "kubevirt.io"
SLICE_GROUP: Final = "discovery.k8s.io"
EVENT_GROUP: Final = "events.k8s.io"
LEASE_GROUP: Final = "coordination.k8s.io"
CRD_GROUP: Final = "imex-ensemble.io"
#: the name the namespace check's dry-run create uses (nothing is stored)
PROBE_NAME: Final = "imex-host-agent-preflight"


@dataclass(frozen=True, slots=True, order=True)
class Right:
    """One verb on one resource, in one namespace ("" : every namespace)."""

    verb: str
    group: str
    resource: str
    namespace: str = ""
    subresource: str = ""

    def describe(self) -> str:
        res = self.resource + (f".{self.group}" if self.group else "")
        if self.subresource:
            res += f"/{self.subresource}"
        where = f"in namespace {self.namespace}" if self.namespace else "in every namespace"
        return f"{self.verb} {res} {where}"

    def review(self) -> dict[str, object]:
        """The SelfSubjectAccessReview that asks for it."""
        attrs = {"verb": self.verb, "group": self.group, "resource": self.resource,
                 "namespace": self.namespace, "subresource": self.subresource}
        return {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": {k: v for k, v in attrs.items() if v}}}


@dataclass(frozen=True, slots=True)
class Need:
    """A right, what it is for, and (``only_if``) the right whose grant makes it needed."""

    right: Right
    why: str
    only_if: Right | None = None


@dataclass(frozen=True, slots=True)
class OwnNamespace:
    """A namespace the agent creates objects in, the object its dry-run create uses (the
    apiserver answers 404 for the namespace when it does not exist), and what lives there."""

    namespace: str
    create: Right
    holds: str


def _each(verbs: str, group: str, resource: str, namespace: str, why: str,
          subresource: str = "", only_if: Right | None = None) -> list[Need]:
    return [Need(Right(v, group, resource, namespace, subresource), why, only_if)
            for v in verbs.split()]


def needed_rights(s: HostSettings) -> tuple[Need, ...]:
    """Every right the agent's configuration uses, in the order they are asked."""
    needs: list[Need] = []
    sidecar = s.vmi is not None
    for ns in s.namespaces or ("",):
        needs += _each("list watch", VMI_GROUP, "virtualmachineinstances", ns, "VMI watch")
        needs += _each("list watch", "", "services", ns, "ensemble Service watch")
        needs += _each("list watch create patch delete", SLICE_GROUP, "endpointslices", ns,
                       "publishing the members")
        if sidecar:
            continue  # one VMI's slice: no Services, Events or ImexEnsembles written
        needs += _each("create patch", "", "services", ns,
                       "ImexEnsembles' Services and the membership annotation")
        needs += _each("create patch", EVENT_GROUP, "events", ns, "Events")
        crs = Right("list", CRD_GROUP, "imexensembles", ns)
        needs += _each("watch", CRD_GROUP, "imexensembles", ns, "ImexEnsemble watch",
                       only_if=crs)
        needs += _each("patch", CRD_GROUP, "imexensembles", ns, "ImexEnsemble status",
                       subresource="status", only_if=crs)
    if s.persists_membership:
        needs += _each("create patch", "", "configmaps", s.agent_namespace,
                       "storing guest reports")
        needs += _each("get create update", "", "secrets", s.agent_namespace,
                       "the ensemble CAs (authEncryption)")
    if s.tls_self_issued and s.tls_enabled:
        needs += _each("get create update", "", "secrets", s.agent_namespace,
                       "the registry's certificate (--tls-self-issued)")
    if s.leader_elect:
        needs += _each("get create update", LEASE_GROUP, "leases", s.lease_namespace,
                       "leader election")
    first: dict[Right, Need] = {}  # a right two features use is asked once, for the first
    for n in needs:
        first.setdefault(n.right, n)
    return tuple(first.values())


def own_namespaces(s: HostSettings) -> tuple[OwnNamespace, ...]:
    """The namespaces the agent creates objects in, and how to find out they exist."""
    holds: dict[str, list[str]] = {}
    creates: dict[str, Right] = {}
    if s.persists_membership:
        holds[s.agent_namespace] = ["its guest-report ConfigMaps", "its CA Secrets"]
        creates[s.agent_namespace] = Right("create", "", "configmaps", s.agent_namespace)
    if s.tls_self_issued and s.tls_enabled:
        holds.setdefault(s.agent_namespace, []).append("its registry TLS Secret")
        creates.setdefault(s.agent_namespace, Right("create", "", "secrets", s.agent_namespace))
    if s.leader_elect:
        holds.setdefault(s.lease_namespace, []).append("its leader-election Lease")
        creates.setdefault(s.lease_namespace,
                           Right("create", LEASE_GROUP, "leases", s.lease_namespace))
    return tuple(OwnNamespace(ns, creates[ns], ", ".join(what)) for ns, what in holds.items())


def probe_object(create: Right) -> dict[str, object]:
    """The object a dry-run create of ``create`` sends (valid, never stored)."""
    meta = {"name": PROBE_NAME, "namespace": create.namespace}
    if create.resource == "leases":
        return {"apiVersion": f"{LEASE_GROUP}/v1", "kind": "Lease", "metadata": meta,
                "spec": {}}
    if create.resource == "secrets":
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}


def rights_problem(denied: list[Need]) -> str | None:
    """One sentence naming every right RBAC refuses, and what each is for."""
    if not denied:
        return None
    parts = [f"{n.right.describe()} ({n.why})" for n in denied]
    noun = "right" if len(parts) == 1 else "rights"
    return f"RBAC refuses {len(parts)} {noun} the agent needs: {'; '.join(parts)}"


def namespace_problem(own: OwnNamespace, settings: HostSettings, terminating: bool) -> str:
    """Why the agent is not ready when one of its namespaces is missing, and what to do."""
    state = "is being deleted" if terminating else "does not exist"
    flag = ("--agent-namespace (env IMEX_AGENT_NAMESPACE)"
            if own.namespace == settings.agent_namespace else "--leader-elect-namespace")
    return (f"namespace {own.namespace} {state}: the agent keeps {own.holds} there; "
            f"create it, or pass {flag}")
