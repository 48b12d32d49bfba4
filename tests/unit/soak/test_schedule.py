"""The soak's fault schedule (tests/soak/schedule.py): same seed, same schedule; kinds do
not move each other; one VM never carries two guest faults; seeds parse or say why not."""

from __future__ import annotations

import pytest

from tests.soak import schedule as sch


def test_one_seed_gives_one_schedule_and_another_seed_another() -> None:
    lay = sch.layout(6)
    a = sch.draw(1234, 3600, lay)
    assert a == sch.draw(1234, 3600, lay)
    assert a != sch.draw(1235, 3600, lay)
    assert [f.id for f in a] == list(range(1, len(a) + 1))
    assert [f.at for f in a] == sorted(f.at for f in a)
    assert {f.kind for f in a} == set(sch.KIND_NAMES)  # an hour draws every kind


def test_a_kind_left_out_does_not_move_the_others() -> None:
    lay = sch.layout(6)
    full = sch.draw(7, 1800, lay, kinds=["api-slow", "leader-kill"])
    alone = sch.draw(7, 1800, lay, kinds=["api-slow"])
    assert [(f.at, f.hold, f.param) for f in full if f.kind == "api-slow"] == \
        [(f.at, f.hold, f.param) for f in alone]


def test_guest_faults_never_share_a_vm_and_host_faults_never_overlap() -> None:
    for seed in range(20):
        faults = sch.draw(seed, 3600, sch.layout(6), rate_scale=4)
        busy: dict[object, float] = {}
        for f in faults:
            spec = sch.BY_NAME[f.kind]
            claims = [("vm", *t) for t in f.targets] if spec.group == "guest" else \
                ["replicas"] if spec.group == "host" else []
            for c in claims:
                assert busy.get(c, -1.0) <= f.at, (seed, f.describe())
                busy[c] = f.until + spec.busy
            assert f.until <= 3600 + 1e-6
            if f.kind == "imex-oneway":
                assert f.targets[0][0] == f.targets[1][0] and f.targets[0] != f.targets[1]


def test_layout_and_seeds_are_checked_with_a_reason() -> None:
    assert sch.layout(6).sizes == {"a": 4, "b": 2}
    assert sch.layout(18).sizes == {"a": 12, "b": 6}
    with pytest.raises(ValueError, match="at least 4 VMs"):
        sch.layout(3)
    assert sch.parse_seed("0x1f") == 31 and sch.parse_seed(" 42 ") == 42
    with pytest.raises(ValueError, match="seed 'x1'"):
        sch.parse_seed("x1")
    assert sch.commit_seed("4ae0253deadbeef") == 0x4AE0253D
    with pytest.raises(ValueError, match="8 hex digits"):
        sch.commit_seed("4ae02")
    assert sch.read_seed_list("# found bugs\n12  # note\n\n0x10\n") == [12, 16]
    with pytest.raises(ValueError, match="line 2"):
        sch.read_seed_list("1\nzz\n")
