"""The own-slot rule of DESIGN.md, as a table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guest_agent.config import Settings
from guest_agent.pins.ownslot import resolve_own
from imex_shared.model import Member

BASE = Settings(ensemble="rack1", namespace="team-a", max_members=4)

MEMBERS = (
    Member(0, "10.244.0.10", vmi="rack1-0"),
    Member(1, "10.244.0.11", vmi="gpu-node-b"),
    Member(2, "10.244.0.12", vmi="rack1-2"),
)

# (id, settings changes, local addrs, hostname, default-route addr,
#  expected index, pin, how, masquerade, note fragment)
CASES = [
    ("bridge: published IP is local", {}, {"10.244.0.12", "127.0.0.1"}, "whatever",
     "10.244.0.12", 2, "10.244.0.12", "local_ip", False, "a local address"),
    ("own_index wins over everything", {"own_index": 1}, {"10.244.0.12"}, "rack1-2",
     "10.244.0.12", 1, "10.244.0.12", "own_index", True, "not a local address"),
    ("vmi equals hostname (fqdn hostname)", {}, {"10.0.2.2"}, "gpu-node-b.example.internal",
     "10.0.2.2", 1, "10.0.2.2", "vmi", True, "masquerade"),
    ("trailing -n of the hostname", {}, {"10.0.2.2"}, "rack1-0-extra-3",
     None, 3, None, "hostname", False, "not published"),
    ("masquerade auto pins the default-route address", {}, {"10.0.2.2", "127.0.0.1"},
     "rack1-2", "10.0.2.2", 2, "10.0.2.2", "vmi", True, "peers use 10.244.0.12"),
    ("masquerade published keeps the published IP", {"own_slot": "published"}, {"10.0.2.2"},
     "rack1-2", "10.0.2.2", 2, "10.244.0.12", "vmi", True, "may not find itself"),
    ("local always pins the local address", {"own_slot": "local"}, {"10.244.0.12",
     "192.168.1.5"}, "x", "192.168.1.5", 2, "192.168.1.5", "local_ip", False, "own_slot = local"),
    ("masquerade without default route falls back to published", {}, {"10.0.2.2"},
     "rack1-0", None, 0, "10.244.0.10", "vmi", True, "no default-route address"),
    ("loopback default-route address is not usable", {}, {"10.0.2.2"}, "rack1-0",
     "127.0.0.1", 0, "10.244.0.10", "vmi", True, "no default-route address"),
    ("nothing matches", {}, {"10.9.9.9"}, "localhost", "10.9.9.9", None, None, "unknown",
     False, "own slot unknown"),
    ("hostname index out of range", {}, set(), "rack1-7", None, None, None, "unknown", False,
     "own slot unknown"),
    ("own slot not published yet (auto) pins the route provisionally", {}, {"10.0.0.3"},
     "rack1-3", "10.0.0.3", 3, "10.0.0.3", "hostname", False, "pinned provisionally"),
    ("own slot not published yet (auto, ips mode) waits", {"mode": "ips"}, {"10.0.0.3"},
     "rack1-3", "10.0.0.3", 3, None, "hostname", False, "not published yet"),
    ("own slot not published yet (auto, no default route) waits", {}, {"10.0.0.3"},
     "rack1-3", None, 3, None, "hostname", False, "not published yet"),
    ("own slot not published yet (auto, own_index) pins the route provisionally",
     {"own_index": 5}, {"10.0.0.5"}, "x", "10.0.0.5", 5, "10.0.0.5", "own_index", False,
     "pinned provisionally"),
    ("own slot not published yet (local) still pins", {"own_slot": "local"}, {"10.0.0.3"},
     "rack1-3", "10.0.0.3", 3, "10.0.0.3", "hostname", False, "own_slot = local"),
]


@pytest.mark.parametrize(
    ("changes", "local", "hostname", "route", "index", "pin", "how", "masq", "note"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_own_slot_rule(
    changes: dict[str, object],
    local: set[str],
    hostname: str,
    route: str | None,
    index: int | None,
    pin: str | None,
    how: str,
    masq: bool,
    note: str | None,
) -> None:
    settings = replace(BASE, **changes)  # type: ignore[arg-type]
    own = resolve_own(settings, MEMBERS, local, hostname, route)
    assert (own.index, own.pin_ip, own.how, own.masquerade) == (index, pin, how, masq), own.note
    if note is not None:
        assert note in own.note


def test_own_index_with_published_local_ip() -> None:
    own = resolve_own(replace(BASE, own_index=1), MEMBERS, {"10.244.0.11"}, "h", "10.244.0.11")
    assert (own.index, own.pin_ip, own.published_ip) == (1, "10.244.0.11", "10.244.0.11")


def test_pins_mapping_input_and_canonical_addresses() -> None:
    # DNS views have no vmi: a mapping works, and IPv6 text is compared canonically
    own = resolve_own(BASE, {0: "FD00:0::10", 1: "10.0.0.2"}, {"fd00::10"}, "h", None)
    assert (own.index, own.pin_ip, own.how) == (0, "fd00::10", "local_ip")


def test_two_local_published_ips_lowest_index_wins_and_says_so() -> None:
    own = resolve_own(BASE, {3: "10.0.0.3", 1: "10.0.0.1"}, {"10.0.0.1", "10.0.0.3"}, "h", None)
    assert own.index == 1 and "also local" in own.note
