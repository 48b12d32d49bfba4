"""A Deployment's pod spec as ``podman run`` flags: what a kubelet would give the container.

Pure: no I/O. tests/realk8s/test_image.py runs the built image with these flags, so the
container gets the uid and gid, the read-only root, the emptyDir, the capabilities, the
limits, the environment and the arguments of the *rendered* manifest, not a copy typed
into the test. Every field of the pod spec and of the container is either translated or
named below as having no effect on one machine (scheduling, probes the test performs
itself); any other field raises :class:`PodSpecError`, so a manifest change the
translation does not know fails the test instead of being dropped.

What a kubelet adds and the manifest does not say is passed in: the pod's metadata (for
``fieldRef``), the ``KUBERNETES_SERVICE_HOST``/``PORT`` every container gets (also with
``enableServiceLinks: false``), and the directory holding the ServiceAccount's token,
CA and namespace, mounted where the kubelet mounts it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

SA_MOUNT: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
#: pod spec fields that only place the pod (one machine here) or name its identity
#: (handled by the caller: the token it mints is this ServiceAccount's)
POD_IGNORED: Final = frozenset({"topologySpreadConstraints", "affinity", "nodeSelector",
                                "tolerations", "priorityClassName", "serviceAccountName"})
#: container fields the test performs itself (probes) or that only schedule (requests)
CONTAINER_IGNORED: Final = frozenset({"name", "livenessProbe", "readinessProbe", "ports",
                                      "image", "startupProbe"})
_UNITS: Final = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "k": 1000, "M": 1000**2,
                 "G": 1000**3, "": 1}


class PodSpecError(ValueError):
    """A field this translation does not know; the message names it."""


@dataclass(frozen=True)
class Kubelet:
    """What the kubelet supplies: the pod's metadata, the API's address, the token dir."""

    pod_name: str
    namespace: str
    api_host: str
    api_port: int
    token_dir: str


def quantity_bytes(text: str) -> int:
    """``"512Mi"`` -> 536870912 (the binary and decimal suffixes a manifest uses)."""
    m = re.fullmatch(r"(\d+)([KMG]i|[kMG]|)", str(text))
    if m is None:
        raise PodSpecError(f"quantity {text!r}: expected digits and Ki/Mi/Gi/k/M/G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def quantity_cpus(text: str) -> str:
    """``"1"`` -> ``"1"``, ``"500m"`` -> ``"0.5"`` (podman's --cpus)."""
    m = re.fullmatch(r"(\d+)(m?)", str(text))
    if m is None:
        raise PodSpecError(f"cpu {text!r}: expected cores or millicores")
    return str(int(m.group(1)) / 1000) if m.group(2) else m.group(1)


def _known(where: str, obj: Mapping[str, Any], known: set[str] | frozenset[str]) -> None:
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise PodSpecError(f"{where}: no podman translation for {', '.join(unknown)}")


def env_flags(container: Mapping[str, Any], kubelet: Kubelet) -> list[str]:
    """``-e NAME=VALUE`` for the container's env (values and the pod's fieldRefs) and the
    API address the kubelet adds."""
    fields = {"metadata.name": kubelet.pod_name, "metadata.namespace": kubelet.namespace}
    out: list[str] = []
    for var in container.get("env") or []:
        _known(f"env {var.get('name')}", var, {"name", "value", "valueFrom"})
        if "value" in var:
            value = str(var["value"])
        else:
            ref = (var.get("valueFrom") or {}).get("fieldRef") or {}
            path = ref.get("fieldPath")
            if path not in fields:
                raise PodSpecError(f"env {var['name']}: valueFrom {var.get('valueFrom')} "
                                   f"(known: fieldRef {', '.join(fields)})")
            value = fields[path]
        out += ["-e", f"{var['name']}={value}"]
    return [*out, "-e", f"KUBERNETES_SERVICE_HOST={kubelet.api_host}",
            "-e", f"KUBERNETES_SERVICE_PORT={kubelet.api_port}"]


def security_flags(pod_sc: Mapping[str, Any], sc: Mapping[str, Any]) -> list[str]:
    """User, root filesystem, capabilities, privilege escalation, seccomp."""
    _known("pod securityContext", pod_sc,
           {"runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile"})
    _known("container securityContext", sc,
           {"allowPrivilegeEscalation", "readOnlyRootFilesystem", "runAsNonRoot",
            "runAsUser", "runAsGroup", "capabilities", "seccompProfile"})
    merged = {**pod_sc, **sc}  # the container's own values win, as in Kubernetes
    if "runAsUser" not in merged:
        raise PodSpecError("no runAsUser: the image's USER would decide, not the manifest")
    uid, gid = int(merged["runAsUser"]), int(merged.get("runAsGroup", merged["runAsUser"]))
    if merged.get("runAsNonRoot") and uid == 0:
        raise PodSpecError("runAsNonRoot with runAsUser 0: the kubelet refuses to start it")
    out = ["--user", f"{uid}:{gid}"]
    if merged.get("readOnlyRootFilesystem"):
        # podman's --read-only adds tmpfs on /tmp, /run and /var/tmp; a pod gets none
        out += ["--read-only", "--read-only-tmpfs=false"]
    caps = merged.get("capabilities") or {}
    _known("capabilities", caps, {"drop", "add"})
    out += [f"--cap-drop={c.lower()}" for c in caps.get("drop") or []]
    out += [f"--cap-add={c.lower()}" for c in caps.get("add") or []]
    if merged.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    seccomp = (merged.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        out += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":  # RuntimeDefault: podman's default profile
        raise PodSpecError(f"seccompProfile {seccomp!r}: only RuntimeDefault or Unconfined")
    return out


def volume_flags(spec: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    """emptyDirs as tmpfs mounts of their sizeLimit (mode 0777, as the kubelet makes
    them); no other volume kind is known."""
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    out: list[str] = []
    for mount in container.get("volumeMounts") or []:
        _known(f"volumeMount {mount.get('name')}", mount, {"name", "mountPath", "readOnly"})
        vol = volumes.get(mount["name"])
        if vol is None:
            raise PodSpecError(f"volumeMount {mount['name']}: no such volume")
        _known(f"volume {vol['name']}", vol, {"name", "emptyDir"})
        ed = vol["emptyDir"] or {}
        _known(f"emptyDir {vol['name']}", ed, {"sizeLimit", "medium"})
        opts = ["ro" if mount.get("readOnly") else "rw", "mode=0777"]
        if "sizeLimit" in ed:
            opts.append(f"size={quantity_bytes(ed['sizeLimit'])}")
        out += ["--tmpfs", f"{mount['mountPath']}:{','.join(opts)}"]
    return out


def run_flags(pod_spec: Mapping[str, Any], kubelet: Kubelet) -> list[str]:
    """``podman run`` flags (no image, no arguments) for the pod's only container."""
    _known("pod spec", pod_spec, POD_IGNORED | {
        "containers", "volumes", "securityContext", "automountServiceAccountToken",
        "enableServiceLinks", "terminationGracePeriodSeconds"})
    (container,) = pod_spec["containers"]
    _known(f"container {container.get('name')}", container, CONTAINER_IGNORED | {
        "imagePullPolicy", "args", "command", "env", "resources", "securityContext",
        "volumeMounts"})
    if container.get("imagePullPolicy", "IfNotPresent") not in ("IfNotPresent", "Never"):
        raise PodSpecError(f"imagePullPolicy {container['imagePullPolicy']}: the image is "
                           "a local build, nothing can be pulled")
    if pod_spec.get("enableServiceLinks", True):
        raise PodSpecError("enableServiceLinks: every Service's variables would be needed")
    out = ["--pull=never", *security_flags(pod_spec.get("securityContext") or {},
                                           container.get("securityContext") or {})]
    out += volume_flags(pod_spec, container)
    if pod_spec.get("automountServiceAccountToken", True):
        out += ["-v", f"{kubelet.token_dir}:{SA_MOUNT}:ro"]
    limits = (container.get("resources") or {}).get("limits") or {}
    _known("resources.limits", limits, {"memory", "cpu"})
    if "memory" in limits:
        out += ["--memory", str(quantity_bytes(limits["memory"]))]
    if "cpu" in limits:
        out += ["--cpus", quantity_cpus(limits["cpu"])]
    out += ["--stop-timeout", str(pod_spec.get("terminationGracePeriodSeconds", 30))]
    out += env_flags(container, kubelet)
    if container.get("command"):
        out += ["--entrypoint", container["command"][0]]
    return out


def run_args(container: Mapping[str, Any]) -> list[str]:
    """The arguments after the image: ``command[1:]`` then ``args``."""
    return [*(container.get("command") or [])[1:], *(container.get("args") or [])]


def registry_port(container: Mapping[str, Any]) -> int:
    """The containerPort the readiness probe names (by port name or number)."""
    port = container["readinessProbe"]["httpGet"]["port"]
    for p in container.get("ports") or []:
        if port in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    raise PodSpecError(f"readinessProbe port {port!r} is none of the container's ports")


def on_host_network(args: list[str], container: Mapping[str, Any], listen: str) -> list[str]:
    """``args`` with ``--listen=HOST:PORT`` moved to ``listen``: on the machine's network
    (``--network=host``) the pod's port is the machine's, so it moves to a free loopback
    one. The flag must listen on the port the probes name, and must be there exactly once."""
    found = [a for a in args if a.startswith("--listen=")]
    if len(found) != 1:
        raise PodSpecError(f"expected one --listen=HOST:PORT in {args}")
    port = int(found[0].rsplit(":", 1)[1])
    if port != registry_port(container):
        raise PodSpecError(f"{found[0]} is not the probes' port {registry_port(container)}")
    return [f"--listen={listen}" if a == found[0] else a for a in args]


def tls_on_loopback(args: list[str], port: int) -> list[str]:
    """``args`` with the registry's HTTPS listener (``--tls-listen=HOST:PORT``) moved to
    ``127.0.0.1:port``: processes sharing the machine's network cannot all bind the
    pod's 8443. Args without the flag come back unchanged."""
    return [f"--tls-listen=127.0.0.1:{port}" if a.startswith("--tls-listen=") else a
            for a in args]
