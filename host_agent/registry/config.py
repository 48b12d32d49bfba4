"""The registry's settings: frozen objects, built by the agent and passed explicitly.

Free of FastAPI, so the agent can build them before the app's module is loaded."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from host_agent.registry.auth import IPNetwork


@dataclass(frozen=True)
class RegistryConfig:
    """The registry's settings (one frozen object, passed explicitly).

    ``trusted_proxies``: networks whose ``X-Forwarded-For`` names the real
    caller (``--trusted-proxy CIDR``). ``report_stale_after``: seconds after
    which a guest's last report is shown as stale. ``longpoll_default`` is
    used when ``wait`` comes without ``timeout``; ``longpoll_cap`` bounds any
    ``timeout``.
    """

    trusted_proxies: tuple[IPNetwork, ...] = ()
    report_stale_after: float = 120.0
    max_body_bytes: int = 16384
    #: the status PUT carries an 18-node ``nvidia-imex-ctl -N -j`` (~25 KB) with headroom
    status_body_bytes: int = 65536
    longpoll_cap: float = 60.0
    longpoll_default: float = 30.0


@dataclass(frozen=True)
class CertConfig:
    """Issuing settings: leaf lifetime and the per-member rate limit."""

    lifetime: dt.timedelta = dt.timedelta(days=7)  # host_agent.ca.authority.LEAF_LIFETIME
    rate: int = 10
    rate_window: float = 60.0
