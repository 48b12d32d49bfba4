"""Keep IMEX's port out of the kernel's ephemeral port range.

IMEX listens on ``port`` (50000 by default), which lies inside Linux's default
ephemeral range (32768-60999). An outgoing connection that is given that local
port (the agent's own registry long-poll, say) makes IMEX's bind fail with
EADDRINUSE until the connection closes; make test's 18-VM sandbox caught this
once: four IMEX starts failed on one VM. ``net.ipv4.ip_local_reserved_ports``
(per network namespace, and it covers IPv6 too) stops the kernel from choosing a
port for outgoing connections, while a bind to it still works. The agent adds the
port at start, keeping every entry already there, before it opens a connection.

The sysctl's format is a comma-separated list of ports and ``a-b`` ranges.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

log = logging.getLogger("guest_agent.portreserve")  # logger name pinned

SYSCTL: Final = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")


class ReservedPortsError(ValueError):
    """The sysctl's text is not a list of ports and ranges."""


def parse_reserved(text: str) -> list[tuple[int, int]]:
    """``"8080,50000-50010"`` -> ``[(8080, 8080), (50000, 50010)]``."""
    spans: list[tuple[int, int]] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            lo, hi = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ReservedPortsError(f"not a port or a range: {part!r}") from None
        if not 0 < lo <= hi <= 65535:
            raise ReservedPortsError(f"not a port or a range: {part!r}")
        spans.append((lo, hi))
    return spans


def with_port(text: str, port: int) -> str | None:
    """The sysctl's new text with ``port`` reserved; None when it already is."""
    spans = parse_reserved(text)
    if any(lo <= port <= hi for lo, hi in spans):
        return None
    return ",".join([text.strip(), str(port)] if spans else [str(port)])


def reserve_port(port: int, sysctl: Path = SYSCTL) -> bool:
    """Reserve ``port`` in this network namespace; False (logged once) when it cannot.

    Not being able to (no /proc/sys write in an unprivileged container) costs only
    the protection: IMEX's own restart with backoff still outlives a connection that
    took the port.
    """
    try:
        current = sysctl.read_text()
        new = with_port(current, port)
        if new is None:
            return True
        sysctl.write_text(new + "\n")
    except (OSError, ReservedPortsError) as exc:
        log.warning("cannot keep IMEX's port %d out of the ephemeral range (%s: %s); an "
                    "outgoing connection given that port would make IMEX's bind fail until "
                    "it closes", port, sysctl, exc)
        return False
    log.info("reserved IMEX's port %d for binds only (%s is now %s)", port, sysctl.name, new)
    return True
