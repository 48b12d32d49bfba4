"""The soak's loop: inject the schedule, undo after each hold, check the invariants.

TEST CODE. One thread drives everything (the sandbox is single-threaded by design); a
loop turn every :data:`TICK` seconds injects the faults now due, ticks and undoes the
held ones, starts agents whose RestartSec passed, runs the continuous checks and probes
convergence for the faults undone since. Every ``check_every`` seconds, and at the end,
it quiesces: every held fault is undone, the rack gets at most ``quiesce`` seconds to
converge and stay converged for :data:`SETTLE_S`, and the quiet invariants are checked.
The schedule's clock stops while it quiesces, so the drawn schedule is what runs.

A fault **survived** when nothing was violated from its injection to the end of the
first quiesce after its undo. Its convergence time is the delay from its undo until the
rack next converged (both ensembles, invariants.converged), at the probe's 1 s
resolution; faults overlap, so a time may include another fault's recovery.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.sandbox.imex_standin import PEER_TIMEOUT_S
from tests.soak import invariants as inv
from tests.soak.faults import NEEDS_API, Active, Injector
from tests.soak.rack import SoakRack
from tests.soak.schedule import BY_NAME, KIND_NAMES, Fault

log = logging.getLogger("soak")
TICK = 0.5
#: invariant 7's leak check: RSS at 10 minutes against the end, in runs of 30 minutes+
RSS_EARLY_S = 600.0
RSS_MIN_RUN_S = 1800.0
#: how long a quiesce's convergence must hold: longer than a peer's ping timeout (a ping
#: an undone fault swallowed can still drop its link that much later) plus its first redial
SETTLE_S = PEER_TIMEOUT_S + 1.0
#: the invariants a quiet rack reaches in its own time, so a quiesce re-checks them
#: until its bound: convergence (1), the replicas' views (5) and the domain view (8)
CONVERGENCE = (1, 5, 8)


@dataclass
class Outcome:
    fault: Fault
    injected_s: float  # schedule seconds
    detail: str = ""
    converge_s: float | None = None
    #: set by the first quiesce after its undo: no violation since its injection
    survived: bool | None = None


@dataclass
class Violation:
    invariant: int
    t: float
    what: str
    schedule: list[str]
    logs: str = ""


@dataclass
class Held:
    """Whether a condition has held, without a break, for ``hold`` seconds."""

    hold: float
    #: when the current unbroken run began; None while the condition is false
    since: float | None = None

    def observe(self, now: float, ok: bool) -> bool:
        """Record one look at ``now``; True once the run that includes it is long enough."""
        if not ok:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.hold


def may_undo(a: Active, api_held: bool) -> bool:
    """Whether a fault due for its undo may be undone now: a crash's rejoin writes the new
    VMI, the virt-controller's write, so it waits while an API fault is held (an undo
    during an outage failed with "Connection refused", and the slot's VM was lost to its
    pool for the rest of the run). Its hold is then longer than drawn."""
    return not (api_held and a.fault.kind in NEEDS_API)


def undo_order(active: list[Active]) -> list[Active]:
    """The order a quiesce undoes the held faults in: the API's first, so that the
    guests' undos that write to it find it answering; otherwise as they were injected."""
    return sorted(active, key=lambda a: BY_NAME[a.fault.kind].group != "api")


@dataclass
class Run:
    rack: SoakRack
    seed: int
    duration: float
    faults: list[Fault]
    check_every: float
    quiesce: float
    replay: str
    injector: Injector = field(init=False)
    checks: inv.Continuous = field(init=False)
    active: list[Active] = field(default_factory=list)
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    #: undone and not yet converged: fault id -> monotonic undo time
    awaiting: dict[int, float] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    quiesces: list[float] = field(default_factory=list)
    t0: float = 0.0
    paused: float = 0.0
    #: invariant 7's leak check: RSS after 10 minutes, and at the end
    rss_early: dict[str, tuple[int, int]] = field(default_factory=dict)
    rss_late: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.injector = Injector(self.rack)
        self.checks = inv.Continuous(self.rack)

    def now_s(self) -> float:
        """Schedule seconds (quiesces excluded)."""
        return time.monotonic() - self.t0 - self.paused

    # ---- the loop
    def run(self) -> None:
        self.t0 = time.monotonic()
        pending = list(self.faults)
        next_check = self.check_every
        end = self.t0 + self.duration
        last_probe = 0.0
        while time.monotonic() < end:
            t = self.now_s()
            api_held = any(BY_NAME[a.fault.kind].group == "api" for a in self.active)
            for f in [f for f in pending if f.at <= t]:
                if f.kind in NEEDS_API and api_held:
                    continue  # the virt-controller's writes wait for the API
                pending.remove(f)
                self._inject(f)
            for a in list(self.active):
                if time.monotonic() >= a.undo_at and may_undo(a, api_held):
                    self._undo(a)
                else:
                    self._guard(a, self.injector.tick, "tick")
            self.injector.pending_restarts()
            self._continuous()
            if self.awaiting and time.monotonic() - last_probe >= 1.0:
                last_probe = time.monotonic()
                self._probe()
            if not self.rss_early and time.monotonic() - self.t0 >= RSS_EARLY_S:
                self.rss_early = inv.rss(self.rack)
            if self.now_s() >= next_check and time.monotonic() + 30 < end:
                self._quiesce()
                next_check = self.now_s() + self.check_every
            time.sleep(TICK)
        self._quiesce()
        if self.duration >= RSS_MIN_RUN_S and self.rss_early:
            self.rss_late = inv.rss(self.rack)
            for found in inv.rss_growth(self.rss_early, self.rss_late):
                self._violation(found)

    def _guard(self, a: Active, fn: Any, what: str) -> None:
        try:
            fn(a)
        except Exception as e:
            log.warning("%s of %s failed: %s", what, a.fault.describe(), e)
            a.detail += f" [{what} failed: {e}]"

    def _inject(self, f: Fault) -> None:
        now = time.monotonic()
        a = Active(f, now, now + f.hold)
        log.info("inject %s", f.describe())
        self.checks.credits.grant(f.kind, f.targets)
        self.outcomes[f.id] = Outcome(f, self.now_s())
        self._guard(a, self.injector.inject, "inject")
        self.active.append(a)

    def _undo(self, a: Active) -> None:
        self.active.remove(a)
        self._guard(a, self.injector.undo, "undo")
        a.undone_at = time.monotonic()
        self.outcomes[a.fault.id].detail = a.detail.strip()
        self.awaiting[a.fault.id] = a.undone_at
        log.info("undo   %s %s", a.fault.describe(), a.detail)

    def _probe(self) -> None:
        if inv.converged(self.rack) is None:
            now = time.monotonic()
            for fid, t in self.awaiting.items():
                self.outcomes[fid].converge_s = max(0.0, now - t)
            self.awaiting.clear()

    def _continuous(self) -> None:
        restarting = set(self.injector.agent_restarts)
        found = self.checks.readers() + self.checks.audit() + \
            self.checks.processes(self.injector.down, restarting) + \
            self.checks.generations() + self.checks.restarts() + self.checks.signals()
        for f in found:
            self._violation(f)

    def _quiesce(self) -> None:
        t_start = time.monotonic()
        log.info("quiesce at %.0f s: undoing %d faults", self.now_s(), len(self.active))
        for a in undo_order(self.active):
            self._undo(a)
        deadline = t_start + self.quiesce
        stable_since = self._settle(deadline)
        self._probe()
        found = inv.quiesced(self.rack)
        # the registry's domain view follows the guests' next report, and a link may
        # drop once more as IMEX notices a fault that was undone under it
        while found and all(f.invariant in CONVERGENCE for f in found) and \
                time.monotonic() < deadline:
            time.sleep(1)
            stable_since = self._settle(deadline)
            found = inv.quiesced(self.rack)
        for f in found:
            self._violation(f)
        # every restart the quiesced faults caused has happened: count them, then let
        # their credits go (invariant 3)
        found = self.checks.restarts(now=True)
        for f in found:
            self._violation(f)
        self.checks.credits.quiesced()
        for o in self.outcomes.values():
            if o.survived is None and all(id(a.fault) != id(o.fault) for a in self.active):
                o.survived = not any(v.t >= o.injected_s for v in self.violations)
        took = time.monotonic() - t_start
        self.quiesces.append((stable_since if stable_since is not None
                              else time.monotonic()) - t_start)
        log.info("quiesced in %.1f s; %d violations so far", took, len(self.violations))
        self.awaiting.clear()
        self.paused += took

    def _settle(self, deadline: float) -> float | None:
        """Wait, until ``deadline``, for the rack to converge and stay converged for
        :data:`SETTLE_S`; returns when that began (monotonic), None if it never did.

        One look is not enough: a link whose pings an undone fault swallowed still reads
        CONNECTED until IMEX's peer timeout drops it, and then it redials. Seed
        0xd2975029 saw that: converged at the quiesce, then a link down 1.4 s later."""
        held = Held(SETTLE_S)
        while time.monotonic() < deadline:
            # an agent killed on purpose restarts within RestartSec
            self.injector.pending_restarts()
            self._continuous()
            quiet = not self.injector.agent_restarts and inv.converged(self.rack) is None
            if held.observe(time.monotonic(), quiet):
                break
            time.sleep(TICK)
        return held.since

    def _violation(self, f: inv.Finding) -> None:
        t = self.now_s()
        log.error("VIOLATION of invariant %d at %.1f s: %s", f.invariant, t, f.what)
        sched = [o.fault.describe() + (f" ({o.detail})" if o.detail else "")
                 for o in sorted(self.outcomes.values(), key=lambda o: o.injected_s)]
        logs = self._log_tails()
        if f.logs:
            logs = f"--- why ---\n{f.logs}\n{logs}"
            log.error("%s", f.logs)
        self.violations.append(Violation(f.invariant, round(t, 1), f.what, sched, logs))

    def _log_tails(self) -> str:
        parts = []
        for ident in self.rack.replicas:
            try:
                text = self.rack.replica_log(ident).read_text(errors="replace")[-1500:]
            except OSError:
                text = ""
            parts.append(f"--- {ident} ---\n{text}")
        for slot in self.rack.slots():
            try:
                parts.append(f"--- guest {slot[0]}{slot[1]} ---\n"
                             f"{self.rack.vm(slot).log_tail(600)}")
            except KeyError:
                continue
        return "\n".join(parts)

    # ---- the results
    def table(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for kind in KIND_NAMES:
            got = [o for o in self.outcomes.values() if o.fault.kind == kind]
            times = sorted(o.converge_s for o in got if o.converge_s is not None)
            out[kind] = {"injected": len(got), "survived": sum(bool(o.survived) for o in got),
                         "p50_s": percentile(times, 50), "p99_s": percentile(times, 99),
                         "max_s": round(times[-1], 1) if times else None}
        return out

    def results(self, wall: float, vms: int) -> dict[str, Any]:
        return {
            "seed": self.seed, "duration_s": self.duration, "vms": vms,
            "wall_s": round(wall, 1),
            "check_every_s": self.check_every, "quiesce_max_s": self.quiesce,
            "quiesces": len(self.quiesces),
            "quiesce_p50_s": percentile(sorted(self.quiesces), 50),
            "faults": self.table(),
            "audit": {"host_agent_writes": self.checks.writes_seen,
                      "guarded_writes": self.checks.guarded_writes,
                      "stale_refused": self.checks.stale_refused,
                      "stale_events": self.checks.stale_events},
            "reads": sum(self.checks.reads.values()),
            "generations": {"delivered": self.checks.observed.delivered,
                            "checked": self.checks.observed.checked},
            "imex_ends": self.checks.credits.ends,
            "signals": {"met": self.checks.signals_met,
                        "lost": sum(len(v) for v in self.checks.lost.values()),
                        "unjudged": sum(w for _, w in self.checks.owed.values())},
            "rss_kb": {"at_10_min": {k: v[1] for k, v in self.rss_early.items()},
                       "at_end": {k: v[1] for k, v in self.rss_late.items()}},
            "not_checked": {str(k): v for k, v in inv.NOT_CHECKED.items()},
            "violations": [{"invariant": v.invariant, "t_s": v.t, "what": v.what,
                            "schedule": v.schedule, "logs": v.logs, "replay": self.replay}
                           for v in self.violations],
            "replay": self.replay,
        }


def percentile(sorted_values: list[float], p: int) -> float | None:
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return round(sorted_values[0], 1)
    qs = statistics.quantiles(sorted_values, n=100, method="inclusive")
    return round(qs[p - 1] if p < 100 else sorted_values[-1], 1)


def format_table(res: dict[str, Any]) -> str:
    lines = [f"{'fault':<16}{'injected':>9}{'survived':>9}{'p50 s':>8}{'p99 s':>8}"
             f"{'max s':>8}"]
    total = [0, 0]
    for kind, row in res["faults"].items():
        total[0] += row["injected"]
        total[1] += row["survived"]

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"
        lines.append(f"{kind:<16}{row['injected']:>9}{row['survived']:>9}{f(row['p50_s']):>8}"
                     f"{f(row['p99_s']):>8}{f(row['max_s']):>8}")
    lines.append(f"{'total':<16}{total[0]:>9}{total[1]:>9}")
    return "\n".join(lines)


def write_results(path: Path, res: dict[str, Any]) -> None:
    path.write_text(json.dumps(res, indent=1) + "\n")
