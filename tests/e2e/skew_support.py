"""What the skew and TLS e2e modules share: an ensemble of one release's guests, and the
wait for every member's report from a given release (TEST SUPPORT)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tests.sandbox.ensemble import EnsembleSpec, Sandbox, Vm, wait_for
from tests.sandbox.virt_controller import Pool, VirtController


@dataclass
class SkewRack:
    sbx: Sandbox
    ctl: VirtController
    spec: EnsembleSpec
    pool: Pool

    def vms(self) -> list[Vm]:
        return self.sbx.vms_of(self.spec)

    def settle(self, timeout: float = 120.0) -> float:
        with self.sbx.diagnostics_on_failure():
            return self.sbx.wait_converged(self.spec, timeout)


def reports_in(rack: SkewRack, version: str, since: float = 0.0, timeout: float = 60.0
               ) -> dict[int, dict[str, object]]:
    """Every running member's report as the registry shows it, each from ``version`` and
    from the member's current address (received after ``since``, a Unix time)."""

    def probe() -> dict[int, dict[str, object]] | None:
        doc = rack.sbx.registry_json(rack.spec)
        want = {vm.index: vm.ip for vm in rack.vms()}
        got = {m["index"]: m["guest"] for m in doc.get("members", []) if m.get("guest")}
        ok = all(i in got and got[i].get("agent_version") == version
                 and got[i].get("from_ip") == ip and got[i].get("imex_state") == "READY"
                 and _after(got[i].get("received_at"), since) for i, ip in want.items())
        return got if ok and want else None

    with rack.sbx.diagnostics_on_failure():
        return wait_for(f"every member's report from {version}", probe, timeout, 0.5,
                        lambda: rack.sbx.registry_table(rack.spec))


def _after(stamp: object, since: float) -> bool:
    if not isinstance(stamp, str):
        return False
    moment = time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    return moment >= since - 1
