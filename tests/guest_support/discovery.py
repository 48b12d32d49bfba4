"""What the discovery tests ask of a running ``Discovery`` that the daemon never asks.

TEST SUPPORT. The daemon decides with ``Discovery._registry_in_charge`` (which also
covers the time before the first answer); the tests check the narrower fact below.
"""

from __future__ import annotations

import time

from guest_agent.peers.discovery_io import Discovery


def registry_healthy(disc: Discovery) -> bool:
    """The registry answered its last request, within ``poll_interval + longpoll_timeout``."""
    if disc.registry is None or disc._registry_ok_at is None or disc._registry_failing:
        return False
    age = time.monotonic() - disc._registry_ok_at
    return age <= disc.settings.poll_interval + disc.settings.longpoll_timeout
