"""guest_report with and without ``imex_domain``: absent keeps the row (and is no news to
the reports ConfigMap), null drops it, a new VM in the slot does not inherit it."""

from __future__ import annotations

import json

from host_agent.persist.reports import persist_reason
from host_agent.registry.models import StatusReport
from host_agent.registry.report_routes import guest_report
from host_agent.state.snapshot import EnsembleSnapshot, EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.unit.shared.test_imex_domain import domain_doc

ENS = EnsembleId("gpu", "hb")


def snap_of(state: State) -> EnsembleSnapshot:
    snap = state.get(ENS)
    assert snap is not None
    return snap


def parsed(**body: object) -> StatusReport:
    return StatusReport.model_validate_json(json.dumps({"imex_state": "READY", **body}))


def test_absent_keeps_the_row_null_drops_it_and_a_kept_row_is_no_news() -> None:
    now = [1000.0]
    state = State(clock=lambda: now[0])
    state.set(EnsembleSpec(ENS, 4, 50000), [Member(i, f"10.0.0.{i + 10}") for i in range(4)],
              [])
    doc = domain_doc(4)
    doc["nodes"]["1"]["connections"]["2"]["status"] = "DISCONNECTED"
    full = guest_report(parsed(imex_domain=doc), snap_of(state), 1, 1001.0, "10.0.0.11")
    assert full.links == ("CONNECTED", None, "DISCONNECTED", "CONNECTED")
    state.report(ENS, 1, full)
    beat = guest_report(parsed(), snap_of(state), 1, 1011.0, "10.0.0.11")
    assert beat.links == full.links and beat.received_at == 1011.0
    assert persist_reason(beat, full, since=0.0, refresh_after=40.0) is None  # no news
    state.report(ENS, 1, beat)
    gone = guest_report(parsed(imex_domain=None), snap_of(state), 1, 1021.0, "10.0.0.11")
    assert gone.links is None
    assert persist_reason(gone, beat, since=0.0, refresh_after=40.0) == "changed"


def test_a_new_vm_in_the_slot_does_not_inherit_the_row() -> None:
    now = [1000.0]
    state = State(clock=lambda: now[0])
    spec = EnsembleSpec(ENS, 4, 50000)
    state.set(spec, [Member(i, f"10.0.0.{i + 10}") for i in range(4)], [])
    state.report(ENS, 1, guest_report(parsed(imex_domain=domain_doc(4)), snap_of(state), 1,
                                      1001.0, "10.0.0.11"))
    now[0] = 1005.0
    state.set(spec, [Member(0, "10.0.0.10"), Member(1, "10.0.0.99")], [])
    beat = guest_report(parsed(), snap_of(state), 1, 1006.0, "10.0.0.99")
    assert beat.links is None
