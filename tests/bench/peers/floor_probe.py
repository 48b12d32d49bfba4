"""The floor probe of issue 18: the least a guest can do to follow the registry.

TEST HELPER, never product code, standard library only (it runs with the guest's
interpreter inside a VM's network namespace). It long-polls the registry on one kept-alive
connection and, on every answer, writes each member's ``IP<TAB>slot`` line into the VM's
hosts file in one ``write`` and ``fsync``. No rendering beyond that f-string, no IMEX,
no reporting, no DNS: one watch event at the host agent, one HTTP round trip, one fsync.
The lines sit between the same ``# BEGIN/# END imex-ensemble`` markers as the guest
agent's block, so one watcher reads both.

``python floor_probe.py HOST PORT NAMESPACE NAME HOSTS_FILE``
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time

BASE = "127.0.0.1\tlocalhost\n"


def main(argv: list[str]) -> int:
    host, port, ns, name, hosts_file = argv[0], int(argv[1]), argv[2], argv[3], argv[4]
    path = f"/v1/ensembles/{ns}/{name}"
    generation: int | None = None
    conn = http.client.HTTPConnection(host, port, timeout=60)
    while True:
        query = "" if generation is None else f"?wait={generation}&timeout=30"
        try:
            conn.request("GET", path + query)
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            time.sleep(0.2)
            continue
        if resp.status != 200:
            time.sleep(0.2)
            continue
        doc = json.loads(body)
        generation = int(doc["generation"])
        lines = "".join(f"{m['ip']}\t{m['slot']}\n" for m in doc["members"] if m.get("ip"))
        text = (f"{BASE}# BEGIN imex-ensemble {ns}/{name}\n{lines}"
                f"# END imex-ensemble {ns}/{name}\n").encode()
        fd = os.open(hosts_file, os.O_WRONLY)  # in place: /etc/hosts is a bind mount
        try:
            os.write(fd, text)
            os.ftruncate(fd, len(text))
            os.fsync(fd)
        finally:
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
