"""The VM harness's pure parts (no qemu, no root): these run in ``make test``."""

from __future__ import annotations

import email
from pathlib import Path

from tests.vm import image
from tests.vm.harness import multipart_user_data
from tests.vm.image import Image
from tests.vm.machine import qemu_argv, relevant_lines


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


def test_stand_ins_use_only_the_standard_library() -> None:
    # they run on the guest's system python3, outside any venv
    for rel in ("usr/bin/nvidia-imex", "usr/bin/nvidia-imex-ctl"):
        src = image.overlay_files()[rel][1].decode()
        assert "from tests" not in src and "import tests" not in src, rel


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


def test_generated_install_trusts_a_plain_http_wheelhouse_only() -> None:
    # found by this tier: a guest's pip refused http://10.77.0.1:8000/ as "not a trusted or
    # secure host" and the runcmd failed; https needs no flag
    from guest_agent import cloudinit as ci

    def script(install: str) -> str:
        opts = ci.Options(ensemble="e", namespace="n", install=ci.InstallSource.parse(install))
        return ci.render_setup_script(opts, None)

    assert "--find-links http://10.77.0.1:8000/ --trusted-host 10.77.0.1:8000 " in script(
        "find-links:http://10.77.0.1:8000/")
    assert "--index-url http://mirror.lan/simple/ --trusted-host mirror.lan " in script(
        "pip-index:http://mirror.lan/simple/")
    assert "--trusted-host" not in script("pip-index:https://mirror.lan/simple/")
    assert "--trusted-host" not in script("preinstalled")
