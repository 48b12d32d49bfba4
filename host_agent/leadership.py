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
