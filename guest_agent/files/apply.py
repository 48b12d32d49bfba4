"""Pins -> file bytes -> disk: the one place the agent writes managed files.

Which pins to write is decided before this stage (``guest_agent.pins.merge``: the merged
Views, the own slot pinned locally, other NVLink cliques pinned away in the hosts block);
``Applier`` renders them with the shared renderers and writes with the safe writer.

Writing is level-triggered and idempotent: each call renders the whole
desired content from the current files and the pins, and the safe writer
skips unchanged files. So the file watcher can call ``assert_files`` on every
inotify event, our own writes included, and only a foreign change costs a
write (a "re-assert"). The hosts file is shared with admins and cloud-init, so it is
merged through a ``SharedFile``, which keeps a line another process adds while we
merge. The nodes file is written before the hosts file so a daemon started after both
sees a consistent pair.

Everything here is synchronous and fast (two small files); the agent calls
it from the event loop without awaiting, so two writers never interleave.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from guest_agent.config import Settings
from guest_agent.files.safewrite import FileWriteError, SharedFile, read_bytes, write_file
from imex_shared.hostsfile import merge_hosts, read_block
from imex_shared.model import EnsembleId
from imex_shared.render import render_nodes_config


class ApplyError(RuntimeError):
    """A managed file could not be written; the message names it."""


def sha256(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


@dataclass(frozen=True, slots=True)
class ApplyResult:
    nodes_written: bool
    hosts_written: bool
    nodes_sha256: str
    hosts_sha256: str
    #: a file was not as we had left it (another writer) and was written again
    reasserted: bool = False

    @property
    def written(self) -> bool:
        return self.nodes_written or self.hosts_written


class Applier:
    """Renders and writes the nodes file and the hosts block for one ensemble."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ens = EnsembleId(settings.namespace, settings.ensemble)
        self.pins: dict[int, str] | None = None
        #: what the hosts block holds: ``pins`` less the members of other NVLink cliques
        self.hosts_pins: dict[int, str] | None = None
        self.last: ApplyResult | None = None
        #: what we last left in each file, to tell a foreign write from our own
        self._left: dict[str, bytes] = {}
        self._hosts = SharedFile(settings.hosts_file)

    def nodes_bytes(self, pins: Mapping[int, str]) -> bytes:
        s = self.settings
        return render_nodes_config(self.ens, s.max_members, s.mode, pins)

    def found(self) -> tuple[dict[int, str] | None, str | None]:
        """(pins of our hosts block, sha256 of the nodes file) as they are on disk now."""
        hosts = read_bytes(self.settings.hosts_file)
        nodes = read_bytes(self.settings.nodes_config)
        block = read_block(hosts, self.ens) if hosts is not None else None
        return block, sha256(nodes)

    def apply(
        self, pins: Mapping[int, str], hosts_pins: Mapping[int, str] | None = None
    ) -> ApplyResult:
        """Make both files hold ``pins``; remembers them for ``assert_files``.

        ``hosts_pins`` (default ``pins``) is what the hosts block pins when the ensemble
        spans NVLink cliques (``imex_shared.cliques``): the nodes file never depends on
        it, so a split costs IMEX a SIGUSR1, not a restart.
        """
        self.pins = dict(pins)
        self.hosts_pins = dict(hosts_pins) if hosts_pins is not None else self.pins
        return self._write(self.pins, self.hosts_pins)

    def assert_files(self) -> ApplyResult | None:
        """Re-render the last applied pins over whatever is on disk (None before any apply)."""
        if self.pins is None or self.hosts_pins is None:
            return None
        return self._write(self.pins, self.hosts_pins)

    def _foreign(self, path: str, found: bytes | None, wanted: bytes) -> bool:
        """Someone else changed ``path`` since our last write, and we must write it again."""
        left = self._left.get(path)
        return left is not None and found != left and found != wanted

    def _write(self, pins: Mapping[int, str], hosts_pins: Mapping[int, str]) -> ApplyResult:
        s = self.settings
        nodes = self.nodes_bytes(pins)
        foreign = False
        try:
            os.makedirs(os.path.dirname(s.nodes_config) or ".", exist_ok=True)
            old_nodes = read_bytes(s.nodes_config)
            foreign |= self._foreign(s.nodes_config, old_nodes, nodes)
            nodes_written = write_file(s.nodes_config, nodes)
            self._left[s.nodes_config] = nodes
            merged = self._hosts.merge(
                lambda existing: merge_hosts(existing or b"", self.ens, s.max_members,
                                             hosts_pins),
            )
            hosts, hosts_written = merged.data, merged.written
            foreign |= self._foreign(s.hosts_file, merged.base, hosts)
            self._left[s.hosts_file] = hosts
        except (FileWriteError, OSError) as exc:
            raise ApplyError(str(exc)) from exc
        result = ApplyResult(
            nodes_written,
            hosts_written,
            hashlib.sha256(nodes).hexdigest(),
            hashlib.sha256(hosts).hexdigest(),
            reasserted=foreign,
        )
        self.last = result
        return result
