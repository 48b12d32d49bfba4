"""A stand-in for ``nvidia-smi -q``, as far as the guest agent reads it: the Fabric sections.

TEST STAND-IN, never product code. There is no GPU here (FACTS.md "This machine"). Real
``nvidia-smi -q`` prints one block per GPU; on an NVLink-fabric GPU (GB200/GB300) its
``Fabric`` section gives ``State``, ``Status``, ``CliqueId`` and ``ClusterUUID``, and on
other GPUs those read ``N/A`` (FACTS.md "IMEX: the domain view, cliques, channels"). This
prints that layout for ``--gpus`` GPUs (4 per GB200 tray) from the VM's configured clique:

* ``--fabric-file PATH``: JSON ``{"cluster_uuid": "...", "clique_id": N}``, read on every
  call (a missing file or ``null``: no fabric, every value ``N/A``);
* ``--state WORD``: the Fabric State (default ``Completed``; ``In Progress`` while the
  fabric manager has not registered the GPU);
* ``--status WORD``: the Fabric Status (default ``Success``; a failure prints its reason
  there instead);
* ``--driver VERSION``: the "Driver Version" line (default 580.82.07, an r580 driver;
  preflight compares it with 570.158.01 and r580, FACTS.md "Driver-version floors");
* ``--garbage``: print something that is not nvidia-smi output (for the agent's checks).

Standard library only, so it can be copied into a guest image as ``nvidia-smi``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

DRIVER = "580.82.07"


def fabric_of(path: Path | None) -> tuple[str, str]:
    """(ClusterUUID, CliqueId) as nvidia-smi prints them; ``N/A`` without a fabric."""
    if path is None:
        return "N/A", "N/A"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return "N/A", "N/A"
    if not isinstance(doc, dict):
        return "N/A", "N/A"
    return str(doc.get("cluster_uuid", "N/A")), str(doc.get("clique_id", "N/A"))


def render(gpus: int, uuid: str, clique: str, state: str, status: str = "Success",
           driver: str = DRIVER) -> str:
    """The ``-q`` text: a header, then per GPU a few fields and its Fabric section."""
    none = uuid == "N/A"
    lines = ["", "==============NVSMI LOG==============", "",
             f"{'Timestamp':<38}: {time.strftime('%a %b %d %H:%M:%S %Y')}",
             f"{'Driver Version':<38}: {driver}", f"{'CUDA Version':<38}: 13.0", "",
             f"{'Attached GPUs':<38}: {gpus}"]
    for n in range(gpus):
        lines += [
            f"GPU 00000009:{n + 1:02X}:00.0",
            f"    {'Product Name':<34}: NVIDIA GB200 (sandbox stand-in)",
            f"    {'Persistence Mode':<34}: Enabled",
            "    Fabric",
            f"        {'State':<30}: {'N/A' if none else state}",
            f"        {'Status':<30}: {'N/A' if none else status}",
            f"        {'CliqueId':<30}: {clique}",
            f"        {'ClusterUUID':<30}: {uuid}",
            "        Health",
            f"            {'Bandwidth':<26}: {'N/A' if none else 'Full'}",
            f"    {'Processes':<34}: None",
            "",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nvidia-smi (stand-in)")
    p.add_argument("-q", action="store_true", help="query: print every GPU's details")
    p.add_argument("--fabric-file", type=Path)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--state", default="Completed")
    p.add_argument("--status", default="Success")
    p.add_argument("--driver", default=DRIVER)
    p.add_argument("--garbage", action="store_true")
    args = p.parse_args(argv)
    if not args.q:
        p.error("only -q is implemented by the stand-in")
    if args.garbage:
        sys.stdout.write("    Fabric\n        CliqueId : banana\n        ClusterUUID : x\n")
        return 0
    uuid, clique = fabric_of(args.fabric_file)
    sys.stdout.write(render(args.gpus, uuid, clique, args.state, args.status, args.driver))
    return 0


if __name__ == "__main__":
    sys.exit(main())
