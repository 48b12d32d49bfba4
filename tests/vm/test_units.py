"""The VM harness's pure parts (no qemu, no root): these run in ``make test``."""

from __future__ import annotations

import email
from pathlib import Path

from tests.vm import image
from tests.vm.harness import multipart_user_data
from tests.vm.image import Image
from tests.vm.machine import NETWORK_CONFIG, make_seed, qemu_argv, relevant_lines


def test_base_key_follows_the_package_list_not_its_order() -> None:
    pkgs = image.PACKAGES
    assert image.base_key(pkgs) == image.base_key(tuple(reversed(pkgs)))
    assert image.base_key(pkgs) != image.base_key((*pkgs, "openssh-server"))
    assert image.base_key(pkgs) != image.base_key(pkgs, suite="trixie")


def test_disk_key_changes_with_the_stand_in_bytes() -> None:
    overlay = image.overlay_files()
    assert overlay["usr/bin/nvidia-imex"][1].startswith(b"#!/usr/bin/python3\n")
    changed = dict(overlay)
    changed["usr/bin/nvidia-imex"] = (0o755, overlay["usr/bin/nvidia-imex"][1] + b"#\n")
    assert image.disk_key("b", overlay) == image.disk_key("b", dict(overlay))
    assert image.disk_key("b", overlay) != image.disk_key("b", changed)
    assert image.disk_key("b", overlay) != image.disk_key("c", overlay)


def test_the_daemon_stand_in_uses_only_the_standard_library() -> None:
    # it runs on the guest's system python3, outside any venv
    src = image.overlay_files()["usr/bin/nvidia-imex"][1].decode()
    assert "from tests" not in src and "import tests" not in src


def test_the_ctl_stand_in_is_a_static_binary_for_the_guest() -> None:
    # ELF, 64-bit, little-endian, x86-64 (e_machine 62), and no PT_INTERP (type 3) among
    # its program headers: a static program runs whatever the guest's glibc
    data = image.overlay_files("amd64")["usr/bin/nvidia-imex-ctl"][1]
    assert data[:6] == b"\x7fELF\x02\x01"
    assert int.from_bytes(data[18:20], "little") == 62
    phoff = int.from_bytes(data[32:40], "little")
    size, count = int.from_bytes(data[54:56], "little"), int.from_bytes(data[56:58], "little")
    types = [int.from_bytes(data[phoff + i * size:phoff + i * size + 4], "little")
             for i in range(count)]
    assert 1 in types and 3 not in types, types
    assert image.overlay_files("amd64")["usr/bin/nvidia-imex-ctl"][1] == data  # reproducible


def test_idle_probe_counts_this_machines_cpu_and_forks() -> None:
    # the probe's two readings, on this machine's own /proc: a child started between two
    # reads of /proc/stat counts as a fork, and CPU burnt shows in this process's utime
    import os
    import subprocess

    from tests.vm.idle_cpu import host_cpu_s, parse_proc_stat

    before = parse_proc_stat(Path("/proc/stat").read_text())
    cpu0 = host_cpu_s(os.getpid())
    subprocess.run(["true"], check=True)
    for _ in range(100_000):  # 0.05 s of CPU takes ~1,000 rounds; the bound never binds
        if host_cpu_s(os.getpid()) >= cpu0 + 0.05:
            break
        sum(range(10_000))
    assert host_cpu_s(os.getpid()) >= cpu0 + 0.05
    after = parse_proc_stat(Path("/proc/stat").read_text())
    assert after[2] >= before[2] + 1
    assert after[1] > before[1] and 0 <= after[0] - before[0] <= after[1] - before[1]


def test_boot_files_pick_the_kernel_and_its_initrd() -> None:
    import tarfile

    def member(name: str) -> tarfile.TarInfo:
        return tarfile.TarInfo(name)

    got = image._boot_files([member("./boot/vmlinuz-6.1.0-9-amd64"),
                             member("./boot/initrd.img-6.1.0-9-amd64"), member("./etc/hosts")])
    assert got == ("boot/vmlinuz-6.1.0-9-amd64", "boot/initrd.img-6.1.0-9-amd64")


def test_relevant_lines_keep_the_failure_and_drop_noise() -> None:
    log = ("\x1b[0m[  OK  ] Started Journal Service.\r\n"
           "[   12.0] random: crng init done\n"
           "ERROR: Could not find a version that satisfies the requirement imex-ensemble\n"
           "2026 - cc_scripts_user.py[WARNING]: Failed to run module scripts-user\n")
    lines = relevant_lines(log)
    assert lines == [
        "ERROR: Could not find a version that satisfies the requirement imex-ensemble",
        "2026 - cc_scripts_user.py[WARNING]: Failed to run module scripts-user"]


def test_multipart_keeps_the_generated_part_byte_for_byte() -> None:
    generated = "#cloud-config\nmanage_etc_hosts: false\nruncmd:\n  - echo hi\n"
    doc = email.message_from_string(multipart_user_data(generated, "#cloud-config\nx: 1\n"))
    parts = [p for p in doc.walk() if not p.is_multipart()]
    assert [p.get_content_type() for p in parts] == ["text/cloud-config"] * 2
    payload = parts[0].get_payload(decode=True)
    assert isinstance(payload, bytes) and payload.decode() == generated


def test_qemu_argv_direct_kernel_boot_tap_and_serial(tmp_path: Path) -> None:
    img = Image(tmp_path / "disk.img", tmp_path / "vmlinuz", tmp_path / "initrd.img", "b", "d")
    argv = qemu_argv(name="gb200-0", image=img, disk=tmp_path / "d.qcow2",
                     seed=tmp_path / "seed.img", tap="vmtt0", mac="52:54:00:77:00:0a",
                     serial=tmp_path / "serial.log", qga_sock=tmp_path / "qga.sock",
                     accel="tcg", memory_mb=640)
    joined = " ".join(argv)
    assert argv[argv.index("-kernel") + 1] == str(tmp_path / "vmlinuz")
    assert "console=ttyS0" in argv[argv.index("-append") + 1]
    assert "-accel tcg" in joined and "-cpu max" in joined and "-smp 1" in joined
    assert "tap,id=n0,ifname=vmtt0,script=no,downscript=no" in argv
    assert f"file,id=ser0,path={tmp_path / 'serial.log'},append=on" in argv


def test_every_guest_is_stock_python3_without_venv_or_pip() -> None:
    # the issue: stock cloud images have python3 (cloud-init needs it), no ensurepip, no pip
    for guest in image.GUESTS.values():
        assert "python3" in guest.packages and "cloud-init" in guest.packages
        assert not {"python3-venv", "python3-pip", f"python{guest.python}-venv"} & set(
            guest.packages), guest.id
        assert f"linux-image-{guest.arch}" in guest.packages
    assert sorted(image.GUESTS) == ["debian-12-amd64", "debian-12-arm64", "debian-13-amd64"]
    assert image.GUESTS["debian-12-arm64"].console == "ttyAMA0"
    assert image.GUESTS["debian-13-amd64"].console == "ttyS0"


def test_base_key_follows_the_architecture() -> None:
    arm = image.BOOKWORM_ARM64
    amd = image.BOOKWORM_AMD64
    assert image.base_key(arm.packages, arm.suite, arm.arch) != image.base_key(
        amd.packages, amd.suite, arm.arch)  # the kernel package differs
    assert image.base_key(amd.packages, amd.suite, "arm64") != image.base_key(
        amd.packages, amd.suite, "amd64")


def test_binfmt_handler_line_comes_from_qemu_user_static(tmp_path: Path) -> None:
    import pytest

    from tests.vm import binfmt

    line = (":qemu-aarch64:M::\\x7f\\x45\\x4c\\x46\\x02\\x01\\x01:\\xff\\xff:"
            "/usr/libexec/qemu-binfmt/aarch64-binfmt-P:OPF")
    (tmp_path / "qemu-aarch64.conf").write_text(line + "\n")
    assert binfmt.handler_line("arm64", tmp_path) == line
    (tmp_path / "qemu-aarch64.conf").write_text("# nothing\n")
    with pytest.raises(binfmt.BinfmtError, match="not a binfmt_misc registration line"):
        binfmt.handler_line("arm64", tmp_path)
    with pytest.raises(binfmt.BinfmtError, match="apt-get install qemu-user-static"):
        binfmt.handler_line("arm64", tmp_path / "missing")
    assert binfmt.native_arch() == "amd64"  # this machine; foreign_arch("amd64") is a no-op


def test_qemu_argv_arm64_is_virt_with_a_64_bit_cpu_and_the_pl011_console(tmp_path: Path) -> None:
    img = Image(tmp_path / "disk.img", tmp_path / "vmlinuz", tmp_path / "initrd.img", "b", "d",
                image.BOOKWORM_ARM64)
    argv = qemu_argv(name="gb200-1", image=img, disk=tmp_path / "d.qcow2",
                     seed=tmp_path / "seed.img", tap="vmtt1", mac="52:54:00:77:00:0b",
                     serial=tmp_path / "serial.log", qga_sock=tmp_path / "qga.sock",
                     accel="tcg", memory_mb=1024)
    assert argv[0] == "qemu-system-aarch64"
    assert argv[argv.index("-machine") + 1] == "virt"
    assert argv[argv.index("-cpu") + 1].split(",")[0] == "max"  # virt's default is 32-bit
    cmdline = argv[argv.index("-append") + 1]
    assert "console=ttyAMA0" in cmdline and "ttyS0" not in cmdline
    assert argv.count("virtio-blk-pci,drive=root") == 1


def test_connected_nodes_reads_the_own_nodes_links_by_id() -> None:
    from tests.vm.harness import connected_nodes

    doc = {"nodes": {
        "0": {"status": "READY", "host": "10.77.0.12", "connections": {
            "1": {"host": "10.77.0.11", "status": "CONNECTED", "changed": 1},
            "2": {"host": "127.0.0.2", "status": "NEVER_CONNECTED", "changed": 0}}},
        "1": {"status": "READY", "host": "10.77.0.11", "connections": {
            "0": {"host": "10.77.0.12", "status": "CONNECTED", "changed": 1},
            "2": {"host": "127.0.0.2", "status": "CONNECTED", "changed": 0}}}},
        "status": "DEGRADED"}
    assert connected_nodes(doc, 0) == {1}
    assert connected_nodes(doc, 1) == {0, 2}
    assert connected_nodes(doc, 2) == set()
    assert connected_nodes(None, 0) is None


def test_every_seed_asks_dhcp4_on_eth0_only(tmp_path: Path) -> None:
    # without a network-config, Debian 13's cloud-init 25.1 falls back to DHCPv4 + DHCPv6 and
    # ifupdown waits 5 min for a DHCPv6 server the test bridge does not have (README)
    import yaml

    assert yaml.safe_load(NETWORK_CONFIG) == {"version": 2,
                                              "ethernets": {"eth0": {"dhcp4": True}}}
    seed = make_seed(tmp_path / "seed.img", "#cloud-config\n", "instance-id: i-1\n")
    raw = seed.read_bytes()
    assert NETWORK_CONFIG.encode() in raw and b"instance-id: i-1" in raw
    bare = make_seed(tmp_path / "bare.img", "#cloud-config\n", "instance-id: i-1\n", None)
    assert b"dhcp4" not in bare.read_bytes()


def test_boot_files_refuse_a_rootfs_left_with_the_builds_diversion() -> None:
    import tarfile

    import pytest

    members = [tarfile.TarInfo(n) for n in ("./boot/vmlinuz-6.1.0-9-amd64",
                                            "./boot/initrd.img-6.1.0-9-amd64",
                                            "./usr/sbin/update-initramfs.real")]
    with pytest.raises(image.ImageError, match=r"update-initramfs\.real"):
        image._boot_files(members)


def test_the_build_skips_only_update_initramfs_u(tmp_path: Path) -> None:
    """The wrapper the base build diverts in: ``-u`` (the trigger's second initrd) is a
    no-op, anything else (the kernel postinst's ``-c``) runs the real script."""
    import subprocess

    real = tmp_path / "real"
    real.write_text('#!/bin/sh\necho "real $*"\n')
    real.chmod(0o755)
    wrapper = tmp_path / "update-initramfs"
    wrapper.write_text(image.UPDATE_INITRAMFS_WRAPPER.replace(
        "/usr/sbin/update-initramfs.real", str(real)))

    def run(*args: str) -> str:
        done = subprocess.run(["sh", str(wrapper), *args], capture_output=True, text=True,
                              check=True)
        return done.stdout.strip()

    assert run("-u") == "update-initramfs: -u skipped during the image build"
    assert run("-u", "-k", "all") == "update-initramfs: -u skipped during the image build"
    assert run("-c", "-k", "6.1.0-9-arm64") == "real -c -k 6.1.0-9-arm64"
    assert run("-d", "-k", "6.1.0-9-arm64") == "real -d -k 6.1.0-9-arm64"


def test_the_build_skips_only_a_ca_rebuild_that_would_change_nothing(tmp_path: Path) -> None:
    """The ``update-ca-certificates`` wrapper: the deferred plain run after an unchanged
    earlier one is skipped; a change to what the tool reads, a hook to run, or any
    argument runs the real script. Run against a root under ``tmp_path``."""
    import re
    import subprocess

    root = tmp_path / "root"
    for d in ("etc/ssl/certs", "etc/ca-certificates/update.d", "usr/share/ca-certificates",
              "usr/local/share/ca-certificates", "var/lib", "usr/sbin"):
        (root / d).mkdir(parents=True)
    (root / "etc/ca-certificates.conf").write_text("mozilla/A.crt\n")
    (root / "usr/share/ca-certificates/A.crt").write_text("A\n")
    real = root / "usr/sbin/update-ca-certificates.real"
    # like the real one: it rewrites the bundle on every run
    real.write_text(f'#!/bin/sh\necho "real $*"\necho bundle > {root}/etc/ssl/certs/ca.crt\n')
    real.chmod(0o755)
    text = re.sub(r"(?<=[\s=(])/(etc|usr|var)/", rf"{root}/\1/", image.UPDATE_CA_WRAPPER)
    assert str(tmp_path) in text and " /etc/" not in text
    wrapper = tmp_path / "update-ca-certificates"
    wrapper.write_text(text)

    def run(*args: str) -> str:
        done = subprocess.run(["sh", str(wrapper), *args], capture_output=True, text=True,
                              check=True)
        return done.stdout.strip()

    skipped = ("update-ca-certificates: nothing changed since its last run, skipped during "
               "the image build")
    assert run() == "real"  # no stamp yet
    assert run("--hooksdir", "") == "real --hooksdir"  # the postinst's own run
    assert run() == skipped  # the trigger's, with nothing changed
    assert run("--fresh") == "real --fresh"
    (root / "usr/local/share/ca-certificates/B.crt").write_text("B\n")
    assert run() == "real"  # a certificate was added since
    assert run() == skipped
    hook = root / "etc/ca-certificates/update.d/jks"
    hook.write_text("#!/bin/sh\n")
    assert run() == "real"  # a hook is what the deferred run is for
    hook.unlink()
    assert run() == "real"  # the hooks directory changed
    assert run() == skipped


def test_the_build_wrapper_hooks_divert_and_restore_each_target() -> None:
    essential, customize = image._build_wrapper_hooks(
        {t: Path("/h") / name for t, (name, _) in image.BUILD_WRAPPERS.items()})
    for target in image.BUILD_WRAPPERS:
        assert (f"dpkg-divert --quiet --local --rename --divert {target}.real --add {target}"
                in essential)
        assert f"dpkg-divert --quiet --local --rename --remove {target}" in customize
        assert f'test ! -e "$1{target}.real"' in customize
    assert 'rm -f "$1/var/lib/imex-build-ca-certificates.stamp"' in customize
