"""One QEMU guest: copy-on-write disk, NoCloud seed, tap NIC, serial log, qemu-ga socket.

TEST HARNESS. The machine is booted the way FACTS.md found to work here: direct kernel
boot (``-kernel``/``-initrd`` from the image, ``console=ttyS0``; an arm64 guest runs under
``qemu-system-aarch64 -M virt -cpu max`` with ``console=ttyAMA0``), the root disk a qcow2
overlay over the shared cached image (so every VM has its own disk that survives a
restart, as a VirtualMachine's disk does), the NoCloud seed a second virtio disk made by
``cloud-localds``, one virtio NIC on a tap that the harness created on its bridge.

The serial console is appended to ``serial.log`` across boots (the harness writes a marker
line before each boot), so a failed run keeps the whole history. qemu gets
``PR_SET_PDEATHSIG``: if the harness dies, no VM outlives it.

Accelerator: KVM hung right after the BIOS on this machine (FACTS.md). :func:`pick_accel`
boots the kernel once under KVM with a short deadline and falls back to TCG; the answer is
kept for the session. ``IMEX_VM_ACCEL=tcg|kvm`` skips the probe.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.vm.image import Image
from tests.vm.qga import Qga

log = logging.getLogger("vm.machine")

PR_SET_PDEATHSIG = 1
QEMU = "qemu-system-x86_64"
#: per Debian architecture: the emulator, its machine and its TCG CPU. ``-M virt`` defaults
#: to a 32-bit CPU, so aarch64 gets ``-cpu max``, with QEMU's cheap implementation-defined
#: pointer authentication (the architected algorithm is the costliest part of emulating
#: ``max`` under TCG); its serial port is a PL011 (``ttyAMA0``). An aarch64 guest on this
#: x86 machine is TCG only.
QEMU_BY_ARCH = {"amd64": ("qemu-system-x86_64", "q35", "max"),
                "arm64": ("qemu-system-aarch64", "virt", "max,pauth-impdef=on")}
_libc = ctypes.CDLL(None, use_errno=True)


def _pdeathsig() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class MachineError(Exception):
    """qemu could not be started, or a seed could not be made."""


#: NoCloud ``network-config`` of every seed (KubeVirt's ``cloudInitNoCloud.networkData``):
#: DHCPv4 on eth0, as the test bridge serves. Without it cloud-init renders its fallback,
#: and 25.1's (Debian 13) asks DHCPv4 *and* DHCPv6: ifupdown's ``dhclient -6`` then waits
#: for a DHCPv6 server the bridge does not have until ``networking.service`` times out
#: (5 min), and every later boot stage waits with it (tests/vm/README.md, "Debian 13").
NETWORK_CONFIG = "version: 2\nethernets:\n  eth0:\n    dhcp4: true\n"


def make_seed(path: Path, user_data: str, meta_data: str,
              network_config: str | None = NETWORK_CONFIG) -> Path:
    """``cloud-localds`` a NoCloud seed image (label ``cidata``) from the documents
    (``network_config`` None: no ``network-config``, cloud-init's fallback)."""
    with tempfile.TemporaryDirectory(prefix="vmt-seed-") as d:
        ud, md = Path(d) / "user-data", Path(d) / "meta-data"
        ud.write_text(user_data)
        md.write_text(meta_data)
        argv = ["cloud-localds", str(path), str(ud), str(md)]
        if network_config is not None:
            nc = Path(d) / "network-config"
            nc.write_text(network_config)
            argv[1:1] = ["--network-config", str(nc)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise MachineError(f"cloud-localds failed: {proc.stderr.strip()}")
    return path


def kernel_cmdline(console: str = "ttyS0") -> str:
    # net.ifnames=0: the NIC is eth0 whatever its PCI slot, as in KubeVirt guests' docs
    return f"root=/dev/vda rw console={console},115200 net.ifnames=0 panic=-1 quiet loglevel=4"


def qemu_argv(*, name: str, image: Image, disk: Path, seed: Path, tap: str, mac: str,
              serial: Path, qga_sock: Path, accel: str, memory_mb: int) -> list[str]:
    """Pure: the qemu command line for one guest (its architecture from the image)."""
    qemu, machine, cpu = QEMU_BY_ARCH[image.guest.arch]
    return [
        qemu, "-name", name, "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", machine, "-accel", accel, "-cpu", "host" if accel == "kvm" else cpu,
        "-smp", "1", "-m", str(memory_mb), "-no-reboot",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd),
        "-append", kernel_cmdline(image.guest.console),
        # explicit PCI devices: the same on q35 and virt (the seed is the second disk, vdb)
        "-drive", f"file={disk},if=none,id=root,format=qcow2,cache=unsafe",
        "-device", "virtio-blk-pci,drive=root",
        "-drive", f"file={seed},if=none,id=seed,format=raw,readonly=on",
        "-device", "virtio-blk-pci,drive=seed",
        "-netdev", f"tap,id=n0,ifname={tap},script=no,downscript=no",
        "-device", f"virtio-net-pci,netdev=n0,mac={mac}",
        "-device", "virtio-rng-pci",
        "-chardev", f"file,id=ser0,path={serial},append=on", "-serial", "chardev:ser0",
        "-chardev", f"socket,id=qga0,path={qga_sock},server=on,wait=off",
        "-device", "virtio-serial-pci",
        "-device", "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
    ]


# serial lines worth showing when a boot fails; the rest is boot noise
_RELEVANT = re.compile(
    r"error|fail|panic|traceback|exception|refus|denied|timed out|timeout|no such|"
    r"cannot|can't|unable|not found|invalid|runcmd|pip|imex|cloud-init|Cloud-init|"
    r"unreachable|Connection", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")


def relevant_lines(text: str, limit: int = 40) -> list[str]:
    """Pure: the serial log lines that explain a failure (last ``limit``), control chars gone."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    hits = [ln for ln in lines if ln.strip() and _RELEVANT.search(ln)]
    return hits[-limit:]


class Machine:
    def __init__(self, name: str, workdir: Path, image: Image, tap: str, mac: str,
                 memory_mb: int = 640, sock_dir: Path | None = None) -> None:
        self.name = name
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.image = image
        self.tap = tap
        self.mac = mac
        self.memory_mb = memory_mb
        self.disk = self.dir / "disk.qcow2"
        self.seed = self.dir / "seed.img"
        self.serial = self.dir / "serial.log"
        # a UNIX socket path must stay under 108 bytes: the work dir may be deep
        self.qga_sock = (sock_dir or self.dir) / f"{name}.qga"
        self.qga = Qga(self.qga_sock)
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0
        self.boot_started = 0.0
        self._serial_offset = 0

    def new_disk(self) -> None:
        self.disk.unlink(missing_ok=True)
        proc = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw",
                               "-b", str(self.image.disk), str(self.disk)],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise MachineError(f"qemu-img create: {proc.stderr.strip()}")

    def start(self, accel: str) -> None:
        if self.running():
            raise MachineError(f"{self.name} is already running")
        if not self.disk.exists():
            self.new_disk()
        self.boots += 1
        with open(self.serial, "ab") as f:
            self._serial_offset = f.tell()
            f.write(f"\n==== vmt harness: boot {self.boots} of {self.name} ({accel}, "
                    f"{time.strftime('%H:%M:%S')}) ====\n".encode())
        self.qga_sock.unlink(missing_ok=True)
        argv = qemu_argv(name=self.name, image=self.image, disk=self.disk, seed=self.seed,
                         tap=self.tap, mac=self.mac, serial=self.serial,
                         qga_sock=self.qga_sock, accel=accel, memory_mb=self.memory_mb)
        (self.dir / "qemu.argv").write_text(" ".join(argv) + "\n")
        self.boot_started = time.monotonic()
        with open(self.dir / "qemu.log", "ab") as qlog:
            try:
                self.proc = subprocess.Popen(argv, stdout=qlog, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig)
            except OSError as e:
                raise MachineError(f"cannot start {argv[0]}: {e}") from e

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL qemu (the VM dies as a host crash would kill it) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def wait_exit(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def serial_text(self, this_boot: bool = True) -> str:
        try:
            with open(self.serial, "rb") as f:
                if this_boot:
                    f.seek(self._serial_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def qemu_log(self) -> str:
        try:
            return (self.dir / "qemu.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""


def pick_accel(image: Image, workdir: Path, timeout: float = 20.0) -> str:
    """``kvm`` when a KVM guest reaches the kernel within ``timeout``, else ``tcg``.

    A foreign architecture is always TCG."""
    if image.guest.arch != "amd64":
        return "tcg"
    forced = os.environ.get("IMEX_VM_ACCEL")
    if forced in ("tcg", "kvm"):
        return forced
    if not os.access("/dev/kvm", os.R_OK | os.W_OK) or shutil.which(QEMU) is None:
        return "tcg"
    workdir.mkdir(parents=True, exist_ok=True)
    serial = workdir / "kvm-probe.log"
    argv = [QEMU, "-nodefaults", "-no-user-config", "-display", "none", "-accel", "kvm",
            "-cpu", "host", "-m", "256", "-no-reboot", "-kernel", str(image.kernel),
            "-append", "console=ttyS0 panic=-1", "-serial", f"file:{serial}"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_pdeathsig)
    deadline = time.monotonic() + timeout
    ok = False
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if "Linux version" in serial.read_text(errors="replace") if serial.exists() else "":
                ok = True
                break
            time.sleep(0.5)
        if not ok and serial.exists():
            ok = "Linux version" in serial.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    log.info("KVM probe: %s", "kernel started, using kvm" if ok else "no kernel output, tcg")
    return "kvm" if ok else "tcg"
