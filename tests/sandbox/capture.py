"""A packet capture on the sandbox's bridge, and the TCP streams it saw (TEST STAND-IN for
tcpdump, which this machine does not have).

``python -m tests.sandbox.capture OUT`` runs inside the fabric namespace (the bridge's):
one ``AF_PACKET`` socket, bound to no interface, sees every frame of every port of the
bridge (each veth, both directions) and writes them to ``OUT`` (4-byte length, then the
frame) until SIGTERM. :class:`BridgeCapture` starts and stops it; :func:`streams`
rebuilds each TCP stream's payload in sequence order (a frame seen on two ports, or a
retransmission, counts once), so a token split across two segments is found too.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800

Flow = tuple[str, int, str, int]  # src, sport, dst, dport


def _capture(out: str) -> int:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.settimeout(0.2)
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    with open(out, "wb", buffering=1 << 20) as f:
        sys.stdout.write("capturing\n")
        sys.stdout.flush()
        while not stop[0]:
            try:
                frame = sock.recv(1 << 16)
            except TimeoutError:
                continue
            f.write(struct.pack("!I", len(frame)) + frame)
    return 0


def frames(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    pos = 0
    while pos + 4 <= len(data):
        (n,) = struct.unpack_from("!I", data, pos)
        yield data[pos + 4:pos + 4 + n]
        pos += 4 + n


def tcp_segments(path: Path) -> Iterator[tuple[Flow, int, bytes]]:
    """(flow, sequence number, payload) of every IPv4 TCP segment with a payload."""
    for frame in frames(path):
        if len(frame) < 34:
            continue
        off = 14
        (ethertype,) = struct.unpack_from("!H", frame, 12)
        if ethertype == 0x8100:  # a VLAN tag
            (ethertype,) = struct.unpack_from("!H", frame, 16)
            off = 18
        if ethertype != ETH_P_IP or frame[off + 9] != 6:
            continue
        ihl = (frame[off] & 0x0F) * 4
        total = struct.unpack_from("!H", frame, off + 2)[0]
        src = socket.inet_ntoa(frame[off + 12:off + 16])
        dst = socket.inet_ntoa(frame[off + 16:off + 20])
        tcp = off + ihl
        sport, dport, seq = struct.unpack_from("!HHI", frame, tcp)
        data_off = (frame[tcp + 12] >> 4) * 4
        payload = frame[tcp + data_off:off + total]
        if payload:
            yield (src, sport, dst, dport), seq, payload


def streams(path: Path) -> dict[Flow, bytes]:
    """Each TCP flow's payload bytes in sequence order (duplicates once)."""
    parts: dict[Flow, dict[int, bytes]] = defaultdict(dict)
    for flow, seq, payload in tcp_segments(path):
        have = parts[flow].get(seq)
        if have is None or len(payload) > len(have):
            parts[flow][seq] = payload
    return {flow: b"".join(p for _, p in sorted(segs.items())) for flow, segs in parts.items()}


@dataclass
class BridgeCapture:
    """The capture child in ``netns`` writing to ``out``; a context manager."""

    netns: str
    out: Path
    proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BridgeCapture:
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, sys.executable, "-m", "tests.sandbox.capture",
             str(self.out)], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if b"capturing" not in line:
            self.proc.kill()
            raise RuntimeError(f"the capture did not start: {line!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        time.sleep(0.3)  # the last frames in flight
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


if __name__ == "__main__":
    raise SystemExit(_capture(sys.argv[1]))
