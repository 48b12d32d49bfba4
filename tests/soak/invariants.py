"""The soak's invariants (issue 30), checked on the live rack.

TEST CODE. Continuous (every loop turn): 2 (the readers' torn reads), 4 (the API
double's audit log: a 2xx write by a host agent that did not hold the Lease at its
commit) and 7 (a process exited that the schedule did not kill). At each quiesce, with
every fault undone: 1 (each running member pins exactly the running members, absent
slots at 127.0.0.2, and IMEX is CONNECTED to every peer; ``nodes_config`` byte-identical
on every member), 5 (the CR status's members equal the registry's, and every replica
serves the same members and generation) and 8 (the registry's domain view is UP).
At the end of a run of 30 minutes or more, 7's leak check: every agent still the same
process has an RSS within 10 % of its RSS after the first 10 minutes.

6 both ways: continuously, every 2 s, no replica serves a generation older than one
the API sent it more than observed.BOUND_S ago (tests/soak/observed.py); at each
quiesce, no replica serves a generation older than the one the API holds (the Service's
membership annotation, the CR's status). 3, the restart policy, every 1 s: a VM's
IMEX daemon ends only for a fault on that VM (tests/soak/restarts.py); and every change
of a VM's pins is followed by an acted SIGUSR1 or a start within the agent's window
(tests/soak/signals.py).
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.guest_support.agent import pid_alive
from tests.sandbox.imex_standin import NO_MATCH_MESSAGE
from tests.soak.apiaudit import AGENT_UA, GUARDED
from tests.soak.apiaudit import ident_of as _ident
from tests.soak.faults import imex_pids, restart_agent
from tests.soak.observed import Observed, generation_of
from tests.soak.rack import REPLICAS, SoakRack
from tests.soak.restarts import Credits
from tests.soak.schedule import Slot
from tests.soak.signals import lost_signal, resolved_at

NOT_CHECKED: dict[int, str] = {}
#: seconds between two reads of what each replica serves (invariant 6)
SERVED_EVERY_S = 2.0
#: seconds between two looks at each VM's IMEX process (invariant 3)
IMEX_EVERY_S = 1.0


@dataclass
class Finding:
    invariant: int
    what: str
    #: what to keep beside the harness's log tails (the lines that explain it)
    logs: str = ""


@dataclass
class Continuous:
    """The continuous checks' state (offsets into the readers' logs, counters)."""

    rack: SoakRack
    offsets: dict[Slot, int] = field(default_factory=dict)
    writes_seen: int = 0
    guarded_writes: int = 0
    stale_refused: int = 0
    stale_events: int = 0
    reads: dict[Slot, int] = field(default_factory=dict)
    #: invariant 6: what each replica was sent, and each replica's process
    observed: Observed = field(default_factory=Observed)
    pids: dict[str, int | None] = field(default_factory=dict)
    served_at: float = 0.0
    #: invariant 3: each VM's IMEX process (its VMI, pid), and the faults' credits
    imex: dict[Slot, tuple[str, int]] = field(default_factory=dict)
    credits: Credits = field(default_factory=Credits)
    imex_at: float = 0.0
    #: invariant 3's signals: each VM's hosts pins as they changed (mtime, pins)
    pins: dict[Slot, list[tuple[float, dict[str, Any]]]] = field(default_factory=dict)
    #: slot -> (the change owed a resolution, whether its deadline passed on a state
    #: too old to tell); met and lost obligations
    owed: dict[Slot, tuple[float, bool]] = field(default_factory=dict)
    signals_met: int = 0
    signals_at: float = 0.0
    lost: dict[Slot, set[float]] = field(default_factory=dict)

    def readers(self) -> list[Finding]:
        out = []
        for slot in self.rack.slots():
            path = self.rack.reader_out(slot)
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(slot, 0))
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self.offsets[slot] = self.offsets.get(slot, 0) + end
            for line in data[:end].splitlines():
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if "torn" in doc:
                    out.append(Finding(2, f"{slot[0]}{slot[1]} {doc['file']}: {doc['torn']}; "
                                          f"read: {str(doc.get('sample'))[:300]!r}"))
                if "reads" in doc:
                    self.reads[slot] = int(doc["reads"])
                if doc.get("file") == "hosts" and isinstance(doc.get("block"), dict):
                    self.pins.setdefault(slot, []).append((float(doc["mtime"]), doc["block"]))
            reader = self.rack.readers.get(slot)
            if reader is not None and reader.poll() is not None:
                out.append(Finding(2, f"the reader of {slot[0]}{slot[1]} exited "
                                      f"({reader.returncode})"))
                self.rack.readers.pop(slot)
        return out

    def audit(self) -> list[Finding]:
        api = self.rack.sbx.api
        if api is None or api.server.api.audit is None:
            return []
        writes, deliveries = api.server.api.audit.drain()
        self._observe(deliveries)
        out = []
        for w in writes:
            if not w.user_agent.startswith(AGENT_UA):
                continue
            self.writes_seen += 1
            ident = _ident(w.user_agent)
            base = w.resource.split("/")[0]
            if base == "events":
                if 200 <= w.code < 300 and ident != w.holder:
                    self.stale_events += 1
                continue
            if base not in GUARDED:
                continue
            self.guarded_writes += 1
            if ident == w.holder:
                continue
            if 200 <= w.code < 300:
                out.append(Finding(4, f"{ident} wrote {w.verb} {w.resource} "
                                      f"{w.namespace}/{w.name} ({w.code}) while the Lease "
                                      f"holder was {w.holder}"))
            else:
                self.stale_refused += 1
        return out

    def _observe(self, deliveries: list[Any]) -> None:
        if not deliveries:
            return
        names = {(spec.namespace, spec.name): key for key, spec in self.rack.specs.items()}
        for d in deliveries:
            if not d.user_agent.startswith(AGENT_UA):
                continue
            meta = d.obj.get("metadata") or {}
            key = names.get((str(meta.get("namespace")), str(meta.get("name"))))
            gen = generation_of(d.resource, d.obj) if key is not None else None
            if key is not None and gen is not None:
                self.observed.deliver(_ident(d.user_agent), key, d.t, gen)

    def generations(self) -> list[Finding]:
        """Invariant 6 continuously: each replica's pauses and restarts every call, what
        it serves every :data:`SERVED_EVERY_S` (observed.py has the rule)."""
        now = time.time()
        live = []
        for ident, r in self.rack.replicas.items():
            pid = r.proc.pid if r.proc is not None and r.proc.poll() is None else None
            if ident in self.pids and pid is not None and pid != self.pids[ident]:
                self.observed.restarted(ident, now)
            self.pids[ident] = pid
            if pid is None or r.stopped:
                self.observed.paused(ident, now)
            else:
                live.append(ident)
        if now - self.served_at < SERVED_EVERY_S:
            return []
        self.served_at = now
        out = []
        for ident in live:
            for key, spec in self.rack.specs.items():
                asked = time.time()
                try:
                    doc = _get(f"{self.rack.replica_url(ident)}/v1/ensembles/{spec.key}", 2)
                except Exception:
                    continue  # not serving it (yet), or busy: that owes nothing
                gen = doc.get("generation") if isinstance(doc, dict) else None
                why = self.observed.check(ident, key, gen if isinstance(gen, int) else None,
                                          asked)
                if why is not None:
                    out.append(Finding(6, why))
        return out

    def restarts(self, now: bool = False) -> list[Finding]:
        """Invariant 3 (restarts.py has the rule): each VM's IMEX process every
        :data:`IMEX_EVERY_S`, or at once with ``now``."""
        t = time.monotonic()
        if not now and t - self.imex_at < IMEX_EVERY_S:
            return []
        self.imex_at = t
        out = []
        for slot in self.rack.slots():
            try:
                vm = self.rack.vm(slot)
            except Exception:
                continue  # between a crash and its rejoin
            known = self.imex.get(slot)
            if known is not None and known[0] == vm.vmi and pid_alive(known[1]):
                continue
            if known is not None:
                del self.imex[slot]
                if known[0] == vm.vmi:
                    own = daemon_lines(vm.dir / "imex" / "imex.log", known[1])
                    why = self.credits.ended(slot, known[1], vm.vmi,
                                             no_match=NO_MATCH_MESSAGE in own)
                    if why is not None:
                        detail = _imex_lines(vm.log_tail(200_000))
                        if own:
                            detail += f"\nthe daemon's own last lines:\n{own}"
                        out.append(Finding(3, why, detail))
            pids = imex_pids(vm, daemons=True)
            if pids:
                self.imex[slot] = (vm.vmi, max(pids))
        return out

    def signals(self) -> list[Finding]:
        """Invariant 3's signals (signals.py has the rule), at restarts' cadence: each
        running daemon's last resolution against its VM's pins. An obligation is counted
        met when a resolution follows it, and reported once when none did."""
        now = time.time()
        if now - self.signals_at < IMEX_EVERY_S:
            return []
        self.signals_at = now
        out = []
        for slot, changes in self.pins.items():
            try:
                vm = self.rack.vm(slot)
                state = json.loads(vm.imex_state_file.read_text())
                pid, started = int(state["pid"]), float(state["started"])
                updated = float(state["updated"])
            except Exception:
                continue  # no daemon (yet), or a state being replaced
            if not pid_alive(pid):
                continue
            verdict, first = lost_signal(changes, resolved_at(state, started), now, updated)
            owed = self.owed.get(slot)
            if owed is not None and (first is None or first != owed[0]):
                self.signals_met += 1
                del self.owed[slot]
            if first is None:
                continue
            if verdict in ("ok", "wait"):
                self.owed[slot] = (first, verdict == "wait")
            elif first not in self.lost.get(slot, ()):
                self.lost.setdefault(slot, set()).add(first)
                self.owed.pop(slot, None)
                out.append(Finding(3, f"{vm.vmi}: {verdict}", _imex_lines(vm.log_tail(200_000))))
        return out

    def processes(self, down: set[Slot], restarting: set[Slot]) -> list[Finding]:
        out = []
        for ident in REPLICAS:
            r = self.rack.replicas[ident]
            if r.proc is None or r.proc.poll() is None or r.expected_exit:
                continue
            out.append(Finding(7, f"host agent {ident} exited ({r.proc.returncode}) unasked; "
                                  "started again"))
            self.rack.start_replica(ident)
        for slot in self.rack.slots():
            if slot in down or slot in restarting:
                continue
            vm = self.rack.vm(slot)
            if vm.agent is not None and vm.agent.poll() is not None:
                out.append(Finding(7, f"guest agent of {slot[0]}{slot[1]} exited "
                                      f"({vm.agent.returncode}) unasked; started again"))
                restart_agent(vm)
        return out


def rss(rack: SoakRack) -> dict[str, tuple[int, int]]:
    """Every agent's (pid, RSS in kB) now: the replicas and the guest agents."""
    procs: dict[str, Any] = {ident: r.proc for ident, r in rack.replicas.items()}
    procs |= {f"{e}{i}": rack.vm((e, i)).agent for e, i in rack.slots()}
    out = {}
    for name, p in procs.items():
        if p is None or p.poll() is not None:
            continue
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[name] = (p.pid, int(line.split()[1]))
        except (OSError, ValueError):
            continue
    return out


def rss_growth(early: dict[str, tuple[int, int]], late: dict[str, tuple[int, int]],
               limit: float = 0.10) -> list[Finding]:
    """Invariant 7's leak check: an agent (the same process) whose RSS grew more than
    ``limit`` between the two snapshots."""
    out = []
    for name, (pid, kb) in early.items():
        if name in late and late[name][0] == pid and late[name][1] > kb * (1 + limit):
            out.append(Finding(7, f"{name}: RSS {kb} kB at 10 min, {late[name][1]} kB at "
                                  f"the end (+{100 * (late[name][1] / kb - 1):.0f} %)"))
    return out


def converged(rack: SoakRack) -> str | None:
    """None when both ensembles are converged (Sandbox.converged), else why not."""
    for spec in rack.specs.values():
        why = rack.sbx.converged(spec)
        if why is not None:
            return why
    return None


def _imex_lines(log: str, keep: int = 12) -> str:
    """The agent's last lines about its IMEX daemon and its own slot."""
    lines = [ln for ln in log.splitlines()
             if "IMEX" in ln or "own slot" in ln or ln.startswith("----")]
    return "\n".join(lines[-keep:])


def daemon_lines(log: Path, pid: int, keep: int = 8) -> str:
    """The last lines IMEX process ``pid`` wrote to ``log``, its LOG_FILE_NAME."""
    try:
        text = log.read_text(errors="replace")[-200_000:]
    except OSError:
        return ""
    tag = f"[{pid}]"
    return "\n".join([ln for ln in text.splitlines() if tag in ln][-keep:])


def _get(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def quiesced(rack: SoakRack) -> list[Finding]:
    """Invariants 1, 5 and 8 on a quiet rack (call after :func:`converged` said None, or
    after the quiesce bound ran out: then invariant 1 is reported first)."""
    out = []
    why = converged(rack)
    if why is not None:
        out.append(Finding(1, why))
    for key, spec in rack.specs.items():
        vms = rack.sbx.vms_of(spec)
        nodes = {vm.vmi: _read(vm.dir / "imex" / "nodes_config.cfg") for vm in vms}
        if len(set(nodes.values())) > 1:
            out.append(Finding(1, f"{key}: nodes_config differs between members: "
                                  f"{ {k: len(v) for k, v in nodes.items()} } bytes"))
        views = {}
        for ident in REPLICAS:
            try:
                doc = _get(f"{rack.replica_url(ident)}/v1/ensembles/{spec.key}")
            except Exception as e:
                out.append(Finding(5, f"replica {ident} does not serve {spec.key}: {e}"))
                continue
            views[ident] = (doc.get("generation"),
                            tuple(sorted((m["index"], m["ip"]) for m in doc.get("members") or ())))
        api_gen = _api_generation(rack, key)
        if api_gen is None:
            out.append(Finding(6, f"{key}: the API holds no membership generation"))
        for ident, (gen, _) in views.items():
            if api_gen is not None and (gen is None or gen < api_gen):
                out.append(Finding(6, f"{key}: replica {ident} serves generation {gen}, the "
                                      f"API holds {api_gen}"))
        if len({v[1] for v in views.values()}) > 1 or \
                len({v[0] for v in views.values()}) > 1:
            out.append(Finding(5, f"{key}: replicas serve different views: {views}"))
        running = tuple(sorted((vm.index, vm.ip) for vm in vms))
        for ident, (_, members) in views.items():
            if members != running:
                out.append(Finding(5, f"{key}: replica {ident} publishes {members}, the "
                                      f"running members are {running}"))
                break
        if key == "b" and rack.ctl is not None:
            st = rack.ctl.get_ensemble(spec).get("status") or {}
            cr = tuple(sorted((m["index"], m["ip"]) for m in st.get("members") or ()))
            if cr != running:
                out.append(Finding(5, f"{key}: the CR status has {cr}, the registry "
                                      f"{running}"))
        try:
            dom = _get(f"{rack.sbx.registry_url}/v1/ensembles/{spec.key}/domain")
            if dom.get("status") != "UP":
                # the registry's own reasons, so a failed run says which member and why
                why = "; ".join(str(x) for x in dom.get("problems") or ())
                out.append(Finding(8, f"{key}: domain view {dom.get('status')}"
                                      + (f" ({why})" if why else "")))
        except Exception as e:
            out.append(Finding(8, f"{key}: no domain view: {e}"))
    return out


def _api_generation(rack: SoakRack, key: str) -> int | None:
    """The persisted generation (host_agent/persist/pair.py): the Service's membership
    annotation for ``a``, the CR's status for ``b``; None when there is none."""
    from host_agent.persist.pair import from_service, pair_from_status

    spec, api = rack.specs[key], rack.sbx.api
    assert api is not None
    try:
        if key == "b":
            pair, _ = pair_from_status(api.get("imex-ensemble.io/v1alpha1", "ImexEnsemble",
                                               spec.name, spec.namespace).get("status"))
        else:
            pair, _ = from_service(api.get("v1", "Service", spec.name, spec.namespace))
    except Exception:
        return None
    return pair.generation if pair is not None else None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
