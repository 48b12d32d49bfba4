"""What the realnode tier adds to the host, and ``sweep``, which takes it away again.

The tier's names: the bridge ``rnode0`` (pods 10.241.0.0/24, its address 10.241.0.1 is the
node's and the apiserver's), Services 10.242.0.0/16, the nftables table
``inet imex-realnode``: for the run, traffic to either range (or from a pod) leaves by no
interface but the bridge and loopback. ``sweep`` removes by those names only, and what a
node work directory names (``/tmp/rk8s-*/node``): processes, the kubelet's ``kubepods``
cgroups, mounts, network namespaces holding a pod address, the bridge, the tables.

    python -m tests.realnode.host     # after a killed run (takes the tier's lock first)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.realk8s.harness import HarnessError

BRIDGE = "rnode0"
POD_CIDR = "10.241.0.0/16"
NODE_POD_CIDR = "10.241.0.0/24"
GATEWAY = "10.241.0.1"
SERVICE_CIDR = "10.242.0.0/16"
KUBERNETES_SERVICE_IP = "10.242.0.1"
NODE_NAME = "realnode"
GUARD_TABLE = "imex-realnode"
#: the sysctls the kubelet's container manager sets (setupKernelTunables)
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
                   "kernel/panic_on_oops", "kernel/keys/root_maxkeys",
                   "kernel/keys/root_maxbytes")
CNI_BIN = Path("/usr/lib/cni")
VAR_LOG_CONTAINERS = Path("/var/log/containers")
#: one realnode run per machine: the bridge, the guard table and the sweep go by name
LOCK = Path("/tmp/imex-realnode.lock")


def sh(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          check=False)
    if check and proc.returncode != 0:
        raise HarnessError(f"{' '.join(argv)} exited {proc.returncode}: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def guard_ruleset() -> str:
    """The nftables table that keeps the tier's addresses on its own bridge.

    One postrouting chain, for forwarded and local traffic alike: in the output hook
    the interface is the one routed before kube-proxy's DNAT (eth0 for a cluster IP),
    so a filter there would drop the host's own Service traffic; postrouting sees the
    interface the packet really leaves by."""
    ranges = f"{{ {POD_CIDR}, {SERVICE_CIDR} }}"
    keep = f'{{ "{BRIDGE}", "lo" }}'
    return (
        f"table inet {GUARD_TABLE} {{\n"
        "  chain postrouting {\n"
        "    type filter hook postrouting priority 10; policy accept;\n"
        f"    ip daddr {ranges} oifname != {keep} drop\n"
        f"    ip saddr {POD_CIDR} oifname != {keep} drop\n"
        "  }\n"
        "}\n")


def network_up() -> None:
    """The bridge with the gateway address (the apiserver binds it) and the guard."""
    sweep_network()
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    proc = subprocess.run(["nft", "-f", "-"], input=guard_ruleset(), capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise HarnessError(f"nft -f (guard table) failed: {proc.stderr.strip()}")


def sweep_network() -> None:
    """Bridge, guard table and kube-proxy's nftables tables: gone (each only if there)."""
    if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        sh("ip", "link", "del", BRIDGE, check=False)
    for family, table in (("inet", GUARD_TABLE), ("ip", "kube-proxy"), ("ip6", "kube-proxy")):
        if sh("nft", "list", "table", family, table, check=False).returncode == 0:
            sh("nft", "delete", "table", family, table, check=False)


def sweep_kube_chains() -> None:
    """KUBE-* chains in the host's iptables-nft tables and the rules that jump to them
    (the kubelet's and kube-proxy's utility chains, should one ever make them here)."""
    proc = sh("nft", "-j", "list", "ruleset", check=False)
    if proc.returncode != 0:
        return
    items = json.loads(proc.stdout).get("nftables", [])
    kube = {(c["family"], c["table"], c["name"]) for c in
            (i["chain"] for i in items if "chain" in i) if c["name"].startswith("KUBE-")}
    if not kube:
        return
    for rule in (i["rule"] for i in items if "rule" in i):
        text = json.dumps(rule["expr"])
        if any(f'"target": "{name}"' in text for fam, table, name in kube
               if (fam, table) == (rule["family"], rule["table"])):
            sh("nft", "delete", "rule", rule["family"], rule["table"], rule["chain"],
               "handle", str(rule["handle"]), check=False)
    for fam, table, name in kube:
        sh("nft", "flush", "chain", fam, table, name, check=False)
    for fam, table, name in kube:
        sh("nft", "delete", "chain", fam, table, name, check=False)


def _our_netns() -> list[str]:
    """Network namespaces (named, by CNI) that hold an address of the pod range."""
    out = []
    for name in sh("ip", "netns", "list", check=False).stdout.split("\n"):
        name = name.split(" ", 1)[0].strip()
        if not name:
            continue
        addrs = sh("ip", "-n", name, "-4", "-o", "addr", check=False).stdout
        if " 10.241." in addrs:
            out.append(name)
    return out


def sweep(workdir: Path | None = None) -> None:
    """Remove what a run left, by name: never anything that is not the tier's."""
    tmp = Path("/tmp")
    dirs = [workdir] if workdir else [p for p in tmp.glob("rk8s-*/node") if p.is_dir()]
    # processes naming a node work directory (containerd, shims, kubelet), by pid
    me = os.getpid()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == me:
            continue
        try:
            cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(str(d) in cmd for d in dirs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid_dir.name), signal.SIGKILL)
    # containers' processes and the kubelet's cgroups (kubepods under every v1 hierarchy)
    cgroot = Path("/sys/fs/cgroup")
    for hier in sorted(cgroot.iterdir()) if cgroot.is_dir() else []:
        top = hier / "kubepods"
        if not top.is_dir():
            continue
        groups = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for g in [*groups, top]:
            with contextlib.suppress(OSError):
                for pid in (g / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.2)
        for g in [*groups, top]:
            with contextlib.suppress(OSError):
                g.rmdir()
    # mounts under the work directories, deepest first
    for d in dirs:
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for m in sorted((m for m in mounts if m.startswith(str(d))), key=len, reverse=True):
            sh("umount", "-l", m, check=False)
    for ns in _our_netns():
        sh("ip", "netns", "del", ns, check=False)
    for d in dirs:
        if (d / "made-var-log-containers").exists():
            with contextlib.suppress(OSError):
                VAR_LOG_CONTAINERS.rmdir()
    sweep_network()
    sweep_kube_chains()
    if workdir is None:  # a killed run's directory: nothing of it runs or is mounted now
        for d in dirs:
            shutil.rmtree(d.parent, ignore_errors=True)


if __name__ == "__main__":  # python -m tests.realnode.host: clean up after a killed run
    import fcntl

    with LOCK.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"a realnode run holds {LOCK}: not sweeping under it") from None
        sweep()
