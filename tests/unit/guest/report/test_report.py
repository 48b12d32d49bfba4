"""What the guest reports: status fields of an applied pass, of IMEX and of a collection
pass, and the status PUT's body (pure parts of guest_agent.report.report)."""

from __future__ import annotations

from guest_agent.pins.merge import Known, PinPlan
from guest_agent.pins.ownslot import OwnSlot
from guest_agent.report.report import (
    Collected,
    status_body,
    take_applied,
    take_collected,
    take_imex,
)
from guest_agent.report.status_file import Status
from imex_shared.imex_domain import Fabric
from imex_shared.model import EnsembleId
from tests.unit.shared.test_imex_domain import domain_doc

ENS = EnsembleId("gpu", "rack-a")
UUID = "6a8a4a7e-1c5e-4b5a-9d0e-0b9b6c1d2e3f"


def status() -> Status:
    return Status(ensemble="rack-a", namespace="gpu", domain_id=ENS.domain_id, mode="names",
                  agent_version="1.2.3")


def test_take_applied_fills_the_slot_the_source_and_every_member() -> None:
    own = OwnSlot(1, "10.0.2.2", "vmi", "slot 1 (found by vmi): masquerade", "10.244.0.11", True)
    known = Known({0: "10.244.0.10", 1: "10.244.0.11", 2: "10.244.0.12"}, {1: "rack-a-1"},
                  {0: f"{UUID}.1", 1: f"{UUID}.1", 2: f"{UUID}.2"}, "registry", 9)
    plan = PinPlan(own, {0: "10.244.0.10", 1: "10.0.2.2", 2: "10.244.0.12"},
                   {0: "10.244.0.10", 1: "10.0.2.2"}, {0: "10.244.0.10", 1: "10.0.2.2"})
    s = status()
    take_applied(s, ENS, plan, known, "n" * 64, "h" * 64)
    take_applied(s, ENS, plan, known, "n" * 64, "h" * 64)
    assert s.applies == 2
    assert (s.own_index, s.own_slot, s.own_slot_how, s.own_ip) == (
        1, ENS.slot(1), "vmi", "10.0.2.2")
    assert s.own_slot_note == own.note
    assert (s.source, s.generation_applied) == ("registry", 9)
    assert (s.nodes_config_sha256, s.hosts_sha256) == ("n" * 64, "h" * 64)
    assert s.members == [
        {"index": 0, "slot": ENS.slot(0), "ip": "10.244.0.10", "local_ip": "10.244.0.10",
         "clique": f"{UUID}.1"},
        {"index": 1, "slot": ENS.slot(1), "ip": "10.244.0.11", "local_ip": "10.0.2.2",
         "clique": f"{UUID}.1"},
        {"index": 2, "slot": ENS.slot(2), "ip": "10.244.0.12", "local_ip": None,
         "clique": f"{UUID}.2"},
    ]
    unknown = PinPlan(OwnSlot(None, None, "unknown", "own slot unknown"), {}, {}, {})
    take_applied(s, ENS, unknown, Known(), "n" * 64, "h" * 64)
    assert (s.own_index, s.own_slot, s.members, s.source) == (None, None, [], None)


def test_take_imex_counts_changes_and_takes_a_new_error_once() -> None:
    s = status()
    assert take_imex(s, ("UNKNOWN", 0, 0, 0, None), None, 5.0) == (False, False)
    assert take_imex(s, ("READY", 1, 0, 1, 42), None, 5.0) == (True, False)
    assert (s.imex_state, s.signals, s.restarts, s.starts, s.imex_pid) == ("READY", 1, 0, 1, 42)
    assert s.last_error is None
    assert take_imex(s, ("READY", 1, 0, 1, 42), "restart failed", 6.0) == (True, True)
    assert (s.last_error, s.last_error_at) == ("restart failed", 6.0)
    # the same error again is no news, neither is an empty one
    assert take_imex(s, ("READY", 1, 0, 1, 42), "restart failed", 7.0) == (False, False)
    assert take_imex(s, ("READY", 1, 0, 1, 42), "", 7.0) == (False, False)
    assert s.last_error_at == 6.0


def test_take_collected_puts_the_own_row_and_fabric_and_takes_the_error_once() -> None:
    s = status()
    doc = domain_doc(3, down=frozenset({2}))
    result = Collected(imex_domain=doc, fabric=Fabric(UUID, 4), fabric_known=True,
                       channels=[0, 3], errors=1, last_error="garbled -N", at=100.0)
    take_collected(s, result, 0, 7.0)
    assert s.imex_domain_status == "DEGRADED"
    assert s.imex_row == {"1": "CONNECTED", "2": "DISCONNECTED"}
    assert s.fabric == {"cluster_uuid": UUID, "clique_id": 4} and s.clique == f"{UUID}.4"
    assert (s.imex_channel0, s.domain_errors, s.domain_at) == (True, 1, 100.0)
    assert s.imex_channels == [0, 3]
    assert (s.last_error, s.last_error_at, result.last_error) == ("garbled -N", 7.0, None)
    # no own slot, no view: no row, no status; the old error stays
    take_collected(s, Collected(last_error="garbled -N"), None, 8.0)
    assert (s.imex_domain_status, s.imex_row, s.fabric, s.clique) == (None, None, None, None)
    assert s.last_error_at == 7.0


def test_status_body_in_wire_order_with_and_without_a_collection_pass() -> None:
    s = status()
    s.imex_state, s.generation_applied, s.signals, s.restarts = "READY", 9, 2, 1
    s.nodes_config_sha256, s.hosts_sha256 = "n" * 64, "h" * 64
    s.tls = {"cert_not_after": "2026-12-31T00:00:00Z"}
    base = {"imex_state": "READY", "generation_applied": 9, "nodes_config_sha256": "n" * 64,
            "hosts_sha256": "h" * 64, "signals": 2, "restarts": 1, "agent_version": "1.2.3"}
    body = status_body(s, None, with_cert=False)
    assert body == base and list(body) == list(base)
    body = status_body(s, None, with_cert=True)
    assert body == {**base, "cert_not_after": "2026-12-31T00:00:00Z"}
    # a pass before nvidia-smi answered: no fabric key; a view of None is sent as null
    body = status_body(s, Collected(channels=[0]), with_cert=False)
    assert list(body) == [*base, "imex_domain", "imex_channels", "imex_channel0"]
    assert body["imex_domain"] is None and body["imex_channel0"] is True
    assert body["imex_channels"] == [0]
    body = status_body(s, Collected(channels=[1, 2]), with_cert=False)
    assert body["imex_channels"] == [1, 2] and body["imex_channel0"] is False
    # the preflight checks ride along once they ran
    s.preflight = [{"name": "dns", "result": "PASS", "message": "ok"}]
    assert status_body(s, None, with_cert=False)["preflight"] == s.preflight
    s.preflight = []
    doc = domain_doc(2)
    body = status_body(s, Collected(imex_domain=doc, fabric_known=True), with_cert=False)
    assert list(body) == [*base, "imex_domain", "fabric", "imex_channels", "imex_channel0"]
    assert body["imex_domain"] == {"nodes": {}, "timestamp": 1795974000, "status": "UP"}
    assert body["fabric"] is None  # before the own slot is known: no entry of its own
    s.own_index = 1  # then only its own entry goes, which is all a registry keeps
    body = status_body(s, Collected(imex_domain=doc, fabric_known=True), with_cert=False)
    assert body["imex_domain"] == {"nodes": {"1": doc["nodes"]["1"]},
                                   "timestamp": 1795974000, "status": "UP"}
    assert doc["nodes"].keys() == {"0", "1"}  # the collected view is left whole
    body = status_body(s, Collected(fabric=Fabric(UUID, 4), fabric_known=True), False)
    assert body["fabric"] == {"cluster_uuid": UUID, "clique_id": 4}


def test_refused_fields_are_a_0_1_registrys_extra_forbidden_only() -> None:
    import json

    from guest_agent.report.report import left_out, refused_fields

    old = {"error": "registry_ca_sha256: Extra inputs are not permitted; channels: Extra "
           "inputs are not permitted",
           "detail": [{"loc": ["registry_ca_sha256"], "msg": "Extra inputs are not permitted"},
                      {"loc": ["channels"], "msg": "Extra inputs are not permitted"},
                      {"loc": ["signals"], "msg": "Input should be a valid integer"},
                      {"loc": ["fabric", "x"], "msg": "Extra inputs are not permitted"},
                      {"loc": ["imex_state"], "msg": "Extra inputs are not permitted"}]}
    assert refused_fields(json.dumps(old).encode()) == {"registry_ca_sha256", "channels"}
    assert refused_fields(b"not json") == frozenset()
    assert refused_fields(b'{"detail": "x"}') == frozenset()
    assert left_out({"a": 100.0, "b": 0.0}, now=650.0, retry=600.0) == {"a"}
