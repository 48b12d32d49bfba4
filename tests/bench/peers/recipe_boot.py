"""A recipe VM's boot: start IMEX the moment CoreDNS answers the VM's own name.

TEST HELPER, never product code. IMEX finds its own node by resolving the names in its
nodes file, so in the manual recipe it can only start once its own name is published; a
real guest boots long after its launcher pod is Ready, so starting IMEX the moment the
name resolves is the recipe's best case. Runs inside the VM's namespace and asks CoreDNS
directly every 50 ms (a guest's caching resolver would remember the NXDOMAIN it got
before the publication: not asked here, also for systemd-resolved guests), then appends
the wall time to ``MARK`` and ``exec``s IMEX, so nothing in the harness process can delay
the start.

``python recipe_boot.py DNS_IP NAME OWN_IP MARK -- IMEX_ARGV...``
"""

from __future__ import annotations

import os
import sys
import time

import dns.exception
import dns.message
import dns.query
import dns.rdatatype


def answers(server: str, name: str) -> set[str]:
    q = dns.message.make_query(name.rstrip(".") + ".", "A")
    try:
        resp = dns.query.udp(q, server, port=53, timeout=0.5)
    except (OSError, dns.exception.DNSException):
        return set()
    return {rd.to_text() for rrset in resp.answer if rrset.rdtype == dns.rdatatype.A
            for rd in rrset}


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 4 or len(argv) < 6:
        print("usage: recipe_boot.py DNS_IP NAME OWN_IP MARK -- IMEX_ARGV...", file=sys.stderr)
        return 2
    server, name, ip, mark = argv[:4]
    imex = argv[5:]
    while ip not in answers(server, name):
        time.sleep(0.05)
    with open(mark, "a") as f:
        f.write(f"{time.time()}\n")
    os.execv(imex[0], imex)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
