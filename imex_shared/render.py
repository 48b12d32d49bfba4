"""Pure renderings of what a guest writes: nodes_config and the hosts block.

Functions of (ensemble, size, pins) only, returning bytes, so the host agent's
registry serves exactly the bytes a guest writes and tests compare byte for
byte. ``pins`` maps slot index -> IP text; slots without a pin render as
ABSENT_IP. Every address is re-serialised through ``ipaddress`` so nothing but
``IP<TAB>slot`` can ever reach a file, whatever a peer or DNS answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from imex_shared.model import ABSENT_IP, EnsembleId, InvalidIndex, parse_ip

Mode = Literal["names", "ips"]
MODES: tuple[Mode, ...] = ("names", "ips")


def _check_pins(pins: Mapping[int, str], max_members: int) -> dict[int, str]:
    out: dict[int, str] = {}
    for index, ip in pins.items():
        if not 0 <= index < max_members:
            raise InvalidIndex(
                f"slot index {index} is out of range: the ensemble has {max_members} slots"
            )
        out[index] = str(parse_ip(ip))
    return out


def render_nodes_config(
    ens: EnsembleId, max_members: int, mode: Mode, pins: Mapping[int, str] | None = None
) -> bytes:
    """``nodes_config.cfg``: exactly ``max_members`` lines, line i = node i.

    ``names``: slot names; depends only on the ensemble, never changes.
    ``ips``: the IP of slot i, or ABSENT_IP (for IMEX older than 570.158.01).
    """
    if max_members < 1:
        raise InvalidIndex(f"max_members must be at least 1, not {max_members}")
    if mode == "names":
        lines = [ens.slot(i) for i in range(max_members)]
    elif mode == "ips":
        checked = _check_pins(pins or {}, max_members)
        lines = [checked.get(i, ABSENT_IP) for i in range(max_members)]
    else:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    return "".join(f"{line}\n" for line in lines).encode()


def render_hosts_block(ens: EnsembleId, max_members: int, pins: Mapping[int, str]) -> bytes:
    """Our managed ``/etc/hosts`` block: one ``IP<TAB>slot`` line per slot, in index order."""
    checked = _check_pins(pins, max_members)
    lines = [ens.block_begin]
    lines += [f"{checked.get(i, ABSENT_IP)}\t{ens.slot(i)}" for i in range(max_members)]
    lines.append(ens.block_end)
    return "".join(f"{line}\n" for line in lines).encode()
