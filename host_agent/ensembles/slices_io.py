"""The slice applier: makes an ensemble's EndpointSlices equal to what slices.py wants.

It writes only what differs (server-side apply, forced, through the write gate,
with the observed resourceVersion as precondition) and remembers its last write
of each slice, so its own write coming back through the informer is known as an
echo and costs no pass. What the slices should be is slices.py's, pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from host_agent.ensembles.slices import (
    Body,
    Written,
    current_version,
    encode_body,
    in_sync,
    is_our_write,
    needs_write,
)
from host_agent.kube.objects import resource_version


class SliceClient(Protocol):
    """The two writes the applier needs (implemented over lightkube in kube/client.py)."""

    async def apply_slice(self, body: Body, resource_version: str | None = None) -> str | None:
        """Server-side apply (precondition: ``resource_version``); returns the new one."""

    async def delete_slice(
        self, namespace: str, name: str, resource_version: str | None = None
    ) -> None:
        """Delete (precondition: ``resource_version``); already gone is not an error."""


class SliceApplier:
    """Brings one ensemble's slices to the desired bodies, writing only differences.

    Calls for one ensemble must be serialized by the caller (the reconciler
    does); different ensembles touch different slices and may run in parallel.
    """

    def __init__(
        self,
        client: SliceClient,
        observed: Callable[[str, str], Mapping[str, Any] | None],
    ) -> None:
        self._client = client
        self._observed = observed
        self._last: dict[tuple[str, str], Written] = {}

    async def sync(self, namespace: str, desired: Mapping[str, Body | None]) -> list[str]:
        """Write what differs; returns the names written ("apply:NAME"/"delete:NAME")."""
        done: list[str] = []
        for name, body in sorted(desired.items()):
            key = (namespace, name)
            observed = self._observed(namespace, name)
            last = self._last.get(key)
            encoded = encode_body(body)
            if is_our_write(observed, last):
                # The observation is our last write itself: compare with what we wrote
                # (C-speed encode and ==) instead of walking the observed object
                # (``contains``).
                synced = last is not None and last.wrote(encoded)
            else:
                synced = in_sync(body, observed)
            if synced:
                # Observed as wanted: from now on only a newer observation counts.
                rv = resource_version(observed)
                self._last[key] = Written(encoded, rv, rv)
                continue
            if not needs_write(body, observed, last):
                continue
            rv_before = resource_version(observed)
            precondition = current_version(observed, last)
            if body is None:
                await self._client.delete_slice(namespace, name, precondition)
                self._last[key] = Written(None, rv_before, None)
                done.append(f"delete:{name}")
            else:
                rv_after = await self._client.apply_slice(body, precondition)
                self._last[key] = Written(encoded, rv_before, rv_after)
                done.append(f"apply:{name}")
        return done

    def is_echo(self, namespace: str, name: str, observed: Mapping[str, Any] | None) -> bool:
        """``observed`` (a slice event) is exactly our last write of it coming back.

        The reconciler then skips the pass the event would cost: the slice is
        what that pass would want unless the inputs changed since, and a change
        of inputs queues its own pass. The write memory is refreshed as
        ``sync`` would (see ``needs_write``), so a later edit or deletion by
        someone else is still repaired. Anything else (another manager's
        write, a resourceVersion we did not produce) is not an echo.
        """
        key = (namespace, name)
        last = self._last.get(key)
        if last is None:
            return False
        if observed is None:
            return last.deleted
        rv = resource_version(observed)
        if last.deleted or rv is None or rv != last.rv_after:
            return False
        self._last[key] = Written(last.encoded, rv, rv)
        return True

    def forget(self, namespace: str, names: list[str]) -> None:
        """Drop write memory for slices of an ensemble that is gone."""
        for name in names:
            self._last.pop((namespace, name), None)
