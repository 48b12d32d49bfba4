"""Lease-based leader election: the decisions, with no I/O and an injected clock.

Semantics are client-go's (``k8s.io/client-go/tools/leaderelection``), which
kube-controller-manager runs with 15 s / 10 s / 2 s:

- A candidate reads the Lease every ``retry_period`` (jittered by a factor of
  1.2: between 2 and 4.4 s) and takes it when it is free (no holder) or
  **expired**. A leader renews it every ``retry_period``.
- **Expiry is timed on the candidate's own monotonic clock**, from the moment
  it *observed the lease change* (a new resourceVersion). Nobody compares the
  holder's ``renewTime`` with its own clock: wall clocks of two nodes may be
  seconds apart (a skew of +-5 s must not give two leaders), while the
  monotonic clocks of two processes advance at the same rate. The cost is that
  a candidate waits up to one retry period longer than necessary.
- A leader that cannot renew within ``renew_deadline`` of its last successful
  renew **stops leading** (and stops writing: ``may_write``). The deadline is
  measured from the moment the successful renew was *sent*, which is earlier
  than any moment a candidate can have observed it, so the leader always stops
  at least ``lease_duration - renew_deadline`` (5 s) before any candidate may
  take over.
- A leader that observes the lease held by someone else stops at once (a hand
  edit, a twin), without waiting for its deadline.

Beyond client-go:

- **Same identity.** Every process writes a random ``instance`` next to its
  identity (an annotation). A lease that carries *our* identity but another
  instance belongs to another live process (two replicas given one
  ``--identity``, or the previous container of this pod) and is treated as
  held by someone else: this process refuses to take it, says why once, and
  takes it only after it expired like any other lease.
- **Deleted by hand.** A candidate that saw a live holder and then finds the
  lease gone times the absence like a change: it waits ``lease_duration``
  before creating one, so the live leader, which recreates it at once, is not
  overtaken while it may still be writing. Nobody ever observed: create at once.
- **Edited by hand.** Any change is a new observation; a lease whose holder
  is not us is not ours; a ``leaseDurationSeconds`` that is missing or not
  positive is read as our own lease duration.

``Elector`` is a state machine: ``plan(now, lease)`` says what to write (or
nothing), ``wrote(...)``/``refused(...)`` feed back the API's answer.
``election_io.py`` drives it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

JITTER: Final = 1.2


@dataclass(frozen=True, slots=True)
class ElectionConfig:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def check(self) -> None:
        """client-go's own rules (``NewLeaderElector``); raises ValueError naming the flags."""
        if self.retry_period <= 0:
            raise ValueError("--leader-elect-retry-period must be positive")
        if self.renew_deadline <= JITTER * self.retry_period:
            raise ValueError(
                f"--leader-elect-renew-deadline ({self.renew_deadline:g}) must be greater than "
                f"{JITTER:g} x --leader-elect-retry-period ({self.retry_period:g})"
            )
        if self.lease_duration <= self.renew_deadline:
            raise ValueError(
                f"--leader-elect-lease-duration ({self.lease_duration:g}) must be greater than "
                f"--leader-elect-renew-deadline ({self.renew_deadline:g})"
            )


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What a Lease says (spec and our annotation), as read from the API."""

    holder: str  # "" when nobody holds it (released)
    instance: str | None
    duration: float | None  # leaseDurationSeconds; None when missing or not positive
    acquire_time: str | None
    renew_time: str | None
    transitions: int
    resource_version: str


@dataclass(frozen=True, slots=True)
class Desired:
    """The lease this candidate wants to write (``resource_version`` None: create)."""

    holder: str
    instance: str
    duration: float
    acquire_now: bool  # acquireTime = now (a new holder), else keep the old one
    transitions: int
    resource_version: str | None


Why = Literal["held", "twin", "absent-wait", "none"]


@dataclass
class Elector:
    """One candidate's view of one Lease; see the module docstring."""

    identity: str
    instance: str
    config: ElectionConfig = field(default_factory=ElectionConfig)
    #: the last record seen (None: none seen yet; ABSENT: seen deleted)
    observed: LeaseRecord | None = None
    observed_absent: bool = False
    #: our monotonic time when ``observed`` (or the absence) was first seen
    observed_at: float = 0.0
    #: someone held the lease when we last saw it, so an absence must be waited out
    _saw_holder: bool = False
    leading: bool = False
    #: monotonic time the last successful acquire/renew was *sent*
    renewed_at: float = float("-inf")
    #: a live process with our identity holds the lease (said once per episode)
    twin: str | None = None
    #: holder changes observed (for imex_host_agent_leader_transitions_total)
    transitions_seen: int = 0
    last_reason: Why = "none"

    # -- observing ---------------------------------------------------------------

    def observe(self, now: float, lease: LeaseRecord | None) -> None:
        """Fold a read of the Lease (None: 404) into the view."""
        if lease is None:
            if not self.observed_absent:
                self._saw_holder = self._holder_alive_before()
                self.observed_absent = True
                self.observed = None
                self.observed_at = now
            return
        if self.observed_absent or self.observed is None or (
            lease.resource_version != self.observed.resource_version
        ):
            self._count(lease)
            self.observed = lease
            self.observed_absent = False
            self.observed_at = now
        if self.leading and not self.is_ours(lease):
            self.leading = False  # someone else holds it now: stop at once

    def _count(self, lease: LeaseRecord) -> None:
        """Count a change to a new, non-empty holder (ours included)."""
        before = self.observed.holder if self.observed is not None else None
        if lease.holder and lease.holder != before:
            self.transitions_seen += 1

    def _holder_alive_before(self) -> bool:
        return self.observed is not None and self.observed.holder != ""

    def is_ours(self, lease: LeaseRecord) -> bool:
        """Held by this very process (our identity and our instance)."""
        return lease.holder == self.identity and lease.instance == self.instance

    def _duration(self, lease: LeaseRecord) -> float:
        return lease.duration if lease.duration is not None else self.config.lease_duration

    # -- deciding ----------------------------------------------------------------

    def expired(self, now: float) -> bool:
        """The observed holder's time is up, on our clock since we saw it change."""
        lease = self.observed
        if lease is None:
            return True
        return now >= self.observed_at + self._duration(lease)

    def plan(self, now: float) -> Desired | None:
        """What to write now, if anything (call after ``observe``)."""
        self.check_deadline(now)
        lease = self.observed
        if lease is None:
            if self.observed_absent and self._saw_holder and not self.leading and (
                now < self.observed_at + self.config.lease_duration
            ):
                self.last_reason = "absent-wait"
                return None
            return Desired(self.identity, self.instance, self.config.lease_duration,
                           True, 0, None)
        if self.is_ours(lease):
            # renew (also after a restart of our own loop): keep acquireTime
            self.twin = None
            return Desired(self.identity, self.instance, self.config.lease_duration,
                           False, lease.transitions, lease.resource_version)
        if lease.holder != "" and not self.expired(now):
            if lease.holder == self.identity:
                self.twin = lease.instance or "?"
                self.last_reason = "twin"
            else:
                self.last_reason = "held"
            return None
        return Desired(self.identity, self.instance, self.config.lease_duration,
                       True, lease.transitions + 1, lease.resource_version)

    def check_deadline(self, now: float) -> bool:
        """Stop leading once the renew deadline passed; True when that just happened."""
        if self.leading and not self.within_deadline(now):
            self.leading = False
            return True
        return False

    def within_deadline(self, now: float) -> bool:
        return now < self.renewed_at + self.config.renew_deadline

    def may_write(self, now: float) -> bool:
        return self.leading and self.within_deadline(now)

    # -- feedback ----------------------------------------------------------------

    def wrote(self, sent_at: float, now: float, lease: LeaseRecord) -> bool:
        """The API accepted our write (sent at ``sent_at``); True when we just became leader."""
        was = self.leading
        self._count(lease)
        self.observed = lease
        self.observed_absent = False
        self.observed_at = now
        self.renewed_at = sent_at
        self.leading = True
        self.twin = None
        return not was

    def refused(self) -> None:
        """Our write lost a race (409) or was refused; the next read decides."""

    def released(self, now: float, lease: LeaseRecord | None) -> None:
        """We gave the lease up (graceful stop)."""
        self.leading = False
        self.renewed_at = float("-inf")
        if lease is not None:
            self.observed = lease
            self.observed_at = now

    def stop_leading(self) -> None:
        """Close the gate before a release is sent (nothing may be written after)."""
        self.leading = False
        self.renewed_at = float("-inf")


def jittered(period: float, rng: Callable[[], float] = random.random) -> float:
    """client-go's ``wait.Jitter(period, 1.2)``: period + up to 1.2 x period."""
    return period + rng() * JITTER * period
