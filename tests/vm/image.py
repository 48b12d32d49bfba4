"""The guest image: Debian bookworm from Debian's packages, built once and cached.

TEST HARNESS, never product code. Two cache levels under
``${IMEX_VM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/imex-ensemble/vm}``:

* ``base-<sha>/``: ``rootfs.tar`` from ``mmdebstrap --variant=minbase`` plus the kernel and
  initrd copied out of it (direct kernel boot). ``<sha>`` hashes the suite, the variant and
  the package list, so a new package rebuilds it (about 2 minutes with a warm apt cache,
  longer on 2 busy cores) and nothing else does.
* ``disk-<sha>/disk.img``: the ext4 root disk (``mkfs.ext4 -d``) made from that tarball
  plus the *overlay*: the IMEX stand-in installed as a vendor package would install it
  (``/usr/bin/nvidia-imex``, ``/usr/bin/nvidia-imex-ctl``, ``nvidia-imex.service``, not
  enabled). ``<sha>`` hashes the base key and the overlay's bytes, so editing the stand-in
  costs one ``mkfs`` (seconds), not a new debootstrap.

Why the stand-in is baked into the image and not sent by cloud-init: on a GPU node it comes
with NVIDIA's driver packages, never from the user-data, and the generated user-data only
enables and restarts an ``nvidia-imex.service`` that the image already has. Putting it in
the image keeps the seed exactly the generator's output.

The suite is pinned (``bookworm``) instead of following the host (FACTS.md: a machine may
run Debian 12 or 13). No mirror is written here: mmdebstrap takes the host's apt sources for
the suite, or ``IMEX_VM_MIRROR`` when set.

Concurrency: a build holds an exclusive ``flock`` on ``<cache>/.lock-<entry>``; a second run
building the same entry waits and then finds the finished result, while other guests'
entries build in parallel. Results appear by ``rename`` only once complete, so a
killed build leaves no half-written cache entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.sandbox.ctl_build import CtlBuildError, guest_ctl
from tests.vm.binfmt import foreign_arch

log = logging.getLogger("vm.image")

REPO_ROOT = Path(__file__).resolve().parents[2]
VARIANT = "minbase"
#: what every guest needs: systemd as init, cloud-init and the python3 it runs on (and
#: nothing else of Python: no python3-venv, no pip, as in stock cloud images; the generated
#: user-data must cope), iproute2 and a DHCP client (ifupdown + isc-dhcp-client: cloud-init's
#: Debian renderer), qemu-guest-agent (the harness reads guest files through it, as KubeVirt
#: reads guest info), procps for ps/pgrep. The kernel comes per architecture.
COMMON_PACKAGES = (
    "systemd-sysv", "udev", "dbus", "kmod", "cloud-init", "python3", "iproute2",
    "ifupdown", "isc-dhcp-client", "netbase", "procps", "qemu-guest-agent",
)


@dataclass(frozen=True)
class GuestOs:
    """One guest of the matrix: Debian suite and architecture, and how QEMU boots it."""

    suite: str
    major: int
    arch: str
    #: the suite's python3 (what the wheelhouse must serve this guest)
    python: str
    #: a root for chroot tests only: these packages, no kernel (None: a bootable guest)
    only: tuple[str, ...] | None = None

    @property
    def id(self) -> str:
        """The matrix's guest id: ``debian-<major>-<arch>``."""
        return f"debian-{self.major}-{self.arch}"

    @property
    def packages(self) -> tuple[str, ...]:
        if self.only is not None:
            return self.only
        return (*COMMON_PACKAGES, f"linux-image-{self.arch}")

    @property
    def bootable(self) -> bool:
        return self.only is None

    @property
    def console(self) -> str:
        # -M virt's serial port is a PL011 (ttyAMA0); q35's is a 16550 (ttyS0)
        return "ttyAMA0" if self.arch == "arm64" else "ttyS0"


BOOKWORM_AMD64 = GuestOs("bookworm", 12, "amd64", "3.11")
BOOKWORM_ARM64 = GuestOs("bookworm", 12, "arm64", "3.11")
TRIXIE_AMD64 = GuestOs("trixie", 13, "amd64", "3.13")
GUESTS = {g.id: g for g in (BOOKWORM_AMD64, TRIXIE_AMD64, BOOKWORM_ARM64)}
#: Debian 11's python3 is 3.9, below the floor: the installer's refusal on a real old Python
BULLSEYE_PYTHON = GuestOs("bullseye", 11, "amd64", "3.9", only=("python3",))

#: initramfs-tools inside the image: only the modules a virtio guest boots from. The
#: default (MODULES=most) runs modprobe/modinfo for thousands of modules, which under
#: qemu-user (the arm64 image) took most of a 40-minute build; a smaller initrd also
#: boots faster under TCG. Written before any package is installed (mmdebstrap hook).
INITRAMFS_CONF = "MODULES=list\nCOMPRESS=gzip\n"
INITRAMFS_HOOK = """\
#!/bin/sh
# imex-ensemble vm test image (tests/vm/image.py): the virtio guest's boot modules
[ "$1" = prereqs ] && exit 0
. /usr/share/initramfs-tools/hook-functions
manual_add_modules virtio_pci virtio_blk virtio_net virtio_console virtio_rng ext4
"""
#: ``update-initramfs`` while the image is built: the kernel's postinst creates the initrd
#: (``-c``) once every package is unpacked, so a ``-u`` (initramfs-tools' own trigger,
#: activated by its postinst, udev's and kmod's) would build the same initrd again; under
#: qemu-user that second build took 34 of an arm64 base's 406 s (2026-12-06). Diverted in
#: after the essential packages, removed before the tarball (``_build_wrapper_hooks``).
UPDATE_INITRAMFS_WRAPPER = """\
#!/bin/sh
# imex-ensemble vm test image build only (tests/vm/image.py): removed before the tarball
case " $* " in *" -u "*) echo "update-initramfs: -u skipped during the image build"; exit 0;; esac
exec /usr/sbin/update-initramfs.real "$@"
"""
#: ``update-ca-certificates`` while the image is built: ca-certificates' postinst rebuilds
#: ``/etc/ssl/certs`` without hooks and defers a full run to its own trigger, which then
#: walks all 148 certificates again to add nothing ("0 added, 0 removed"): 21 of an arm64
#: base's 406 s under qemu-user (2026-12-06). A plain call is skipped only when nothing the
#: tool reads or writes changed since its last run and no hook is installed (a hook is what
#: the deferred run is for); any other call, or any change, runs the real script.
UPDATE_CA_WRAPPER = """\
#!/bin/sh
# imex-ensemble vm test image build only (tests/vm/image.py): removed before the tarball
stamp=/var/lib/imex-build-ca-certificates.stamp
state() {
  find /etc/ca-certificates.conf /usr/share/ca-certificates /usr/local/share/ca-certificates \\
    /etc/ssl/certs /etc/ca-certificates/update.d -printf '%p %l %s %T@\\n' 2>/dev/null |
    LC_ALL=C sort | cksum
}
if [ $# -eq 0 ] && [ -f "$stamp" ] && [ -z "$(ls -A /etc/ca-certificates/update.d 2>/dev/null)" ] \\
   && [ "$(state)" = "$(cat "$stamp")" ]; then
  echo "update-ca-certificates: nothing changed since its last run, skipped during the image build"
  exit 0
fi
/usr/sbin/update-ca-certificates.real "$@" || exit $?
state > "$stamp"
"""
#: what the base build diverts while it runs: target -> (wrapper file name, wrapper text)
BUILD_WRAPPERS = {
    "/usr/sbin/update-initramfs": ("update-initramfs", UPDATE_INITRAMFS_WRAPPER),
    "/usr/sbin/update-ca-certificates": ("update-ca-certificates", UPDATE_CA_WRAPPER),
}
#: files the wrappers leave in the root, removed with them
BUILD_LEFTOVERS = ("/var/lib/imex-build-ca-certificates.stamp",)
#: the suite today's scenario boots (pinned, not the host's: FACTS.md)
SUITE = BOOKWORM_AMD64.suite
PACKAGES = BOOKWORM_AMD64.packages
DISK_SIZE = "3G"
STANDIN_IMEX = REPO_ROOT / "tests" / "sandbox" / "imex_standin.py"

#: the stand-in's unit, shaped like the one NVIDIA ships (Type=forking, config via -c); the
#: state file is the stand-in's test hook (peers, counters) and lives in /run
IMEX_UNIT = """\
# nvidia-imex.service (TEST STAND-IN: tests/sandbox/imex_standin.py as /usr/bin/nvidia-imex)
[Unit]
Description=NVIDIA IMEX service (stand-in)
Wants=network-online.target
After=network-online.target

[Service]
Type=forking
RuntimeDirectory=nvidia-imex
RuntimeDirectoryPreserve=yes
PIDFile=/run/nvidia-imex/nvidia-imex.pid
ExecStart=/usr/bin/nvidia-imex -c /etc/nvidia-imex/config.cfg \
--pid-file /run/nvidia-imex/nvidia-imex.pid --state-file /run/nvidia-imex/state.json
TimeoutStartSec=60
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
"""


#: image-level cloud-init defaults, as a cloud image vendor ships them in cloud.cfg.d (user-data
#: still overrides every key): only the NoCloud datasource (no probing of others) and the C.UTF-8
#: locale, which needs no generation (minbase has no ``locales``; en_US.UTF-8 failed cc_locale).
#: cloud-init validates the merged config, so every value here must pass its schema.
CLOUD_CFG = """\
# imex-ensemble vm test image defaults (tests/vm/image.py); user-data overrides these
datasource_list: [NoCloud, None]
locale: C.UTF-8
"""


class ImageError(Exception):
    """Building the guest image failed; the message holds the tool's last output lines."""


@dataclass(frozen=True)
class Image:
    """A ready image: the shared read-only root disk and the kernel/initrd to boot it."""

    disk: Path
    kernel: Path
    initrd: Path
    base_key: str
    disk_key: str
    guest: GuestOs = BOOKWORM_AMD64


def cache_root() -> Path:
    env = os.environ.get("IMEX_VM_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "imex-ensemble" / "vm"


def _sha(parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def base_key(packages: tuple[str, ...] = PACKAGES, suite: str = SUITE,
             arch: str = "amd64") -> str:
    """Pure: the base cache key (suite, architecture, variant, sorted package list, mirror)."""
    return _sha({"suite": suite, "arch": arch, "variant": VARIANT,
                 "packages": sorted(packages),
                 "initramfs": [INITRAMFS_CONF, INITRAMFS_HOOK],
                 "build_wrappers": sorted(BUILD_WRAPPERS.items()),
                 "mirror": os.environ.get("IMEX_VM_MIRROR", ""), "v": 3})


def overlay_files(arch: str = "amd64") -> dict[str, tuple[int, bytes]]:
    """Image path -> (mode, bytes): the stand-ins, their unit and cloud.cfg.d defaults.

    Pure apart from reading the daemon stand-in's source and building the ctl stand-in
    for ``arch`` (static C, :func:`tests.sandbox.ctl_build.guest_ctl`): the agent execs
    the ctl 18 times a minute, and a Python one cost an idle TCG guest most of its CPU.
    """
    shebang = b"#!/usr/bin/python3\n"
    return {
        "usr/bin/nvidia-imex": (0o755, shebang + STANDIN_IMEX.read_bytes()),
        "usr/bin/nvidia-imex-ctl": (0o755, guest_ctl(arch)),
        "lib/systemd/system/nvidia-imex.service": (0o644, IMEX_UNIT.encode()),
        "etc/cloud/cloud.cfg.d/90-imex-vmtest.cfg": (0o644, CLOUD_CFG.encode()),
    }


def disk_key(base: str, overlay: dict[str, tuple[int, bytes]]) -> str:
    return _sha({"base": base, "size": DISK_SIZE,
                 "overlay": {p: [m, hashlib.sha256(b).hexdigest()]
                             for p, (m, b) in sorted(overlay.items())}})


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """One builder per cache entry (an arm64 build does not hold up an amd64 one)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".lock-{name}", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(argv: list[str], what: str, timeout: float) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise ImageError(f"{what}: no result after {timeout:.0f}s ({' '.join(argv)})") from e
    except OSError as e:
        raise ImageError(f"{what}: cannot run {argv[0]}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise ImageError(f"{what} failed (exit {proc.returncode}): {' '.join(argv)}\n{tail}")


def _boot_files(members: list[tarfile.TarInfo]) -> tuple[str, str]:
    """Pure: the newest ``boot/vmlinuz-*`` and its ``boot/initrd.img-*`` in the tarball."""
    names = {m.name.removeprefix("./") for m in members if m.isfile()}
    left = sorted(n for n in (*(t.lstrip("/") + ".real" for t in BUILD_WRAPPERS),
                              *(f.lstrip("/") for f in BUILD_LEFTOVERS)) if n in names)
    if left:
        raise ImageError(f"the rootfs still has the build's diversions ({', '.join(left)}): "
                         "the customize hook failed")
    kernels = sorted(n for n in names if n.startswith("boot/vmlinuz-"))
    if not kernels:
        raise ImageError("the rootfs has no boot/vmlinuz-*: linux-image-<arch> not installed?")
    kernel = kernels[-1]
    initrd = "boot/initrd.img-" + kernel.removeprefix("boot/vmlinuz-")
    if initrd not in names:
        raise ImageError(f"the rootfs has {kernel} but no {initrd} (initramfs-tools failed?)")
    return kernel, initrd


def _build_wrapper_hooks(wrappers: dict[str, Path]) -> tuple[str, str]:
    """Pure: mmdebstrap's essential and customize hooks that divert each target to its
    wrapper (:data:`BUILD_WRAPPERS`) and then put it back (the image keeps no trace: the
    diversions are removed, the real scripts renamed back, the wrappers' stamps deleted)."""
    essential, customize = [], []
    for target, wrapper in sorted(wrappers.items()):
        essential.append(f'chroot "$1" dpkg-divert --quiet --local --rename --divert '
                         f'{target}.real --add {target} && install -m 0755 {wrapper} "$1{target}"')
        customize.append(f'rm -f "$1{target}" && '
                         f'chroot "$1" dpkg-divert --quiet --local --rename --remove {target} && '
                         f'test ! -e "$1{target}.real"')
    customize.extend(f'rm -f "$1{left}"' for left in BUILD_LEFTOVERS)
    return " && ".join(essential), " && ".join(customize)


def build_base(root: Path, key: str, guest: GuestOs = BOOKWORM_AMD64) -> Path:
    """``base-<key>/`` with rootfs.tar, vmlinuz, initrd.img (built when missing).

    A foreign architecture runs its maintainer scripts through qemu-user
    (:func:`tests.vm.binfmt.foreign_arch` registers the handler for the build only)."""
    final = root / f"base-{guest.id}-{key}"
    if (final / "rootfs.tar").is_file():
        return final
    for tool in ("mmdebstrap",):
        if shutil.which(tool) is None:
            raise ImageError(f"{tool} is not installed (apt-get install mmdebstrap)")
    tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=root))
    try:
        hooks = tmp / "hooks"
        hooks.mkdir()
        (hooks / "modules.conf").write_text(INITRAMFS_CONF)
        (hooks / "virtio-hook").write_text(INITRAMFS_HOOK)
        setup = (f'mkdir -p "$1/etc/initramfs-tools/conf.d" "$1/etc/initramfs-tools/hooks" && '
                 f'cp {hooks}/modules.conf "$1/etc/initramfs-tools/conf.d/imex-vmtest" && '
                 f'install -m 0755 {hooks}/virtio-hook "$1/etc/initramfs-tools/hooks/imex-vmtest"')
        diverted: list[str] = []
        if guest.bootable:  # a chroot-only root has no kernel, initramfs-tools or CAs
            wrappers = {}
            for target, (name, text) in BUILD_WRAPPERS.items():
                (hooks / name).write_text(text)
                wrappers[target] = hooks / name
            essential, customize = _build_wrapper_hooks(wrappers)
            diverted = [f"--essential-hook={essential}", f"--customize-hook={customize}"]
        argv = ["mmdebstrap", "--quiet", f"--variant={VARIANT}", f"--arch={guest.arch}",
                "--include=" + ",".join(guest.packages), f"--setup-hook={setup}",
                *diverted, guest.suite, str(tmp / "rootfs.tar")]
        mirror = os.environ.get("IMEX_VM_MIRROR")
        if mirror:
            argv.append(mirror)
        t0 = time.monotonic()
        log.info("building the guest rootfs (%s): %s", key, " ".join(argv))
        with foreign_arch(guest.arch):
            _run(argv, f"mmdebstrap ({guest.id})", 5400)
        with tarfile.open(tmp / "rootfs.tar") as tf:
            kernel, initrd = _boot_files(tf.getmembers()) if guest.bootable else ("", "")
            for name, out in ((kernel, "vmlinuz"), (initrd, "initrd.img")) if kernel else ():
                member = tf.getmember(name if name in tf.getnames() else "./" + name)
                src = tf.extractfile(member)
                assert src is not None
                with src, open(tmp / out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        (tmp / "built.json").write_text(json.dumps({
            "guest": guest.id, "packages": list(guest.packages), "suite": guest.suite,
            "arch": guest.arch, "kernel": kernel,
            "seconds": round(time.monotonic() - t0, 1)}))
        shutil.rmtree(hooks)
        os.replace(tmp, final)
        log.info("guest rootfs %s built in %.0fs", guest.id, time.monotonic() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_disk(root: Path, base: Path, key: str,
               overlay: dict[str, tuple[int, bytes]], guest: GuestOs = BOOKWORM_AMD64) -> Path:
    """``disk-<guest>-<key>/disk.img``: the rootfs plus the overlay as an ext4 image."""
    final = root / f"disk-{guest.id}-{key}"
    if (final / "disk.img").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".disk-", dir=root))
    try:
        tree = tmp / "rootfs"
        tree.mkdir()
        _run(["tar", "-C", str(tree), "--numeric-owner", "--xattrs", "--xattrs-include=*",
              "-xpf", str(base / "rootfs.tar")], "unpacking the rootfs", 600)
        for rel, (mode, data) in overlay.items():
            path = tree / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(mode)
        _run(["mkfs.ext4", "-q", "-F", "-L", "vmroot", "-d", str(tree),
              str(tmp / "disk.img"), DISK_SIZE], "mkfs.ext4 -d", 600)
        shutil.rmtree(tree)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # keep the cache small: older disks of this base go (bases stay; they are the slow part)
    for old in root.glob(f"disk-{guest.id}-*"):
        if old != final and old.is_dir() and time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    return final


def ensure_image(root: Path | None = None, guest: GuestOs = BOOKWORM_AMD64) -> Image:
    """The cached image, building what is missing; :class:`ImageError` says what failed."""
    root = root or cache_root()
    bkey = base_key(guest.packages, guest.suite, guest.arch)
    try:
        overlay = overlay_files(guest.arch)
    except CtlBuildError as e:
        raise ImageError(str(e)) from e
    dkey = disk_key(bkey, overlay)
    with _locked(root, f"base-{guest.id}-{bkey}"):
        base = build_base(root, bkey, guest)
    with _locked(root, f"disk-{guest.id}-{dkey}"):
        disk = build_disk(root, base, dkey, overlay, guest)
    os.utime(disk)
    return Image(disk / "disk.img", base / "vmlinuz", base / "initrd.img", bkey, dkey,
                 guest)


if __name__ == "__main__":  # python -m tests.vm.image [GUEST...]: build (or find) the images
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for gid in sys.argv[1:] or [BOOKWORM_AMD64.id]:
        if gid not in GUESTS:
            raise SystemExit(f"unknown guest {gid!r}; known: {', '.join(GUESTS)}")
        t = time.monotonic()
        img = ensure_image(guest=GUESTS[gid])
        print(f"{gid}: {img.disk} ({time.monotonic() - t:.1f}s)", flush=True)
