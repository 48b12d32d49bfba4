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


@dataclass
class Credits:
    """Credits per VM slot, and how many process ends were checked."""

    left: dict[Slot, int] = field(default_factory=dict)
    ends: int = 0

    def grant(self, kind: str, targets: tuple[Slot, ...]) -> None:
        if kind in CAUSES:
            for slot in targets[:1]:  # a guest fault's one VM
                self.left[slot] = self.left.get(slot, 0) + 1

    def quiesced(self) -> None:
        """A quiesce converged: what its faults could cause has happened."""
        self.left.clear()

    def ended(self, slot: Slot, pid: int, vm: str) -> str | None:
        """``vm``'s IMEX process ``pid`` is gone; the violation if nothing caused it."""
        self.ends += 1
        if self.left.get(slot, 0) > 0:
            self.left[slot] -= 1
            return None
        return (f"{vm}: IMEX (pid {pid}) ended with no fault on this VM since the last "
                "quiesce: the agent restarted it outside its policy, or it crashed")
