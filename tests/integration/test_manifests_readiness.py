"""Each layout's RBAC, as kubectl renders it, grants every right the agent's start-up checks
ask for with that layout's own flags (host_agent/kube/preflight.py), so the shipped
manifests make a ready agent.

The flags come from the rendered objects (the Deployment's args; the sidecar's command
as its pod runs it, with the launcher pod's hostname and namespace put in), the
decision from the API double's RBAC authorizer (tests/sandbox/kube_api/rbac.py, which
tests/realk8s/test_rbac_parity.py holds to kube-apiserver's answers) over the rendered
Roles, ClusterRoles and bindings. realk8s runs the agents themselves
(test_readiness.py, test_namespaced.py, test_sidecar.py).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from host_agent.cli import build_settings
from host_agent.kube.preflight import needed_rights
from host_agent.settings import HostSettings
from tests.sandbox.kube_api import rbac
from tests.sandbox.kube_api.store import Store

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def render(kubectl: str, directory: str) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl, "kustomize", str(MANIFESTS / directory)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def store_of(objs: list[dict[str, Any]]) -> Store:
    """A double's store holding the rendered namespaces and RBAC objects."""
    store = Store(crds=())
    namespaces = {o["metadata"].get("namespace") for o in objs} | {
        o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"}
    for ns in sorted(n for n in namespaces if n and n not in ("default", "kube-system")):
        t = store.types.find_kind("v1", "Namespace")
        assert t is not None
        store.create(t, None, {"apiVersion": "v1", "kind": "Namespace",
                               "metadata": {"name": ns}}, "test")
    for obj in objs:
        if obj["kind"] in RBAC_KINDS:
            t = store.types.find_kind(obj["apiVersion"], obj["kind"])
            assert t is not None
            store.create(t, obj["metadata"].get("namespace"), obj, "test")
    return store


def deployment_settings(objs: list[dict[str, Any]]) -> tuple[HostSettings, str, str]:
    dep = next(o for o in objs if o["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    ns = dep["metadata"]["namespace"]
    # in the pod, the agent's namespace is its service account's (settings.py)
    settings = build_settings(pod["containers"][0]["args"], {"IMEX_AGENT_NAMESPACE": ns})
    return settings, ns, pod["serviceAccountName"]


def sidecar_settings(objs: list[dict[str, Any]]) -> tuple[HostSettings, str, str]:
    pool = next(o for o in objs if o["kind"] == "VirtualMachinePool")
    ns = pool["metadata"]["namespace"]
    vmi = pool["spec"]["virtualMachineTemplate"]["spec"]["template"]
    (sidecar,) = json.loads(vmi["metadata"]["annotations"]["hooks.kubevirt.io/hookSidecars"])
    script = sidecar["command"][-1]
    # what the launcher pod's shell makes of it: its hostname is the VMI's name
    script = script.replace('"$(hostname)"', f"{pool['metadata']['name']}-0").replace(
        '"$(cat /var/run/secrets/kubernetes.io/serviceaccount/namespace)"', ns)
    argv = shlex.split(script)
    assert argv[:2] == ["exec", "imex-host-agent"]
    (account,) = [v["serviceAccount"]["serviceAccountName"] for v in vmi["spec"]["volumes"]
                  if "serviceAccount" in v]
    return build_settings(argv[2:], {"IMEX_AGENT_NAMESPACE": ns}), ns, account


LAYOUTS = {
    "base": deployment_settings,
    "overlays/namespaced": deployment_settings,
    "overlays/openshift": deployment_settings,
    "overlays/sidecar": sidecar_settings,
}


@pytest.mark.parametrize("directory", sorted(LAYOUTS))
def test_the_layouts_rbac_grants_what_its_agent_checks_for(directory: str,
                                                          machine_kubectl: str) -> None:
    objs = render(machine_kubectl, directory)
    settings, ns, account = LAYOUTS[directory](objs)
    store = store_of(objs)
    sa = store.objects[store.types.find_kind("v1", "ServiceAccount").key][(ns, account)]  # type: ignore[union-attr]
    who = rbac.service_account_identity(ns, account, sa.obj["metadata"]["uid"])
    needs = needed_rights(settings)
    assert needs, directory
    refused = [n.right.describe() for n in needs
               if not rbac.authorize(store, who, rbac.Attributes(
                   n.right.verb, n.right.group, n.right.resource, n.right.subresource,
                   n.right.namespace)).allowed]
    assert refused == [], f"{directory}: the agent would not be ready: RBAC refuses {refused}"
    if directory == "overlays/sidecar":
        assert settings.vmi == "gb200-0" and settings.hook_socket is not None
    else:
        assert settings.leader_elect and settings.vmi is None
