"""Debian's systemd-resolved for the recipe's "guest with systemd-resolved" scenario.

Why not ``apt-get install systemd-resolved``: on a first install its postinst turns
``/etc/resolv.conf`` into a symlink to ``/run/systemd/resolve/stub-resolv.conf``, which
only a running systemd-resolved service fills. On this machine (and CI's) systemd is not
PID 1, so the machine's own resolver would be gone for everything else, package
registries included; it also wants systemd itself upgraded to the same version. So the
two packages (``systemd-resolved`` and the ``libsystemd-shared`` of the same version) are
fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into a cache
directory; nothing is installed.

How a namespace "VM" runs it (:func:`resolved_argv`): in a private mount namespace, a
tmpfs over ``/run`` (its runtime directory, as systemd would provide) and our
``resolved.conf`` over ``/etc/systemd`` (``DNS=`` and ``Domains=``: what the guest's
DHCP lease would hand networkd); as an unprivileged user with the capabilities its unit
grants (it drops privileges itself only when started as root with a ``systemd-resolve``
user present); no D-Bus (it waits for the bus socket and serves DNS meanwhile). The
guest's ``/etc/resolv.conf`` is then what systemd generates as ``stub-resolv.conf``:
``nameserver 127.0.0.53``, ``options edns0 trust-ad`` and the search list.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CACHE = (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
         / "imex-ensemble" / "resolved")
PACKAGES = ("systemd-resolved", "libsystemd-shared")


class ResolvedError(Exception):
    """systemd-resolved could not be fetched or unpacked (the message says which step)."""


@dataclass(frozen=True)
class Resolved:
    version: str
    binary: Path
    libdir: Path


def _run(argv: list[str], cwd: Path | None = None, timeout: float = 300) -> str:
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                             check=True)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", "") or ""
        raise ResolvedError(f"{' '.join(argv)}: {e} {err.strip()[-500:]}") from e
    return out.stdout


def candidate_version() -> str | None:
    for line in _run(["apt-cache", "policy", "systemd-resolved"]).splitlines():
        key, _, value = line.strip().partition(":")
        if key == "Candidate":
            value = value.strip()
            return None if value in ("", "(none)") else value
    return None


def ensure_resolved(cache: Path = CACHE) -> Resolved:
    """The unpacked systemd-resolved (fetched once per version, then reused)."""
    version = candidate_version()
    if version is None:
        _run(["apt-get", "update", "-qq"], timeout=600)
        version = candidate_version()
    if version is None:
        raise ResolvedError("apt-cache knows no systemd-resolved candidate")
    root = cache / version.replace(":", "_")
    found = _locate(root, version)
    if found is not None:
        return found
    shutil.rmtree(root, ignore_errors=True)
    debs = root / "debs"
    debs.mkdir(parents=True)
    _run(["apt-get", "download", *(f"{p}={version}" for p in PACKAGES)], cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(root / "root")])
    (root / ".complete").write_text(version + "\n")
    found = _locate(root, version)
    if found is None:
        raise ResolvedError(f"no systemd-resolved binary or libsystemd-shared in {root}")
    return found


def _locate(root: Path, version: str) -> Resolved | None:
    if not (root / ".complete").exists():
        return None
    binaries = [p for p in (root / "root" / "lib" / "systemd" / "systemd-resolved",
                            root / "root" / "usr" / "lib" / "systemd" / "systemd-resolved")
                if p.is_file() and os.access(p, os.X_OK)]
    libs = list((root / "root").rglob("libsystemd-shared-*.so"))
    if not binaries or not libs:
        return None
    return Resolved(version, binaries[0], libs[0].parent)


def resolved_conf(dns: str, search: list[str]) -> str:
    """``/etc/systemd/resolved.conf`` for the guest: its lease's DNS server and domains."""
    return ("[Resolve]\n"
            f"DNS={dns}\n"
            f"Domains={' '.join(search)}\n"
            "LLMNR=no\nMulticastDNS=no\nDNSSEC=no\n")


def stub_resolv_conf(search: list[str]) -> str:
    """The guest's ``/etc/resolv.conf``: what systemd-resolved writes as stub-resolv.conf."""
    return f"nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch {' '.join(search)}\n"


def resolved_argv(res: Resolved, conf_dir: Path) -> list[str]:
    """argv (to run inside the VM's namespace) starting systemd-resolved as described in the
    module docstring; ``conf_dir`` holds ``resolved.conf``."""
    script = ("set -e; mount -t tmpfs -o mode=0755 tmpfs /run; "
              "mkdir -p /run/systemd/resolve /run/nobus; chown 65534:65534 /run/systemd/resolve; "
              'mount --bind "$0" /etc/systemd; '
              'export DBUS_SYSTEM_BUS_ADDRESS=unix:path=/run/nobus/socket LD_LIBRARY_PATH="$1"; '
              "exec setpriv --reuid=65534 --regid=65534 --clear-groups "
              "--inh-caps=+net_bind_service,+net_raw,+setpcap "
              '--ambient-caps=+net_bind_service,+net_raw,+setpcap "$2"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
            str(conf_dir), str(res.libdir), str(res.binary)]
