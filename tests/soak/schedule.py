"""The fault schedule: drawn from a seed, pure, the same on every machine.

Each kind of fault arrives as a Poisson process of its own rate (``per_hour`` times the
run's ``rate_scale``) over the schedule's duration and is undone after a hold drawn
uniformly from its range. Every kind draws from its own ``random.Random`` seeded with
``"<seed>:<kind>"`` (string seeds are hashed with SHA-512, not with Python's per-process
hash), so adding a kind does not move the others' arrivals, and one seed gives the same
schedule on any machine and any Python 3.

Arrivals are then taken in time order and each one claims what it touches for its
hold plus a settling time (``busy``): a VM, the replicas, the API, the registry path,
DNS, the IMEX one-way block. An arrival whose target has nothing free is dropped (its
draws are still made, so the rest of the schedule does not move). So faults of
different things overlap freely, while one VM never has two guest faults at once (a
crash during an ENOSPC would reboot onto a full disk: another fault, not two).

Targets are slots of the layout (:func:`layout`): ensemble ``a`` (a hand-made Service)
and ``b`` (an ImexEnsemble). Which replica is "the leader" is only known when the fault
is injected, so host faults name no target here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: (ensemble key, slot index)
Slot = tuple[str, int]


@dataclass(frozen=True)
class KindSpec:
    name: str
    group: str  # guest | host | api | network
    per_hour: float
    hold: tuple[float, float]
    #: vm: one VM; vms: a subset (up to a third); pair: two VMs of one ensemble; none
    target: str
    #: seconds after the undo during which the claimed things stay claimed
    busy: float
    what: str


KINDS: tuple[KindSpec, ...] = (
    KindSpec("vm-crash", "guest", 8, (5, 40), "vm", 30,
             "the VM dies (every process killed, VMI Failed); after the hold the pool "
             "replaces it and it rejoins with a new IP"),
    KindSpec("migration", "guest", 8, (0, 0), "vm", 20,
             "live migration: the VM gets a new IP with no downtime"),
    KindSpec("agent-kill", "guest", 8, (0, 0), "vm", 20,
             "SIGKILL of the guest agent (its IMEX child goes with it); systemd's "
             "Restart=always brings it back after RestartSec=2"),
    KindSpec("imex-crash", "guest", 8, (0, 0), "vm", 20,
             "SIGKILL of the IMEX stand-in; the agent restarts it"),
    KindSpec("hosts-clobber", "guest", 8, (0, 0), "vm", 10,
             "cloud-init's manage_etc_hosts rewrites /etc/hosts without our block"),
    KindSpec("enospc", "guest", 6, (10, 60), "vm", 15,
             "both file systems the agent writes are filled; the hold ends by freeing them"),
    KindSpec("leader-kill", "host", 6, (2, 20), "none", 30,
             "SIGKILL of the leading host agent; its replacement starts after the hold"),
    KindSpec("leader-stop", "host", 6, (6, 20), "none", 30,
             "SIGSTOP of the leader for longer than the lease (4 s), then SIGCONT"),
    KindSpec("rolling-restart", "host", 3, (0, 0), "none", 60,
             "all three replicas, one at a time: SIGTERM, exit, start, ready"),
    KindSpec("api-outage", "api", 6, (3, 30), "none", 20,
             "the API refuses connections, then listens again on the same port"),
    KindSpec("api-410", "api", 6, (5, 20), "none", 20,
             "a 410 storm: history compacted and every watch ended, every 2 s of the "
             "hold; every informer relists"),
    KindSpec("api-slow", "api", 6, (10, 40), "none", 15,
             "every API call is held 0.2-1.5 s before it is answered"),
    KindSpec("registry-block", "network", 6, (10, 60), "vms", 20,
             "nftables in some VMs drops every packet to and from the registry"),
    KindSpec("dns-fail", "network", 6, (10, 40), "none", 15,
             "cluster DNS answers SERVFAIL for the first half of the hold, then nothing"),
    KindSpec("imex-oneway", "network", 6, (10, 40), "pair", 20,
             "nftables in one member drops what it sends to another member's IMEX port"),
)
KIND_NAMES = tuple(k.name for k in KINDS)
BY_NAME = {k.name: k for k in KINDS}


@dataclass(frozen=True)
class Fault:
    """One scheduled fault; ``at`` and ``hold`` in schedule seconds."""

    id: int
    kind: str
    at: float
    hold: float
    #: the VMs it touches (vm: one; vms: several; pair: from, to); none: ()
    targets: tuple[Slot, ...] = ()
    #: a kind's own drawn parameter (api-slow: the delay in seconds)
    param: float = 0.0

    @property
    def until(self) -> float:
        return self.at + self.hold

    def describe(self) -> str:
        tgt = " ".join(f"{e}{i}" for e, i in self.targets)
        extra = f" delay={self.param:.2f}s" if self.kind == "api-slow" else ""
        return f"#{self.id} t={self.at:7.1f}s {self.kind:<15} hold={self.hold:5.1f}s" \
               f"{' ' + tgt if tgt else ''}{extra}"


@dataclass(frozen=True)
class Layout:
    """The ensembles of a run: key -> (name, number of VMs)."""

    sizes: dict[str, int] = field(default_factory=dict)

    def slots(self) -> list[Slot]:
        return [(e, i) for e, n in sorted(self.sizes.items()) for i in range(n)]


def layout(vms: int) -> Layout:
    """Two ensembles over ``vms`` VMs: ``a`` gets two thirds (rounded up), ``b`` the rest
    (at least 2, so a one-way block and a clique always have a partner)."""
    if vms < 4:
        raise ValueError(f"--vms {vms}: the soak needs at least 4 VMs (two ensembles of 2)")
    b = max(2, vms // 3)
    return Layout({"a": vms - b, "b": b})


def _arrivals(rng: random.Random, rate_per_s: float, duration: float) -> list[float]:
    out: list[float] = []
    if rate_per_s <= 0:
        return out
    t = rng.expovariate(rate_per_s)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


def _claims(spec: KindSpec, targets: Sequence[Slot]) -> list[object]:
    """What a fault of ``spec`` on ``targets`` occupies while it lasts."""
    if spec.group == "guest":
        return [("vm", *t) for t in targets]
    if spec.group == "host":
        return ["replicas"]
    if spec.group == "api":
        return ["api"]
    return [spec.name]


def draw(seed: int, duration: float, lay: Layout, rate_scale: float = 1.0,
         kinds: Iterable[str] | None = None) -> list[Fault]:
    """The schedule of one run: faults in time order, numbered from 1."""
    chosen = [BY_NAME[k] for k in (kinds if kinds is not None else KIND_NAMES)]
    slots = lay.slots()
    raw: list[tuple[float, str, random.Random]] = []
    for spec in chosen:
        rng = random.Random(f"{seed}:{spec.name}")
        for n, t in enumerate(_arrivals(rng, spec.per_hour * rate_scale / 3600.0, duration)):
            raw.append((t, spec.name, random.Random(f"{seed}:{spec.name}:{n}")))
    raw.sort(key=lambda r: (r[0], r[1]))
    busy_until: dict[object, float] = {}
    out: list[Fault] = []
    for t, name, rng in raw:
        spec = BY_NAME[name]
        lo, hi = spec.hold
        hold = min(rng.uniform(lo, hi), max(0.0, duration - t))
        param = rng.uniform(0.2, 1.5) if name == "api-slow" else 0.0
        targets = _pick(spec, rng, slots, lay, t, busy_until)
        if targets is None:
            continue
        claims = _claims(spec, targets)
        if any(busy_until.get(c, -math.inf) > t for c in claims):
            continue
        for c in claims:
            busy_until[c] = t + hold + spec.busy
        out.append(Fault(len(out) + 1, name, round(t, 3), round(hold, 3), tuple(targets),
                         round(param, 3)))
    return out


def _pick(spec: KindSpec, rng: random.Random, slots: Sequence[Slot], lay: Layout, t: float,
          busy_until: dict[object, float]) -> list[Slot] | None:
    """The drawn targets (always the same draws, free or not); None when none is free."""
    if spec.target == "none":
        return []
    if spec.target == "vm":
        free = [s for s in slots if busy_until.get(("vm", *s), -math.inf) <= t]
        pick = rng.randrange(len(slots))  # drawn even when nothing is free
        return [free[pick % len(free)]] if free else None
    if spec.target == "vms":
        k = rng.randint(1, max(1, len(slots) // 3))
        return sorted(rng.sample(list(slots), k))
    ens = rng.choice(sorted(lay.sizes))
    a, b = rng.sample(range(lay.sizes[ens]), 2)
    return [(ens, a), (ens, b)]


def parse_seed(text: str) -> int:
    """A seed as given: decimal, or hex with ``0x`` (the CI's commit seed is 8 hex digits,
    written ``0x`` + the digits)."""
    t = text.strip().lower()
    try:
        value = int(t, 16) if t.startswith("0x") else int(t)
    except ValueError as e:
        raise ValueError(f"seed {text!r}: expected a decimal number or 0x followed by hex "
                         f"digits") from e
    if not 0 <= value < 2**64:
        raise ValueError(f"seed {text!r}: must be between 0 and 2**64-1")
    return value


def commit_seed(commit: str) -> int:
    """The CI's seed: the first 8 hex digits of the commit."""
    head = commit.strip()[:8]
    if len(head) != 8 or any(c not in "0123456789abcdefABCDEF" for c in head):
        raise ValueError(f"commit {commit!r}: expected at least 8 hex digits")
    return int(head, 16)


def read_seed_list(text: str) -> list[int]:
    """tests/soak/seeds.txt: one seed a line (decimal or 0x-hex), ``#`` starts a comment."""
    out: list[int] = []
    for n, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        try:
            out.append(parse_seed(body.split()[0]))
        except ValueError as e:
            raise ValueError(f"seeds file line {n}: {e}") from e
    return out
