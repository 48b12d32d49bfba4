"""The kinds the Kubernetes API double serves, and how their REST paths look.

TEST STAND-IN, never product code. This table plays the part of the real
apiserver's type registry plus the CustomResourceDefinitions KubeVirt
installs: for each kind, its group/version, plural (the path segment), scope
(namespaced or cluster-wide), short names (what `kubectl get vmi` resolves
through discovery) and whether it has a `/status` subresource. With a status
subresource the main endpoint ignores changes to `.status` and `/status`
ignores everything but `.status` (Kubernetes API conventions, "spec and
status"), which is how virt-controller and the endpoint controllers write.

KubeVirt kinds are custom resources on a real cluster, so strategic merge
patch is refused for them (415), as the real apiserver does for every CRD.
They are built in here (validated by KubeVirt's published OpenAPI). Every
other custom resource comes from a CustomResourceDefinition written to the
double, as on a real cluster: `TypeRegistry` holds the built-in kinds plus
the ones each stored CRD defines (crds.py), per server.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ResourceType:
    """One servable kind: everything routing, discovery and validation need."""

    group: str
    version: str
    kind: str
    plural: str
    singular: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    has_status: bool = False
    custom: bool = False  # a CRD on a real cluster (KubeVirt kinds)
    # DELETE answers with the deleted object (the real registry's ReturnDeletedObject,
    # set for Namespaces, Services, Pods), else with a Success Status.
    returns_deleted: bool = False
    #: for kinds a stored CRD defines: its version's structural schema, printer
    #: columns and CEL rules (crds.CrdSpec); None for built-in kinds
    crd: Any = field(default=None, compare=False, hash=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_version(self) -> str:
        return self.api_version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def key(self) -> str:
        """Stable id, e.g. "discovery.k8s.io/v1/endpointslices" or "v1/services"."""
        return f"{self.api_version}/{self.plural}"

    @property
    def qualified(self) -> str:
        """How Status messages name the resource: "services", "endpointslices.discovery.k8s.io"."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """How 422 messages name the kind: "Service", "EndpointSlice.discovery.k8s.io"."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


NAMESPACE = ResourceType("", "v1", "Namespace", "namespaces", "namespace", False, ("ns",), True,
                         returns_deleted=True)
SERVICE = ResourceType("", "v1", "Service", "services", "service", True, ("svc",), True,
                       returns_deleted=True)
POD = ResourceType("", "v1", "Pod", "pods", "pod", True, ("po",), True, returns_deleted=True)
CONFIGMAP = ResourceType("", "v1", "ConfigMap", "configmaps", "configmap", True, ("cm",))
SECRET = ResourceType("", "v1", "Secret", "secrets", "secret", True)
EVENT = ResourceType("", "v1", "Event", "events", "event", True, ("ev",))
ENDPOINTSLICE = ResourceType(
    "discovery.k8s.io", "v1", "EndpointSlice", "endpointslices", "endpointslice", True
)
# Leases (leader election): plain namespaced objects, optimistic concurrency as for any
# kind (409 on a stale resourceVersion), MicroTime fields checked when decoded.
LEASE = ResourceType(
    "coordination.k8s.io", "v1", "Lease", "leases", "lease", True
)
VMI = ResourceType(
    "kubevirt.io", "v1", "VirtualMachineInstance", "virtualmachineinstances",
    "virtualmachineinstance", True, ("vmi", "vmis"), True, True,
)
VM = ResourceType(
    "kubevirt.io", "v1", "VirtualMachine", "virtualmachines", "virtualmachine", True,
    ("vm", "vms"), True, True,
)
VMPOOL = ResourceType(
    "pool.kubevirt.io", "v1beta1", "VirtualMachinePool", "virtualmachinepools",
    "virtualmachinepool", True, ("vmpool", "vmpools"), True, True,
)

EVENT_V1 = ResourceType("events.k8s.io", "v1", "Event", "events", "event", True, ("ev",))
SERVICEACCOUNT = ResourceType("", "v1", "ServiceAccount", "serviceaccounts", "serviceaccount",
                              True, ("sa",))
DEPLOYMENT = ResourceType("apps", "v1", "Deployment", "deployments", "deployment", True,
                          ("deploy",), True)
# the host agent's PodDisruptionBudget (issue 16), for `kubectl apply -k manifests/base`
PDB = ResourceType("policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets",
                   "poddisruptionbudget", True, ("pdb",), True)
NETWORKPOLICY = ResourceType("networking.k8s.io", "v1", "NetworkPolicy", "networkpolicies",
                             "networkpolicy", True, ("netpol",))
_RBAC = "rbac.authorization.k8s.io"
CLUSTERROLE = ResourceType(_RBAC, "v1", "ClusterRole", "clusterroles", "clusterrole", False)
CLUSTERROLEBINDING = ResourceType(_RBAC, "v1", "ClusterRoleBinding", "clusterrolebindings",
                                  "clusterrolebinding", False)
ROLE = ResourceType(_RBAC, "v1", "Role", "roles", "role", True)
ROLEBINDING = ResourceType(_RBAC, "v1", "RoleBinding", "rolebindings", "rolebinding", True)
_ADMISSION = "admissionregistration.k8s.io"
VAP = ResourceType(_ADMISSION, "v1", "ValidatingAdmissionPolicy",
                   "validatingadmissionpolicies", "validatingadmissionpolicy", False, (), True)
VAPB = ResourceType(_ADMISSION, "v1", "ValidatingAdmissionPolicyBinding",
                    "validatingadmissionpolicybindings", "validatingadmissionpolicybinding", False)
CRD = ResourceType("apiextensions.k8s.io", "v1", "CustomResourceDefinition",
                   "customresourcedefinitions", "customresourcedefinition", False,
                   ("crd", "crds"), True)

ALL_TYPES: tuple[ResourceType, ...] = (
    NAMESPACE, SERVICE, POD, CONFIGMAP, SECRET, EVENT, ENDPOINTSLICE, LEASE, VMI, VM, VMPOOL,
    EVENT_V1, SERVICEACCOUNT, DEPLOYMENT, PDB, NETWORKPOLICY, CLUSTERROLE,
    CLUSTERROLEBINDING, ROLE, ROLEBINDING, VAP, VAPB, CRD,
)

# Discovery: the version each group prefers (only one version per group here).
GROUP_VERSIONS: dict[str, str] = {}
for _t in ALL_TYPES:
    GROUP_VERSIONS.setdefault(_t.group, _t.version)


def find_type(group: str, version: str, plural: str) -> ResourceType | None:
    """A built-in kind by its path (CRD-defined kinds: TypeRegistry.find_type)."""
    return _find(ALL_TYPES, group, version, plural)


def find_kind(api_version: str, kind: str) -> ResourceType | None:
    """A built-in kind by apiVersion and kind (CRD-defined kinds: TypeRegistry)."""
    for t in ALL_TYPES:
        if t.api_version == api_version and t.kind == kind:
            return t
    return None


def types_in(group: str, version: str) -> list[ResourceType]:
    return [t for t in ALL_TYPES if t.group == group and t.version == version]


def _find(types: tuple[ResourceType, ...] | list[ResourceType], group: str, version: str,
          plural: str) -> ResourceType | None:
    for t in types:
        if t.group == group and t.version == version and t.plural == plural:
            return t
    return None


class TypeRegistry:
    """The kinds one server serves now: the built-ins plus those its CRDs define.

    A CRD's kind appears when the CRD is stored (and Established), changes with
    it, and goes when it is deleted, as the apiextensions apiserver's discovery
    and handlers do (crds.py keeps this in step with the stored CRDs).
    """

    def __init__(self) -> None:
        self._custom: dict[str, ResourceType] = {}  # key -> type

    def all(self) -> Iterator[ResourceType]:
        yield from ALL_TYPES
        yield from self._custom.values()

    def add(self, t: ResourceType) -> None:
        self._custom[t.key] = t

    def remove(self, key: str) -> ResourceType | None:
        return self._custom.pop(key, None)

    def custom(self) -> list[ResourceType]:
        return list(self._custom.values())

    def find_type(self, group: str, version: str, plural: str) -> ResourceType | None:
        return _find(list(self.all()), group, version, plural)

    def find_kind(self, api_version: str, kind: str) -> ResourceType | None:
        for t in self.all():
            if t.api_version == api_version and t.kind == kind:
                return t
        return None

    def types_in(self, group: str, version: str) -> list[ResourceType]:
        return [t for t in self.all() if t.group == group and t.version == version]

    def group_versions(self) -> dict[str, str]:
        """Each served group and its (only) version, built-ins first."""
        out: dict[str, str] = {}
        for t in self.all():
            out.setdefault(t.group, t.version)
        return out
