"""sync_profile's CPU timeline samples real processes (a busy one and an idle one)."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.bench.common import cpu_seconds
from tests.bench.sync_profile import CpuTimeline


def test_the_timeline_follows_each_process_cpu_from_its_base() -> None:
    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    try:
        started = time.monotonic()
        timeline = CpuTimeline(started, {"busy": busy.pid, "idle": idle.pid, "none": None},
                               {"idle": 0.0}, step=0.1)
        deadline = time.monotonic() + 15  # however loaded the machine: until it spun 0.5 s
        while cpu_seconds(busy.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # samples after that
        table = timeline.stop().splitlines()
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait(timeout=10)
    assert table[0].split() == ["s", "busy", "CPU", "s", "idle", "CPU", "s"]
    rows = [[float(x) for x in line.split()] for line in table[1:]]
    assert len(rows) >= 3
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert [r[1] for r in rows] == sorted(r[1] for r in rows), "CPU time only grows"
    assert rows[-1][1] >= 0.4, "the busy process spun"
    assert rows[-1][2] < 0.2, "the sleeping one did not"
