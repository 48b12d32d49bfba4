"""Who may write to the API: the write gate every API writer checks first.

Only the leader writes (EndpointSlices, owned Services, ImexEnsemble status,
Events, CA Secrets); every replica reads. A writer calls ``gate.ensure()``
immediately before each write, so a replica that lost (or never had)
leadership raises ``NotLeader`` instead of writing. Without leader election
(the CLI default, sidecar mode) the gate is ``ALWAYS``: the one process is
its own leader.
"""

from __future__ import annotations

from typing import Final, Protocol


class Leadership(Protocol):
    """What a real gate reads (``election_io.LeaseElection``)."""

    def may_write(self) -> bool: ...


class NotLeader(Exception):
    """This replica may not write now (not the leader, or its renew deadline passed)."""


class WriteGate(Protocol):
    def may_write(self) -> bool:
        """True while this replica may write (checked on its own monotonic clock)."""
        ...

    def ensure(self) -> None:
        """Raise ``NotLeader`` unless ``may_write()``."""
        ...


class _Always:
    def may_write(self) -> bool:
        return True

    def ensure(self) -> None:
        return None


#: The gate of an agent that does not elect: it always writes.
ALWAYS: Final[WriteGate] = _Always()


class LeaseGate:
    """The gate of an electing replica: open while it leads and its renew deadline,
    read on the monotonic clock at the moment of the check, has not passed."""

    def __init__(self, leadership: Leadership, identity: str = "") -> None:
        self._leadership = leadership
        self._identity = identity

    def may_write(self) -> bool:
        return self._leadership.may_write()

    def ensure(self) -> None:
        if not self._leadership.may_write():
            raise NotLeader(
                f"replica {self._identity or '?'} is not the leader (or its renew deadline "
                "passed): it writes nothing to the API"
            )
