"""``python -m tests.soak.realk8s --duration SECONDS --seed N``: the soak on the real API.

``make soak-realk8s`` (issue 30). The namespace soak (``python -m tests.soak``) runs
against the API double, which cannot show what a real control plane does when it dies:
here the API is tests/realk8s's etcd and kube-apiserver, and the schedule kills and
restarts them (:data:`KINDS`) beside leader kills and stops and member moves, one fault
at a time, each followed by a quiesce. Checked against the real API:

- **4**, continuously: no 2xx write of a slice, Service, CR (status) or Secret by a
  replica that did not hold the Lease when the write was received (the apiserver's audit
  log, tests/soak/apiaudit.py);
- **5**, at every quiesce: every replica serves the same members and generation, the
  members are the running VMIs at their current addresses, the CR status equals the
  registry's JSON (tests/host_support/ensembles.py), and every report answered 2xx is
  shown by every replica (docs/host-agent.md: within one watch event);
- **6**, both ways: every 2 s, no running replica serves a generation older than one
  the API has held for more than observed.BOUND_S (counted from the end of the
  replica's last pause and of the API's last outage, since a replica cannot observe
  what the API cannot serve); at every quiesce, none serves one older than the API's.

Also 7's first half: no replica exited that the schedule did not kill. Exit 0 only
without a violation. Writes ``soak-results.json`` (``--results``) in the namespace
soak's shape, with ``"api": "real"``. No root needed: everything is on loopback.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.host_support.ensembles import status_vs_registry
from tests.realk8s.agentproc import AGENT_SA_NAMESPACE
from tests.sandbox.ensemble import REPO_ROOT
from tests.soak.apiaudit import Ledger, parse
from tests.soak.observed import Observed
from tests.soak.realk8s_rack import (
    NAMES,
    REPORT_BOUND_S,
    Rack,
    Reporter,
)
from tests.soak.runner import Held, format_table, percentile, write_results

log = logging.getLogger("soak.realk8s")

LEASE_NAME = "imex-host-agent"
#: seconds convergence must hold before a quiesce ends (the Lease plus a retry)
SETTLE_S = 4.0
SERVED_EVERY_S = 2.0
#: probability that a control-plane or replica fault also moves a member while it lasts
CHURN_P = 0.6


@dataclass(frozen=True)
class Kind:
    name: str
    hold: tuple[float, float]
    weight: float
    what: str


KINDS: tuple[Kind, ...] = (
    Kind("apiserver-kill", (2, 12), 2, "SIGKILL of kube-apiserver; it starts again on the "
         "same port after the hold (no final bookmark to any watch)"),
    Kind("apiserver-restart", (0, 0), 1, "SIGTERM of kube-apiserver and an immediate start "
         "(a control-plane upgrade)"),
    Kind("etcd-kill", (2, 12), 2, "SIGKILL of etcd; the apiserver answers errors until it "
         "starts again on the same data after the hold"),
    Kind("compact-restart", (0, 0), 1, "etcd's history compacted, then kube-apiserver "
         "SIGKILLed and started: every watch resumes from a compacted version (410)"),
    Kind("leader-kill", (2, 10), 2, "SIGKILL of the leading replica; a new one (a new "
         "identity, as a new pod) starts after the hold"),
    Kind("leader-stop", (6, 15), 2, "SIGSTOP of the leader past its Lease (4 s), then "
         "SIGCONT: the woken replica must not write"),
    Kind("migration", (0, 0), 2, "a VMI's address changes (a live migration)"),
    Kind("vm-crash", (3, 15), 1, "a VMI is deleted; after the hold it is back with a new "
         "address"),
)
KIND_NAMES = tuple(k.name for k in KINDS)


@dataclass(frozen=True)
class Fault:
    n: int
    kind: str
    #: seconds of quiet before it, and of its hold
    gap: float
    hold: float
    #: the VMI it moves (migration, vm-crash) or that moves while it lasts (churn)
    target: str
    churn: bool


def draw(seed: int, count: int, members: list[str]) -> list[Fault]:
    """The schedule, pure: ``count`` faults in order; the run injects them until its
    duration is spent, so one seed gives the same sequence on every machine."""
    rnd = random.Random(f"{seed}:realk8s")
    weights = [k.weight for k in KINDS]
    out = []
    for n in range(count):
        kind = rnd.choices(KINDS, weights)[0]
        gap = round(rnd.uniform(2, 8), 1)
        hold = round(rnd.uniform(*kind.hold), 1)
        target = rnd.choice(sorted(members))
        churn = rnd.random() < CHURN_P and kind.name not in ("migration", "vm-crash")
        out.append(Fault(n, kind.name, gap, hold, target, churn))
    return out


@dataclass
class Finding:
    invariant: int
    what: str


@dataclass
class Soak:
    rack: Rack
    seed: int
    duration: float
    quiesce: float
    replay: str
    reporter: Reporter = field(init=False)
    ledger: Ledger = field(default_factory=lambda: Ledger(AGENT_SA_NAMESPACE, LEASE_NAME))
    observed: Observed = field(default_factory=Observed)
    audit_offset: int = 0
    api_gen: dict[str, int] = field(default_factory=dict)
    api_down_since: float | None = None
    #: when the API last came back (reports stored before it reach replicas after)
    api_up_since: float = 0.0
    served_at: float = 0.0
    t0: float = 0.0
    done: list[tuple[Fault, float | None]] = field(default_factory=list)
    quiesces: list[float] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reporter = Reporter(self.rack, self.seed)

    def now_s(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    # ---- the run
    def run(self, faults: list[Fault]) -> None:
        self.t0 = time.monotonic()
        self.reporter.start()
        try:
            first = self._settle(120.0)
            if first is None:
                self._report(self._quiesced(), None)
                raise RuntimeError("the rack never converged before the first fault")
            for f in faults:
                self._wait(f.gap)
                if time.monotonic() - self.t0 >= self.duration:
                    break
                log.info("t=%.0fs fault %d: %s hold %.1fs target %s%s", self.now_s(), f.n,
                         f.kind, f.hold, f.target, " + churn" if f.churn else "")
                self._inject(f)
                took = self._settle(self.quiesce)
                self.quiesces.append(took if took is not None else self.quiesce)
                self.done.append((f, took))
                self._report(self._quiesced(), f)
        finally:
            self.reporter.stop()
        self._report([Finding(4, w) for w in self.ledger.feed(self._audit_lines(),
                                                               final=True)], None)

    def _wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._continuous()
            time.sleep(0.25)

    def _inject(self, f: Fault) -> None:
        rack, cp = self.rack, self.rack.cp
        assert cp is not None and rack.ha is not None
        churn = (lambda: self._quietly(rack.migrate, f.target)) if f.churn else None
        if f.kind in ("apiserver-kill", "apiserver-restart", "etcd-kill", "compact-restart"):
            if churn:
                churn()  # the write lands just before the API goes
            self._down()
            if f.kind == "etcd-kill":
                cp.stop_etcd(kill=True)
                self._wait(f.hold)
                cp.start_etcd_again()
            elif f.kind == "compact-restart":
                cp.compact_etcd()
                cp.restart_apiserver(kill=True)
            else:
                cp.stop_apiserver(kill=f.kind == "apiserver-kill")
                self._wait(f.hold)
                cp.start_apiserver_again()
        elif f.kind in ("leader-kill", "leader-stop"):
            leader = rack.ha.leader(timeout=60)
            if f.kind == "leader-kill":
                rack.killed.add(leader.identity)
                leader.signal(signal.SIGKILL)
                leader.popen.wait(10)
            else:
                rack.stopped.add(leader.identity)
                leader.signal(signal.SIGSTOP)
            self._wait(f.hold / 2)
            if churn:
                churn()  # the next leader publishes it while the old one is away
            self._wait(f.hold / 2)
            if f.kind == "leader-kill":
                rack.ha.start()
            else:
                leader.signal(signal.SIGCONT)
                rack.stopped.discard(leader.identity)
                self.observed.paused(leader.identity, time.time())
        elif f.kind == "migration":
            rack.migrate(f.target)
        elif f.kind == "vm-crash":
            rack.delete_vmi(f.target)
            self._wait(f.hold)
            rack.create_vmi(f.target, rack.vmis[f.target][0])

    def _quietly(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # the API may be going: a churn is then skipped
            log.info("churn skipped: %s", e)

    def _down(self) -> None:
        if self.api_down_since is None:
            self.api_down_since = time.time()

    # ---- continuous checks: 4, 6, and replicas that exited
    def _continuous(self) -> None:
        self._report([Finding(4, w) for w in self.ledger.feed(self._audit_lines())], None)
        self._report(self._generations(), None)
        self._report(self._exits(), None)

    def _audit_lines(self) -> list[Any]:
        cp = self.rack.cp
        assert cp is not None
        try:
            with cp.audit_log.open("rb") as fh:
                fh.seek(self.audit_offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line being written waits for the next turn
        self.audit_offset += end
        return [ev for line in data[:end].decode(errors="replace").splitlines()
                if (ev := parse(line)) is not None]

    def _generations(self) -> list[Finding]:
        now = time.time()
        if now - self.served_at < SERVED_EVERY_S:
            return []
        self.served_at = now
        rack = self.rack
        running = rack.running()
        assert rack.ha is not None
        for r in rack.ha.replicas:
            if r not in running:
                self.observed.paused(r.identity, now)
        if not rack.api_up():
            self._down()
            return []
        if self.api_down_since is not None:  # nobody could observe while it was down
            self.api_down_since = None
            self.api_up_since = now
            for r in rack.ha.replicas:
                self.observed.paused(r.identity, now)
        out = []
        for key in NAMES:
            gen = rack.api_generation(key)
            if gen is not None and gen != self.api_gen.get(key):
                self.api_gen[key] = gen
                for r in running:
                    self.observed.deliver(r.identity, key, now, gen)
            for r in running:
                asked = time.time()
                doc = rack.view(r, key)
                served = doc.get("generation") if doc else None
                why = self.observed.check(r.identity, key,
                                          served if isinstance(served, int) else None, asked)
                if why is not None:
                    out.append(Finding(6, why))
        return out

    def _exits(self) -> list[Finding]:
        assert self.rack.ha is not None
        out = []
        for r in self.rack.ha.replicas:
            if not r.alive() and r.identity not in self.rack.killed:
                self.rack.killed.add(r.identity)  # reported once
                out.append(Finding(7, f"replica {r.identity} exited "
                                      f"({r.popen.returncode}) and the schedule did not "
                                      "kill it"))
        return out

    # ---- the quiesce: 5 and 6 against the API
    def _settle(self, bound: float) -> float | None:
        """Seconds until the rack converged and stayed so for SETTLE_S; None past ``bound``."""
        start = time.monotonic()
        held = Held(SETTLE_S)
        while time.monotonic() - start < bound:
            self._continuous()
            if held.observe(time.monotonic(), not self._quiesced()):
                assert held.since is not None
                return round(held.since - start, 1)
            time.sleep(0.5)
        return None

    def _quiesced(self) -> list[Finding]:
        rack = self.rack
        if not rack.api_up():
            return [Finding(5, "the API does not answer /readyz")]
        out = []
        running = rack.running()
        for key in NAMES:
            want = rack.expected(key)
            api_gen = rack.api_generation(key)
            views = {r.identity: rack.view(r, key) for r in running}
            if api_gen is None:
                out.append(Finding(6, f"{key}: the API holds no membership generation"))
            for ident, doc in views.items():
                if doc is None:
                    out.append(Finding(5, f"{key}: replica {ident} does not serve it"))
                    continue
                gen = doc.get("generation")
                if api_gen is not None and (not isinstance(gen, int) or gen < api_gen):
                    out.append(Finding(6, f"{key}: replica {ident} serves generation {gen}, "
                                          f"the API holds {api_gen}"))
                got = {m.get("vmi"): m.get("ip") for m in doc.get("members") or ()}
                if got != want:
                    out.append(Finding(5, f"{key}: replica {ident} publishes {got}, the "
                                          f"running VMIs are {want}"))
                out += self._reports_shown(key, ident, doc)
            gens = {str(doc.get("generation")) for doc in views.values() if doc}
            if len(gens) > 1:
                out.append(Finding(5, f"{key}: replicas serve generations {sorted(gens)}"))
            if key == "b" and views:
                holder = rack.holder()
                leader = next((d for i, d in views.items() if i == holder and d), None)
                st = rack.cr_status()
                if leader is not None and st is not None:
                    diff = status_vs_registry(st, leader)
                    if diff:
                        out.append(Finding(5, f"b: the CR status differs from the "
                                              f"registry: {diff[:3]}"))
        return out

    def _reports_shown(self, key: str, ident: str, doc: dict[str, Any]) -> list[Finding]:
        """Every report answered 2xx more than REPORT_BOUND_S ago (and after the API's
        last outage and the replica's last pause ended) is shown, or a later one of the
        same member."""
        out: list[Finding] = []
        now = time.time()
        if now - max(self.api_up_since, self.observed.resumed.get(ident, 0.0)) < REPORT_BOUND_S:
            return out  # the API or the replica is only just back
        before = now - REPORT_BOUND_S
        for m in doc.get("members") or ():
            s = self.reporter.sent.get(str(m.get("vmi")))
            owed = s.owed(str(m.get("ip")), before) if s is not None else None
            if s is None or owed is None:
                continue
            shown = (m.get("guest") or {}).get("signals")
            if not isinstance(shown, int) or not owed <= shown <= s.sent:
                out.append(Finding(5, f"{key}: replica {ident} shows report {shown} of "
                                      f"{m.get('vmi')}; {owed} was answered 2xx more than "
                                      f"{REPORT_BOUND_S:g} s before ({s.sent} sent)"))
        return out

    def _report(self, findings: list[Finding], f: Fault | None) -> None:
        for v in findings:
            if any(x["what"] == v.what for x in self.violations):
                continue
            log.error("t=%.0fs VIOLATION of invariant %d: %s", self.now_s(), v.invariant,
                      v.what)
            self.violations.append({
                "invariant": v.invariant, "t_s": self.now_s(), "what": v.what,
                "schedule": [f"{x.n}:{x.kind}" for x, _ in self.done]
                + ([f"{f.n}:{f.kind}"] if f and not any(x is f for x, _ in self.done)
                   else []),
                "replay": self.replay})

    # ---- the results
    def results(self, wall: float) -> dict[str, Any]:
        faults = {}
        for kind in KIND_NAMES:
            got = [t for f, t in self.done if f.kind == kind]
            times = sorted(t for t in got if t is not None)
            faults[kind] = {"injected": len(got), "survived": len(times),
                            "p50_s": percentile(times, 50), "p99_s": percentile(times, 99),
                            "max_s": times[-1] if times else None}
        led = self.ledger
        return {
            "api": "real", "seed": self.seed, "duration_s": self.duration,
            "wall_s": round(wall, 1), "vms": len(self.rack.vmis),
            "replicas_started": self.rack.ha.started if self.rack.ha else 0,
            "quiesce_max_s": self.quiesce, "quiesces": len(self.quiesces),
            "quiesce_p50_s": percentile(sorted(self.quiesces), 50),
            "faults": faults,
            "audit": {"host_agent_writes": led.writes_seen,
                      "guarded_writes": led.guarded_writes,
                      "stale_refused": led.stale_refused, "stale_events": led.stale_events,
                      "lease_writes": len(led.holders)},
            "reports": {"answers": {str(k): v for k, v in sorted(self.reporter.answers.items())},
                        "members": len(self.reporter.sent)},
            "generations": {"delivered": self.observed.delivered,
                            "checked": self.observed.checked},
            "checked": [4, 5, 6, 7],
            "violations": self.violations,
            "replay": self.replay,
        }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.soak.realk8s",
                                description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0,
                   help="seconds of schedule (default 600; faults start until it is spent)")
    p.add_argument("--seed", help="decimal or 0x-hex (default: drawn and printed)")
    p.add_argument("--quiesce", type=float, default=90.0,
                   help="the most seconds a quiesce waits for convergence (default 90)")
    p.add_argument("--results", type=Path, default=REPO_ROOT / "soak-results.json")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    seed = int(a.seed, 0) if a.seed else random.SystemRandom().randrange(2**32)
    replay = (f".venv/bin/python -m tests.soak.realk8s --seed {seed} "
              f"--duration {a.duration:g} --quiesce {a.quiesce:g}")
    work = Path(tempfile.mkdtemp(prefix="soak-rk8s-"))
    rack = Rack(work)
    members = [f"{n}-{i}" for n in NAMES.values() for i in range(3)]
    faults = draw(seed, int(a.duration // 5) + 10, members)
    print(f"soak-realk8s: seed {seed} (0x{seed:x}), {a.duration:g} s, "
          f"{len(members)} VMIs, 3 replicas, work dir {work}", flush=True)
    soak = Soak(rack, seed, a.duration, a.quiesce, replay)
    wall0 = time.monotonic()
    code = 0
    try:
        rack.start()
        soak.run(faults)
    except Exception as e:
        log.exception("soak-realk8s: the run stopped: %s", e)
        code = 2
    finally:
        res = soak.results(time.monotonic() - wall0)
        write_results(a.results, res)
        if a.keep or soak.violations or code:  # the plane's logs go with rack.close()
            kept = work.with_name(work.name + "-kept")
            shutil.copytree(work, kept, dirs_exist_ok=True)
            print(f"soak-realk8s: logs kept in {kept}")
        rack.close()
        shutil.rmtree(work, ignore_errors=True)
    print(format_table(res))
    print(f"checked: invariants 4, 5, 6 and 7 (exits); audit {res['audit']}; "
          f"reports {res['reports']}; generations {res['generations']}")
    for v in soak.violations:
        print(f"VIOLATION invariant {v['invariant']} at {v['t_s']} s: {v['what']}")
    if soak.violations:
        print(f"replay: {replay}")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
