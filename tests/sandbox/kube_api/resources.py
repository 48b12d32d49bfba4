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
"""

from __future__ import annotations

from dataclasses import dataclass


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

ALL_TYPES: tuple[ResourceType, ...] = (
    NAMESPACE, SERVICE, POD, CONFIGMAP, SECRET, EVENT, ENDPOINTSLICE, VMI, VM, VMPOOL,
)

# Discovery: the version each group prefers (only one version per group here).
GROUP_VERSIONS: dict[str, str] = {}
for _t in ALL_TYPES:
    GROUP_VERSIONS.setdefault(_t.group, _t.version)


def find_type(group: str, version: str, plural: str) -> ResourceType | None:
    for t in ALL_TYPES:
        if t.group == group and t.version == version and t.plural == plural:
            return t
    return None


def find_kind(api_version: str, kind: str) -> ResourceType | None:
    for t in ALL_TYPES:
        if t.api_version == api_version and t.kind == kind:
            return t
    return None


def types_in(group: str, version: str) -> list[ResourceType]:
    return [t for t in ALL_TYPES if t.group == group and t.version == version]
