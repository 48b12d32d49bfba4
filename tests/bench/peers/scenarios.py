"""The scenarios of issue 18, run the same way on every side.

Each function drives one :class:`~tests.bench.peers.fleet.Side` through one scenario and
records its figures in a :class:`Record`. The order of API writes and VM actions is the
same for every side; only what the side does per step differs (pods or VMIs; IMEX alone,
the agents, or the floor probe).

Clocks: every figure that starts "when the status write carrying the new IP reaches the
API" takes that moment from kube-apiserver's audit log (``requestReceivedTimestamp`` of
the request with the step's unique User-Agent); the end is taken from the IMEX stand-ins'
own attempt logs (when the CONNECTED handshake completed) or from an inotify watch on the
VMs' hosts files. All on the one wall clock of this machine.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.bench.hostswatch import HostsWatch
from tests.bench.peers import cpu
from tests.bench.peers.fleet import Fleet, OursSide, RecipeSide, Side, Slot
from tests.bench.peers.measure import (
    all_connected_at,
    by_label,
    metric_sum,
    parse_prometheus,
    percentile,
    qps,
    stale_attempts,
)

log = logging.getLogger("bench.peers")

REQUESTS = "coredns_dns_requests_total"


@dataclass(frozen=True)
class Params:
    members: int = 18
    replacements: int = 20
    steady_s: float = 60.0
    #: from the old VM's deletion to the new VM's status write (a VM restart takes at least
    #: this; longer than the guest agent's 5 s signal window, so ours is not held by it),
    #: plus a jitter drawn uniformly from [0, gap_jitter_s): a real restart's length is not
    #: a multiple of anything, so the phase of IMEX's retry loop (3 s at its cap) at t0 must
    #: not be fixed either. Replacement k gets the same draw on every side.
    gap_s: float = 8.0
    gap_jitter_s: float = 3.0
    #: a crash is silent; its VMI/pod deletion reaches the API this much later
    crash_notice_s: float = 5.0
    crash_watch_s: float = 15.0
    #: before the absent-slot window: agents settled, IMEX retry loops at their 3 s cap
    settle_s: float = 10.0
    migration_s: float = 5.0
    #: the source launcher pod stays Ready this long after the switchover
    source_linger_s: float = 2.0
    resolved_replacements: int = 5
    #: a replacement not converged by then is a harness failure (the run stops)
    timeout_s: float = 180.0
    quick: bool = False


QUICK = Params(members=3, replacements=3, steady_s=10.0, gap_s=6.0, crash_notice_s=4.0,
               crash_watch_s=8.0, settle_s=5.0, migration_s=3.0, resolved_replacements=1,
               timeout_s=180.0, quick=True)


@dataclass
class Record:
    """Figures by JSON key, raw samples, notes and the reason for every null."""

    figures: dict[str, float | None] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    on_change: Callable[[], None] | None = None

    def set(self, key: str, value: float | None, reason: str | None = None) -> None:
        self.figures[key] = None if value is None else round(float(value), 3)
        if value is None:
            self.reasons[key] = reason or "not measured"
        else:
            self.reasons.pop(key, None)
        if self.on_change is not None:
            self.on_change()


class Converge(Exception):
    """A side did not reach the state a scenario waits for (a harness failure)."""


def wait(what: str, probe: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise Converge(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def sleep_until(wall: float) -> None:
    delay = wall - time.time()
    if delay > 0:
        time.sleep(delay)


def logs_of(slots: list[Slot], since: float = 0.0) -> dict[str, list[Any]]:
    return {s.name: s.attempts_since(since) if since else s.attempts() for s in slots}


@contextlib.contextmanager
def hosts_watch(side: Side, slots: list[Slot]) -> Iterator[HostsWatch | None]:
    if not side.watches_hosts:
        yield None
        return
    assert isinstance(side, OursSide)
    watch = HostsWatch(side.ens)
    try:
        watch.set_vms({s.name: s.node.hosts_path for s in slots})
        yield watch
    finally:
        watch.close()


class DnsSeen:
    """Asks CoreDNS for ``name`` every 20 ms (on a thread, from before t0) until it
    answers ``ip``: when the publication reached DNS, for the breakdown of each side."""

    def __init__(self, cluster: Any, name: str, ip: str, timeout: float) -> None:
        self._at: float | None = None
        self._done = threading.Event()

        def poll() -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if ip in cluster.ask(name, timeout=0.5):
                    self._at = time.time()
                    break
                time.sleep(0.02)
            self._done.set()

        threading.Thread(target=poll, name="dns-seen", daemon=True).start()

    def result(self) -> float | None:
        self._done.wait()
        return self._at


def all_pids(side: Side, fleet: Fleet) -> list[int]:
    """Every process the comparison runs: the VMs', CoreDNS's namespace, the control plane
    and the host agent."""
    from tests.sandbox.netns import netns_pids

    cl = side.cluster
    pids = [pid for s in fleet.slots for pid in netns_pids(s.node.name)]
    if cl.dns_node is not None:
        pids += netns_pids(cl.dns_node.name)
    if cl.cp is not None:
        pids += [proc.popen.pid for proc in cl.cp.procs.values()]
    return pids


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


def up_members(fleet: Fleet, up: set[int]) -> list[Slot]:
    return [s for s in fleet.slots if s.index in up]


def wait_domain_up(side: Side, slots: list[Slot], timeout: float) -> float:
    """Until every listed member's IMEX is READY with all the others CONNECTED; returns
    the latest of the state-file writes that showed it (when the last link came up)."""
    members = [s.index for s in slots]

    def all_up() -> float | None:
        times = []
        for s in slots:
            if not side.domain_up(s, members):
                return None
            times.append(float(s.imex_state().get("updated", 0.0)))
        return max(times)

    return float(wait(f"{side.name}: Domain UP on {len(slots)} members", all_up, timeout, 0.05))


# ------------------------------------------------------------------ boot storm


def boot_storm(side: Side, fleet: Fleet, p: Params, rec: Record, key: str | None) -> None:
    """0 -> n members: every VM booted and waiting, then every status written; the
    figure runs from the last status write's arrival at the API to Domain UP on every
    member. Restarts and SIGUSR1 per member are counted one signal window + 1 s later."""
    for s in fleet.slots:
        side.fresh_vm(s)
        side.create(s)
    for s in fleet.slots:
        side.boot(s)
    for s in fleet.slots:
        side.wait_booted(s)
    tags = [side.write_running(s) for s in fleet.slots]
    t_last = max(side.cluster.received_at(t) for t in tags)
    if not side.has_imex:
        assert isinstance(side, OursSide)
        wait("every probe's hosts file to hold every member", lambda: all(
            _block_has_all(side, s, fleet) for s in fleet.slots), p.timeout_s)
        return
    t_up = wait_domain_up(side, fleet.slots, p.timeout_s)
    time.sleep(6.2)  # one signal window + 1 s: late signals and restarts are counted
    wait_domain_up(side, fleet.slots, p.timeout_s)
    if key is None:
        return
    rec.set(f"{key}_storm_up_s", max(0.0, t_up - t_last))
    restarts = [side.counters(s)[0] for s in fleet.slots]
    signals = [side.counters(s)[1] for s in fleet.slots]
    rec.set(f"{key}_storm_restarts_per_member", max(restarts))
    rec.set(f"{key}_storm_signals_per_member", max(signals))
    states = {s.name: side.ctl_domain_state(s) for s in fleet.slots}
    not_up = {k: v for k, v in states.items() if v != "UP"}
    rec.notes[f"{key}_storm"] = (
        f"{len(fleet)} members; worst member: {max(restarts)} restarts, {max(signals)} "
        f"SIGUSR1; nvidia-imex-ctl -N says Domain State: UP on "
        f"{len(states) - len(not_up)}/{len(states)}" + (f" (not: {not_up})" if not_up else ""))


def _block_has_all(side: OursSide, slot: Slot, fleet: Fleet) -> bool:
    from imex_shared.hostsfile import read_block

    try:
        block = read_block(slot.node.hosts_path.read_bytes(), side.ens)
    except OSError:
        return False
    return block is not None and all(block.get(s.index) == s.ip for s in fleet.slots)


# ------------------------------------------------------------------ replacement


def replacements(side: Side, fleet: Fleet, p: Params, rec: Record, key: str,
                 count: int) -> None:
    """``count`` replacements rotating through the members (see the module docstring).

    Per replacement: the old VM shuts down (peers see their links close) and its pod/VMI
    is deleted; the slot's new VM gets a new address, its pod/VMI is created and it boots
    (its guest side up and waiting); ``gap_s`` after the deletion the status write with
    the new IP is sent (t0). Figures: t0 -> the last peer's CONNECTED handshake with the
    new IP (IMEX sides), t0 -> the new IP in every VM's hosts file (ours, floor).
    """
    connect: list[float] = []
    hosts: list[float] = []
    listen: list[float] = []  # t0 -> the new VM's IMEX listening
    first_dial: list[float] = []  # t0 -> the first peer's first dial to the new IP
    refused: list[float] = []  # failed dials to the new IP before the last peer connected
    dns: list[float] = []  # t0 -> CoreDNS answers the new IP
    spawned: list[float] = []  # recipe: t0 -> the harness started the new VM's IMEX
    window_cpu: dict[str, float] = {}  # CPU seconds by component in the windows
    with hosts_watch(side, fleet.slots) as watch:
        for k in range(count):
            s = fleet.slots[k % len(fleet)]
            peers = [o for o in fleet.slots if o is not s]
            side.power_off(s)
            t_del = side.cluster.received_at(side.delete(s))
            side.fresh_vm(s)
            side.create(s)
            side.boot(s)
            side.wait_booted(s)
            sleep_until(t_del + p.gap_s + random.Random(f"gap-{k}").uniform(0, p.gap_jitter_s))
            pending = None
            if watch is not None:
                mono, wall = time.monotonic(), time.time()
                pending = watch.expect(s.index, s.ip, mono)
            seen = DnsSeen(side.cluster, side.dns_name(s), s.ip, p.timeout_s)
            cpu0 = cpu.snapshot(all_pids(side, fleet))
            t0 = side.cluster.received_at(side.write_running(s))
            if side.has_imex:
                def connected(s: Slot = s, peers: list[Slot] = peers,
                              t0: float = t0) -> float | None:
                    return all_connected_at(logs_of(peers, t0), s.index, s.ip, t0)

                t_all = wait(f"{side.name}: every peer CONNECTED to {s.name} at {s.ip}",
                             connected, p.timeout_s, 0.05)
                connect.append((t_all - t0) * 1000)
                started = RecipeSide.spawned_at(s) if isinstance(side, RecipeSide) else None
                if started is not None:
                    spawned.append((started - t0) * 1000)
                own = [a.t for a in s.attempts() if a.ev == "listening"]
                if own:
                    listen.append((own[0] - t0) * 1000)
                dials = [a for log_ in logs_of(peers, t0 - 1).values() for a in log_
                         if a.ev == "attempt" and a.ip == s.ip and a.t >= t0 - 1]
                if dials:
                    first_dial.append((min(a.t for a in dials) - t0) * 1000)
                refused.append(sum(1 for a in dials if a.outcome != "connected"
                                   and a.t <= t_all))
            if side.has_imex:  # the window: t0 -> every peer CONNECTED
                cpu.add(window_cpu, cpu.delta(cpu0, cpu.snapshot(all_pids(side, fleet))))
            if pending is not None:
                if not pending.done.wait(p.timeout_s):
                    raise Converge(f"{side.name}: hosts files never all held {s.ip}: "
                                   f"{sorted(pending.waiting)}")
                hosts.append((wall + (pending.finished - mono) - t0) * 1000)
            t_dns = seen.result()
            if t_dns is not None:
                dns.append((t_dns - t0) * 1000)
            if side.has_imex:  # steady again (the new member's own links too) before the next
                wait_domain_up(side, fleet.slots, p.timeout_s)
            log.info("%s replacement %d/%d (%s): connect %s ms, hosts %s ms", side.name,
                     k + 1, count, s.name, f"{connect[-1]:.0f}" if connect else "-",
                     f"{hosts[-1]:.0f}" if hosts else "-")
    if side.has_imex:
        rec.samples[f"{key}_replace_ms"] = [round(x, 1) for x in connect]
        rec.samples[f"{key}_listen_ms"] = [round(x, 1) for x in listen]
        rec.samples[f"{key}_first_dial_ms"] = [round(x, 1) for x in first_dial]
        rec.samples[f"{key}_failed_dials"] = refused
        rec.samples[f"{key}_dns_ms"] = [round(x, 1) for x in dns]
        if spawned:
            rec.samples[f"{key}_spawned_ms"] = [round(x, 1) for x in spawned]
        rec.notes[f"{key}_replace"] = (
            f"{count} replacements; p50 from t0: CoreDNS answers the new IP "
            f"{_ms(percentile(dns, 50))}, "
            + (f"new VM's IMEX started {_ms(percentile(spawned, 50))}, " if spawned else "")
            + f"new VM's IMEX listening "
            f"{_ms(percentile(listen, 50))}, first peer dial to the new IP "
            f"{_ms(percentile(first_dial, 50))}, every peer CONNECTED "
            f"{_ms(percentile(connect, 50))}; failed dials to the new IP before that, mean "
            f"{sum(refused) / max(1, len(refused)):.1f} per replacement; CPU per window "
            "(t0 -> every peer CONNECTED), by component: "
            + ", ".join(f"{k} {v / max(1, count):.2f} s" for k, v in
                        sorted(window_cpu.items(), key=lambda kv: -kv[1])))

        rec.set(f"{key}_replace_p50_ms", percentile(connect, 50))
        rec.set(f"{key}_replace_p99_ms", percentile(connect, 99))
    if side.watches_hosts:
        rec.samples[f"{key}_hosts_ms"] = [round(x, 1) for x in hosts]
        rec.samples.setdefault(f"{key}_dns_ms", [round(x, 1) for x in dns])
        rec.set(f"{key}_hosts_p50_ms", percentile(hosts, 50))
        rec.set(f"{key}_hosts_p99_ms", percentile(hosts, 99))


# ------------------------------------------------------------------ crash


def crash_slot(fleet: Fleet, p: Params, replaced: int) -> Slot:
    """The member that crashes: the one replaced last (its peers resolved its name a few
    seconds ago, which is what a caching resolver remembers); the same slot on every side."""
    return fleet.slots[(replaced - 1) % len(fleet)] if replaced else fleet.slots[-1]


def crash(side: Side, fleet: Fleet, p: Params, rec: Record, key: str, slot: Slot,
          watch_s: float | None = None) -> Slot:
    """``slot``'s member crashes (silently: its link goes first) and is not replaced; its
    pod/VMI deletion reaches the API ``crash_notice_s`` later. Counted: attempts to the old
    IP that started after the deletion, and when the last of them started."""
    s = slot
    watch_s = p.crash_watch_s if watch_s is None else watch_s
    peers = [o for o in fleet.slots if o is not s]
    old = s.ip
    side.power_off(s, crash=True)
    time.sleep(p.crash_notice_s)
    t_del = side.cluster.received_at(side.delete(s))
    time.sleep(watch_s)
    stale = stale_attempts(logs_of(peers), old, t_del)
    rec.set(f"{key}_stale_attempts", stale.attempts)
    rec.set(f"{key}_stale_stop_s", 0.0 if stale.last is None else stale.last - t_del)
    rec.notes[f"{key}_crash"] = (
        f"{s.name} ({old}) crashed; deletion reached the API {p.crash_notice_s:g} s later; "
        f"attempts to {old} after it: {stale.attempts} over {len(peers)} peers, watched "
        f"{watch_s:g} s")
    return s


# ------------------------------------------------------------------ absent slots


def absent_slots(side: Side, fleet: Fleet, p: Params, rec: Record, key: str,
                 gone: set[int] | None = None) -> set[int]:
    """2/3 of the members up (12 of 18), the rest absent (deleted: the ones in ``gone``
    already, then from the highest slot down); DNS queries per second arriving at CoreDNS
    over ``steady_s``, from CoreDNS's own ``prometheus`` counters. Returns the slots up."""
    n = len(fleet)
    n_up = max(1, round(n * 2 / 3))
    absent = set(gone or ())
    for s in reversed(fleet.slots):
        if len(absent) >= n - n_up:
            break
        absent.add(s.index)
    for s in fleet.slots:
        if s.index in absent and s.node.ip in s.node.addresses():
            side.power_off(s)
            side.cluster.received_at(side.delete(s))
    up = set(range(n)) - absent
    if side.has_imex:
        wait_domain_up(side, up_members(fleet, up), p.timeout_s)
    time.sleep(p.settle_s)
    before = parse_prometheus(side.cluster.coredns_metrics())
    sink0 = side.cluster.sink.queries if side.cluster.sink else 0
    t0 = time.monotonic()
    time.sleep(p.steady_s)
    after = parse_prometheus(side.cluster.coredns_metrics())
    span = time.monotonic() - t0
    sink1 = side.cluster.sink.queries if side.cluster.sink else 0
    rate = qps(metric_sum(before, REQUESTS), metric_sum(after, REQUESTS), span)
    rec.set(f"{key}_absent_dns_qps", rate)
    types0, types1 = by_label(before, REQUESTS, "type"), by_label(after, REQUESTS, "type")
    per_type = {t: round((types1[t] - types0.get(t, 0.0)) / span, 2) for t in types1
                if types1[t] - types0.get(t, 0.0) > 0}
    rec.notes[f"{key}_absent"] = (
        f"{n_up} of {n} up, {n - n_up} absent; {span:.1f} s window; CoreDNS counted "
        f"{rate:.2f} queries/s by type {per_type}; the forward sink got "
        f"{(sink1 - sink0) / span:.2f}/s")
    return up


# ------------------------------------------------------------------ live migration (recipe)


def migration(side: RecipeSide, fleet: Fleet, p: Params, rec: Record, up: set[int]) -> None:
    """The lowest member up live-migrates. The target launcher pod (same hostname and
    subdomain) turns Ready with the target IP while the source pod is still Ready, so the
    name answers two A records. After ``migration_s`` the VM switches over: its IMEX goes
    down on the source address and comes back on the target one (the best case: real IMEX
    keeps its socket on the source address and nothing in the recipe restarts it); the
    source pod stays Ready ``source_linger_s`` longer, then goes. Figures: switchover ->
    every peer CONNECTED to the target; attempts to the source address after the
    switchover; how long CoreDNS answered two records."""
    s = fleet.slots[min(up)]
    peers = [o for o in up_members(fleet, up) if o is not s]
    fqdn = side.fqdn(s.index)
    src, src_pod = s.ip, side.pods[s.index]
    tgt = fleet.fabric.allocate()
    s.node.add_address(tgt)  # the target pod's address: nothing listens there yet
    tgt_pod = side.create_pod(s, side.node_name(s, other=True))
    side.cluster.received_at(side.write_running(s, ip=tgt, pod=tgt_pod))
    two = sorted([src, tgt])
    wait("two A records", lambda: side.cluster.ask(fqdn) == two, p.timeout_s)
    t_two = time.time()
    time.sleep(p.migration_s)
    t_s = time.time()
    fleet.kill(s)  # IMEX on the source address goes; its peers see the links close
    fleet.drop_address(s)
    s.node.ip = tgt
    side.start_imex(s)
    time.sleep(p.source_linger_s)
    side.cluster.received_at(side.delete(s, pod=src_pod))
    side.pods[s.index] = tgt_pod
    wait("one A record", lambda: side.cluster.ask(fqdn) == [tgt], p.timeout_s)
    t_one = time.time()
    t_all = wait("every peer CONNECTED to the target", lambda: all_connected_at(
        logs_of(peers), s.index, tgt, t_s), p.timeout_s)
    src_tries = stale_attempts(logs_of(peers), src, t_s)
    rec.set("recipe_migration_connected_s", t_all - t_s)
    rec.set("recipe_migration_source_attempts", src_tries.attempts)
    rec.set("recipe_migration_dual_records_s", t_one - t_two)
    rec.notes["recipe_migration"] = (
        f"{s.name} {src} -> {tgt} among {len(peers) + 1} members; two A records for "
        f"{t_one - t_two:.1f} s ({p.migration_s:g} s copy phase + switchover + "
        f"{p.source_linger_s:g} s source linger); {src_tries.attempts} attempts to the "
        f"source after switchover; every peer on the target {t_all - t_s:.2f} s after it")
