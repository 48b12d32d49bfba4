"""Invariant 3, the restart policy: in names mode an IMEX daemon ends only for a cause on
its own VM.

TEST CODE. The guest agent's policy (guest_agent/imex/supervisor.py) restarts IMEX when
the nodes file changes (never in names mode: the file names slots, not addresses),
when its own pinned address moves, when the daemon is dead, or when it has not been
READY for ``ready_grace`` (the stand-in is READY as soon as it listens). A peer that
moves, crashes or comes back costs a SIGUSR1, never a restart. So in the soak the only
causes for a VM's IMEX process to end are the schedule's faults on that VM:

- ``imex-crash``: the schedule SIGKILLs it;
- ``agent-kill``: its agent goes, and the IMEX child with it;
- ``migration``: the VM's own address moves, so the agent restarts it;
- ``vm-crash``: the whole VM goes.

One more fault can end a daemon, but only one that is starting: IMEX finds its own node
once, at start-up, by resolving the nodes file's names, and exits with "No matching
network interface..." when its own name resolves to no local address (FACTS.md). A
``hosts-clobber`` that lands between the agent's write of ``/etc/hosts`` and a new
daemon's start-up check does exactly that, as cloud-init re-rendering the file would on a
real guest, and the agent's dead-daemon restart brings IMEX back. So a clobber gives its
VM a *start-up credit*, taken only by an end whose daemon logged that no-match error.

Each such fault gives its VM one *credit*, kept until the end of the next quiesce (by
then every fault is undone and the rack has converged, so a restart it causes has
happened). Each IMEX process seen to end takes one credit; an end without one is a
violation. A lost SIGUSR1 is caught elsewhere: a daemon that was not told leaves a link
to the peer's old address, and invariant 1 finds it not CONNECTED at the quiesce.

Pure bookkeeping here; invariants.Continuous watches the processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.soak.schedule import Slot

#: the faults that may end their own VM's IMEX process
CAUSES = frozenset({"imex-crash", "agent-kill", "migration", "vm-crash"})
#: the faults that may end their own VM's IMEX process only in its start-up check
STARTUP_CAUSES = frozenset({"hosts-clobber"})


@dataclass
class Credits:
    """Credits per VM slot, and how many process ends were checked."""

    left: dict[Slot, int] = field(default_factory=dict)
    startup: dict[Slot, int] = field(default_factory=dict)
    ends: int = 0

    def grant(self, kind: str, targets: tuple[Slot, ...]) -> None:
        pool = self.left if kind in CAUSES else self.startup if kind in STARTUP_CAUSES else None
        if pool is not None:
            for slot in targets[:1]:  # a guest fault's one VM
                pool[slot] = pool.get(slot, 0) + 1

    def quiesced(self) -> None:
        """A quiesce converged: what its faults could cause has happened."""
        self.left.clear()
        self.startup.clear()

    def ended(self, slot: Slot, pid: int, vm: str, no_match: bool = False) -> str | None:
        """``vm``'s IMEX process ``pid`` is gone; the violation if nothing caused it.
        ``no_match``: the daemon logged that its own node matched no local address."""
        self.ends += 1
        if self.left.get(slot, 0) > 0:
            self.left[slot] -= 1
            return None
        if no_match and self.startup.get(slot, 0) > 0:
            self.startup[slot] -= 1
            return None
        why = (f"{vm}: IMEX (pid {pid}) ended with no fault on this VM since the last "
               "quiesce: the agent restarted it outside its policy, or it crashed")
        if no_match:
            why += ("; it found no local address for its own node, with no /etc/hosts "
                    "clobber on this VM to explain it")
        return why
