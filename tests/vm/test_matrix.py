"""The guests real racks run, each from stock Debian packages (no python3-venv, no pip).

``make vmtest-matrix`` boots, with the project's own user-data and a wheelhouse tree served
over HTTP (each guest appends its own ``linux-<arch>-py<ver>/``):

* per guest OS, an **install-and-converge smoke with one peer**: one QEMU guest and one
  lean member (tests/vm/peer.py, a network namespace running the real agent and the IMEX
  stand-in): the guest installs the agent with its own python3, both pin each other, both
  IMEX stand-ins report the other CONNECTED, both report READY to the registry;
* the **mixed ensemble**: one arm64 and one amd64 guest converge; the arm64 guest is killed
  with its setup torn the way an early crash tears it, boots again from its own disk with a
  new address, its own cloud-init (22.4, arm64) redoes the setup, and all converge again.

Each prints one line, exactly: ``vm-matrix: <guest> python3.<minor> cloud-init <version>
systemd <major>: PASS`` (or ``FAIL <reason>``), and ``vm-matrix: mixed-arm64-amd64 ...``.
The lines are collected and printed again together at the end of the run. CI runs the
smokes for debian-12-arm64 and debian-13-amd64 (``IMEX_VM_GUESTS``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.vm.harness import Guest, HarnessSettings, VmHarness
from tests.vm.image import GUESTS
from tests.vm.test_real_guests import check_setup_redone, tear_setup
from tests.vm.verdicts import MATRIX_LINES

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.timeout(7200)]

MATRIX = ["debian-13-amd64", "debian-12-arm64", "debian-12-amd64"]


def selected() -> list[str]:
    raw = os.environ.get("IMEX_VM_GUESTS", "")
    if not raw:
        return MATRIX
    got = raw.replace(",", " ").split()
    unknown = [g for g in got if g not in GUESTS]
    if unknown:
        raise pytest.UsageError(f"IMEX_VM_GUESTS: unknown {unknown}; known: {list(GUESTS)}")
    return got


def describe(g: Guest) -> str:
    f = g.facts
    return (f"{g.os.id} python{f.get('python', '?')} cloud-init {f.get('cloud-init', '?')} "
            f"systemd {f.get('systemd', '?')}")


def verdict(line: str, err: BaseException | None) -> str:
    if err is None:
        return f"vm-matrix: {line}: PASS"
    reason = " ".join(f"{type(err).__name__}: {err}".split())[:200]
    return f"vm-matrix: {line}: FAIL {reason}"


def timings(g: Guest) -> str:
    t = g.timings
    return ", ".join(f"{k} {t[k]:.0f}s" for k in ("address", "agent", "converged") if k in t)


@pytest.mark.parametrize("gid", selected())
def test_install_and_converge_with_one_peer(gid: str, vm_settings: HarnessSettings,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    settings = dataclasses.replace(vm_settings, vms=1, guests=(gid,), peers=1)
    h = VmHarness(settings)
    err: BaseException | None = None
    guest: Guest | None = None
    try:
        with h:
            h.boot([0])
            guest = h.guests[0]
            h.wait_converged([0, 1])
    except BaseException as e:
        err = e
        raise
    finally:
        g = guest or h.guests.get(0)
        desc = describe(g) if g is not None else gid
        line = verdict(desc, err)
        MATRIX_LINES.append(line)
        with capsys.disabled():
            extra = f" ({timings(g)}; image {h.timings.get('image', 0):.0f}s)" if g else ""
            print(f"\n{line}{extra}")
    facts = guest.facts
    want = GUESTS[gid]
    assert facts.get("python") == want.python, facts  # the suite's own python3, no other


def test_mixed_arm64_amd64_ensemble_survives_a_kill_of_the_arm64_guest(
        vm_settings: HarnessSettings, capsys: pytest.CaptureFixture[str]) -> None:
    settings = dataclasses.replace(vm_settings, vms=2,
                                   guests=("debian-12-arm64", "debian-12-amd64"))
    h = VmHarness(settings)
    err: BaseException | None = None
    steps: list[str] = []
    try:
        with h:
            h.boot([0, 1])
            took = h.wait_converged([0, 1])
            steps.append(f"converged {took:.0f}s after the last agent")
            arm = h.guests[0]
            assert arm.facts.get("python") == "3.11", arm.facts
            pid = h.imex_main_pid(h.guests[1])
            tear_setup(arm)
            h.kill(0)
            h.wait_converged([1])
            assert h.imex_main_pid(h.guests[1]) == pid, "amd64 guest's IMEX restarted"
            old = arm.ip
            new = h.restart_with_new_address(0)
            h.wait_running(arm)
            h.wait_agent(arm)
            took = h.wait_converged([0, 1])
            steps.append(f"arm64 back {old} -> {new}, {check_setup_redone(arm)}, "
                         f"converged {took:.0f}s after its agent")
    except BaseException as e:
        err = e
        raise
    finally:
        desc = " + ".join(describe(h.guests[i]) for i in sorted(h.guests)) or "not booted"
        line = verdict(f"mixed-arm64-amd64 {desc}", err)
        MATRIX_LINES.append(line)
        with capsys.disabled():
            print(f"\n{line}")
            for s in steps:
                print(f"  {s}")
            for g in h.guests.values():
                print(f"  {g.vmi} ({g.os.id}): {timings(g)}")
