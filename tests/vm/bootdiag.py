"""Why is a guest slow to get its address? Boot one guest, time it, read its boot record.

TEST HARNESS (issue 24). ``python -m tests.vm.bootdiag [GUEST] [--fallback] [--out DIR]``
(root) boots one guest of the matrix (default ``debian-13-amd64``) with the generated
user-data and no peer, prints the seconds from qemu's start to an address on eth0 that
qemu-ga reports, waits ``--settle`` seconds, then writes into ``DIR`` what the guest says
about its boot, read through qemu-ga's guest-exec: ``systemd-analyze blame``, the failed
units, the rendered ``/etc/network/interfaces.d``, the network lines of
``cloud-init.log``, and the boot's order (``journalctl -b -o short-monotonic``: networking,
DHCP, sysinit.target, qemu-ga). ``--fallback`` leaves the seed without a network-config,
as the harness did before issue 24, so cloud-init renders its fallback. The work directory
(serial.log, dnsmasq.log) is kept in ``DIR/work``; every process, tap and the namespace go.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from pathlib import Path

from tests.vm import harness as harness_mod
from tests.vm.harness import HarnessSettings, VmHarness
from tests.vm.image import GUESTS, TRIXIE_AMD64
from tests.vm.machine import make_seed

EVIDENCE = {
    "blame": "systemd-analyze blame | head -25",
    "failed": "systemctl --failed --no-pager",
    "interfaces": "cat /etc/network/interfaces.d/* 2>&1",
    "cloud-init-network": "grep -i -E 'Applying network|Selected renderer' "
                          "/var/log/cloud-init.log",
    "boot-order": "journalctl -b --no-pager -o short-monotonic | grep -E "
                  "'networking.service|dhclient.*(DHCPACK|Solicit on)|sysinit.target|"
                  "Started qemu-guest-agent|crng init done' | head -60",
    "rng": "lsmod | grep -i rng; cat /sys/devices/virtual/misc/hw_random/rng_current",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("guest", nargs="?", default=TRIXIE_AMD64.id, choices=sorted(GUESTS))
    ap.add_argument("--fallback", action="store_true",
                    help="no network-config in the seed (cloud-init's fallback)")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds to wait after the address before reading the record")
    ap.add_argument("--out", type=Path, default=Path("bootdiag"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.fallback:
        harness_mod.make_seed = functools.partial(  # type: ignore[attr-defined]
            make_seed, network_config=None)
    settings = HarnessSettings(vms=1, guests=(args.guest,), workdir=out / "work",
                               keep_artifacts=True)
    with VmHarness(settings) as h:
        g = h.add_vm(0)
        h.wait_running(g)
        address = g.timings["address"]
        print(f"bootdiag: {args.guest}: address {g.ip} after {address:.0f}s", flush=True)
        time.sleep(args.settle)
        for name, script in EVIDENCE.items():
            r = g.machine.qga.sh(script, timeout=120)
            (out / f"{name}.txt").write_text(r.out + r.err)
        (out / "summary.json").write_text(json.dumps(
            {"guest": args.guest, "fallback": args.fallback, "address_s": round(address, 1)}))
    print(f"bootdiag: evidence in {out}", flush=True)


if __name__ == "__main__":
    main()
