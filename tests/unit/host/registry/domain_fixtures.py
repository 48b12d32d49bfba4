"""Snapshots of ensembles with reports, for the domain view's tests (pure, no server)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from host_agent.state.snapshot import EnsembleSnapshot, EnsembleSpec, GuestReport, PublishedMember
from imex_shared.model import EnsembleId, Member

ENS = EnsembleId("rack-a", "gb200")
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z; every slot got its address then
NOW = T0 + 100
SHA = "a" * 64
CLIQUE_A = ("0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10", 1)
CLIQUE_B = ("0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10", 2)

Link = Callable[[int, int], str]


def all_connected(a: int, b: int) -> str:
    return "CONNECTED"


def report(index: int, n: int, link: Link = all_connected, *, state: str = "READY",
           at: float = NOW - 5, sha: str = SHA, fabric: tuple[str, int] | None = None,
           channel0: bool | None = True, view: bool = True, max_members: int = 18
           ) -> GuestReport:
    """Member ``index``'s report: its own row over ``max_members`` slots (absent slots
    NEVER_CONNECTED, as IMEX shows them), link(index, j) for the ``n`` published peers."""
    row = tuple(None if j == index else (link(index, j) if j < n else "NEVER_CONNECTED")
                for j in range(max_members)) if view else None
    fields: dict[str, object] = {
        "imex_state": state, "nodes_config_sha256": sha, "imex_channel0": channel0,
        "fabric": {"cluster_uuid": fabric[0], "clique_id": fabric[1]} if fabric else None}
    return GuestReport(at, f"10.0.0.{10 + index}", fields, row)


def snapshot(n: int, reports: dict[int, GuestReport] | None = None,
             indices: Iterable[int] | None = None, max_members: int = 18,
             since: float = T0) -> EnsembleSnapshot:
    idx = list(indices) if indices is not None else list(range(n))
    return EnsembleSnapshot(
        spec=EnsembleSpec(ENS, max_members, 50000),
        generation=1_800_000_000_000,
        members=tuple(PublishedMember(Member(i, f"10.0.0.{10 + i}", f"gb200-{i}", "node-a",
                                             "Running", True), since) for i in idx),
        problems=(), changed_at=T0, reports=reports or {})


def full(n: int, link: Link = all_connected, **kw: object) -> EnsembleSnapshot:
    """n members, every one reporting with ``link``."""
    return snapshot(n, {i: report(i, n, link, **kw) for i in range(n)})  # type: ignore[arg-type]
