"""Bad input stops the harness clearly and leaves nothing behind.

The cheap case that needs a boot is a wheelhouse URL that does not answer: the generated
``runcmd``'s installer fails with one line on the serial console, and the harness must stop
with it (not wait for its boot deadline), then remove every process, tap and the
namespace. One guest, one boot: 4.5 min to the failure
on a lightly loaded machine, over 20 under heavy load.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

from tests.sandbox.netns import list_netns
from tests.vm.harness import HarnessSettings, VmFailure, VmHarness

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.timeout(3600)]


def _our_qemus() -> list[str]:
    out = subprocess.run(["pgrep", "-a", "-P", str(os.getpid()), "qemu-system"],
                         capture_output=True, text=True).stdout
    return out.splitlines()


def test_unreachable_wheelhouse_fails_with_the_serial_lines(
        vm_settings: HarnessSettings) -> None:
    # port 8009 on the harness's own bridge address: nothing listens there
    settings = dataclasses.replace(vm_settings, vms=1,
                                   install="find-links:http://10.77.0.1:8009/")
    h = VmHarness(settings)
    with pytest.raises(VmFailure) as info, h:
        h.boot([0])
    msg = str(info.value)
    # the installer's one line on the console (the harness stops at it), never pip's log
    assert "imex-ensemble setup: error: cannot fetch http://10.77.0.1:8009/: " in msg, msg
    assert "Connection refused" in msg, msg
    assert "No matching distribution found" not in msg, msg
    assert h.netns not in list_netns(), "namespace left behind"
    assert not _our_qemus(), "qemu left running"
    assert all(not g.machine.running() for g in h.guests.values())
    assert (h.workdir / "gb200-0" / "serial.log").is_file(), "serial log not kept"
