"""A real node beside the realk8s control plane: containerd v2 + runc, kubelet,
kube-proxy (nftables mode) and kube-scheduler, pods on a bridge of their own.

What this machine needs (tests/realk8s/README.md "A real node"):

* cgroups are v1 with a v2 ``unified`` mount and PID 1 is not systemd: cgroupfs
  everywhere (containerd's runc ``SystemdCgroup = false``, the kubelet's
  ``cgroupDriver: cgroupfs``) and ``failCgroupV1: false``;
* the kubelet would set six kernel sysctls at start (``vm.overcommit_memory=1``,
  ``kernel.panic_on_oops=1``, ...) on a machine others share: it runs in a mount
  namespace of its own where those ``/proc/sys`` files are bind mounts of private
  copies, so the host's values never change. Its root directory is a shared mount,
  so the volumes it mounts there still reach containerd and runc;
* no process holds CAP_SYS_RESOURCE, so none may lower its ``oom_score_adj`` (runc
  cannot give a sandbox the kubelet's -998): containerd's ``restrict_oom_score_adj``;
* the apiserver is given the bridge's address (pods cannot reach loopback);
* pods and Services have ranges and a bridge of their own, guarded (tests/realnode/host.py).

Every path the components write is under the work directory (containerd's root, state
and shim sockets, runc's root, the kubelet's root and pod logs, CNI's IPAM); ``stop``
removes the pods first (so the kubelet tears down sandboxes, volumes and networks),
stops every process, then ``host.sweep`` removes whatever is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.realk8s.harness import ControlPlane, HarnessError, Proc, free_port, wait_until
from tests.realnode.host import (
    BRIDGE,
    CNI_BIN,
    GATEWAY,
    KUBELET_SYSCTLS,
    NODE_NAME,
    NODE_POD_CIDR,
    POD_CIDR,
    VAR_LOG_CONTAINERS,
    sh,
    sweep,
)

CONTROLLERS = ("garbage-collector-controller,namespace-controller,"
               "clusterrole-aggregation-controller,deployment-controller,"
               "replicaset-controller,endpointslice-controller,serviceaccount-controller,"
               "root-ca-certificate-publisher-controller,disruption-controller,"
               "node-lifecycle-controller")


def cni_config(workdir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "imex-realnode",
        "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
            "hairpinMode": True,
            "ipam": {"type": "host-local", "dataDir": str(workdir / "cni-ipam"),
                     "ranges": [[{"subnet": NODE_POD_CIDR, "gateway": GATEWAY}]],
                     "routes": [{"dst": "0.0.0.0/0"}]},
        }],
    }


def containerd_config(workdir: Path, bin_dir: Path, sandbox_image: str) -> str:
    c = workdir / "containerd"
    return f"""version = 3
root = "{c / 'root'}"
state = "{c / 'state'}"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs"]

[grpc]
  address = "{c / 'containerd.sock'}"

[ttrpc]
  address = "{c / 'containerd.sock.ttrpc'}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{c / 'opt'}"

[plugins.'io.containerd.shim.v1.manager']
  socket_dir = "{c / 's'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{sandbox_image}"

[plugins.'io.containerd.cri.v1.runtime']
  # no process here holds CAP_SYS_RESOURCE, so none may lower its oom_score_adj below 0
  # (runc init: "failed to update /proc/self/oom_score_adj: Permission denied" for the
  # kubelet's -998 on a sandbox): clamp to containerd's own score, as rootless setups do
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{bin_dir / 'runc'}"
        Root = "{c / 'runc'}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{workdir / 'cni'}"
    max_conf_num = 1
"""


@dataclass
class Node:
    """One node named ``NODE_NAME`` for the control plane ``cp``."""

    cp: ControlPlane
    node_bin: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    startup_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def workdir(self) -> Path:
        return self.cp.workdir / "node"

    @property
    def containerd_sock(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    @property
    def ctr(self) -> list[str]:
        return [str(self.node_bin / "ctr"), "--address", str(self.containerd_sock),
                "-n", "k8s.io"]

    # ---- lifecycle
    def start(self) -> None:
        """containerd, kubelet (Node Ready), kube-proxy, kube-scheduler; the bridge and
        the guard table must exist already (``network_up``, before the apiserver)."""
        t0 = time.monotonic()
        try:
            for step in (self._start_containerd, self._start_kubelet, self._start_kube_proxy,
                         self._start_scheduler):
                t = time.monotonic()
                step()
                self.startup_seconds[step.__name__.removeprefix("_start_")] = (
                    time.monotonic() - t)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds["total"] = time.monotonic() - t0

    def stop(self) -> None:
        """Every pod away first (the kubelet stops sandboxes, unmounts volumes, frees
        addresses), then the processes, then ``sweep`` for anything left."""
        with contextlib.suppress(Exception):
            if "kubelet" in self.procs and self.procs["kubelet"].alive():
                self._drain_pods()
        for name in ("kube-scheduler", "kube-proxy", "kubelet"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop(grace=15)
        self._kill_tasks()
        proc = self.procs.pop("containerd", None)
        if proc is not None:
            proc.stop(grace=15)
        sweep(self.workdir)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = self.cp._spawn(name, argv, env)  # the control plane's logs dir and pdeathsig
        self.procs[name] = proc
        return proc

    # ---- containerd
    def _start_containerd(self) -> None:
        from tests.realnode.images import sandbox_ref

        for d in ("containerd", "cni", "cni-ipam", "kubelet", "pod-logs", "sysctl",
                  "var-log-containers"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        (self.workdir / "cni" / "10-imex-realnode.conflist").write_text(
            json.dumps(cni_config(self.workdir), indent=2))
        conf = self.workdir / "containerd" / "config.toml"
        conf.write_text(containerd_config(self.workdir, self.node_bin,
                                          sandbox_ref(self.node_bin)))
        env = {"PATH": f"{self.node_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        proc = self._spawn("containerd", [str(self.node_bin / "containerd"), "--config",
                                          str(conf), "--log-level", "info"], env)

        def up() -> bool:
            return sh(*self.ctr, "version", check=False, timeout=10).returncode == 0

        self.cp._await(proc, "containerd answering ctr version", up, 60)
        from tests.realnode.images import ctr_import, single_binary_archive

        archive = single_binary_archive(self.node_bin / "pause", sandbox_ref(self.node_bin),
                                        self.workdir / "pause.tar")
        ctr_import(self.node_bin / "ctr", self.containerd_sock, archive)

    def _kill_tasks(self) -> None:
        """Whatever containers containerd still runs (a failed drain): killed, deleted."""
        if "containerd" not in self.procs or not self.procs["containerd"].alive():
            return
        out = sh(*self.ctr, "tasks", "ls", "-q", check=False, timeout=20).stdout.split()
        for task in out:
            sh(*self.ctr, "tasks", "kill", "-s", "SIGKILL", task, check=False, timeout=20)
        for task in out:
            sh(*self.ctr, "tasks", "delete", "-f", task, check=False, timeout=20)

    # ---- kubelet
    def _kubelet_config(self) -> Path:
        port, healthz = free_port(), free_port()
        self.kubelet_healthz = healthz
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "address": GATEWAY,
            "port": port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            # the apiserver reaches the kubelet (exec) without a client certificate here;
            # the kubelet listens on the bridge address only
            "authentication": {"anonymous": {"enabled": True},
                               "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "podLogsDir": str(self.workdir / "pod-logs"),
            "resolvConf": "/etc/resolv.conf",
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%",
                             "imagefs.available": "2%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "shutdownGracePeriod": "0s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
            "serializeImagePulls": False,
            "registerNode": True,
            # no KUBE-FIREWALL / canary chains in the host's shared iptables tables
            "makeIPTablesUtilChains": False,
        }
        path = self.workdir / "kubelet-config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def _kubelet_wrapper(self) -> list[str]:
        """A mount namespace of the kubelet's own: the sysctls it would set are private
        copies, /var/log/containers is ours; its root dir a shared mount first."""
        root = self.workdir / "kubelet"
        sh("mount", "--bind", str(root), str(root))
        sh("mount", "--make-shared", str(root))
        lines = ["set -eu", "mount --make-rprivate /proc"]
        for name in KUBELET_SYSCTLS:
            fake = self.workdir / "sysctl" / name.replace("/", ".")
            lines += [f"cat /proc/sys/{name} > {fake}", f"mount --bind {fake} /proc/sys/{name}"]
        # the kubelet's container log links: a directory of ours over the host's (made
        # here when the host has none, and removed again by sweep)
        if not VAR_LOG_CONTAINERS.is_dir():
            VAR_LOG_CONTAINERS.mkdir(parents=True)
            (self.workdir / "made-var-log-containers").touch()
        lines.append(f"mount --bind {self.workdir / 'var-log-containers'} {VAR_LOG_CONTAINERS}")
        lines.append('exec "$@"')
        return ["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c",
                "\n".join(lines), "kubelet-ns"]

    def _start_kubelet(self) -> None:
        kc = self.cp.admin_kubeconfig
        argv = [*self._kubelet_wrapper(), str(self.node_bin / "kubelet"),
                f"--config={self._kubelet_config()}", f"--kubeconfig={kc}",
                f"--root-dir={self.workdir / 'kubelet'}",
                f"--cert-dir={self.workdir / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}", f"--node-ip={GATEWAY}", "--v=1"]
        proc = self._spawn("kubelet", argv)

        def ready() -> bool:
            assert self.cp.admin is not None
            resp = self.cp.admin.request("GET", f"/api/v1/nodes/{NODE_NAME}")
            if resp.status_code != 200:
                return False
            conds = resp.json().get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        self.cp._await(proc, f"node {NODE_NAME} Ready", ready, 180)

    # ---- kube-proxy
    def _start_kube_proxy(self) -> None:
        healthz, metrics = free_port(), free_port()
        cfg = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.cp.admin_kubeconfig)},
            "mode": "nftables",
            "hostnameOverride": NODE_NAME,
            "bindAddress": GATEWAY,
            "clusterCIDR": POD_CIDR,
            "healthzBindAddress": f"127.0.0.1:{healthz}",
            "metricsBindAddress": f"127.0.0.1:{metrics}",
            "nodePortAddresses": [f"{GATEWAY}/32"],
            # leave the host's conntrack sysctls alone
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }
        path = self.workdir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = self._spawn("kube-proxy", [str(self.node_bin / "kube-proxy"),
                                          f"--config={path}", "--v=1"])

        def healthy() -> bool:
            import httpx

            return httpx.get(f"http://127.0.0.1:{healthz}/healthz", timeout=2).status_code == 200

        self.cp._await(proc, "kube-proxy /healthz", healthy, 90)

    # ---- kube-scheduler
    def _start_scheduler(self) -> None:
        port = free_port()
        kc = str(self.cp.admin_kubeconfig)
        proc = self._spawn("kube-scheduler", [
            str(self.node_bin / "kube-scheduler"), f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={port}",
            "--v=1"])

        def healthy() -> bool:
            import httpx

            r = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2)
            return r.status_code == 200

        self.cp._await(proc, "kube-scheduler /healthz", healthy, 90)

    # ---- teardown helpers
    def _drain_pods(self, timeout: float = 90) -> None:
        """Delete every Deployment, ReplicaSet and pod (the tier owns the cluster), then
        wait until containerd runs no task."""
        assert self.cp.admin is not None
        api = self.cp.admin
        for item in api.get("/api/v1/namespaces")["items"]:
            ns = item["metadata"]["name"]
            for kind in ("deployments", "replicasets"):
                api.request("DELETE", f"/apis/apps/v1/namespaces/{ns}/{kind}")
            api.request("DELETE", f"/api/v1/namespaces/{ns}/pods",
                        params={"gracePeriodSeconds": "5"})

        def empty() -> bool:
            pods = api.get("/api/v1/pods")["items"]
            tasks = sh(*self.ctr, "tasks", "ls", "-q", check=False, timeout=20).stdout.split()
            return not pods and not tasks

        with contextlib.suppress(HarnessError):
            wait_until(empty, "every pod and task gone", timeout)
