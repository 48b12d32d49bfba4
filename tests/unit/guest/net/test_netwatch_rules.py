"""netwatch's pure choice of the default-route source address."""

from __future__ import annotations

from guest_agent.net import netwatch


def test_pick_route_address_rules() -> None:
    from socket import AF_INET, AF_INET6

    A, R = netwatch.Addr, netwatch.Route
    addrs = [A("127.0.0.1", 1), A("10.0.2.2", 2), A("fe80::1", 2), A("fd10:0:2::2", 2),
             A("192.168.5.9", 3), A("10.0.2.9", 2, flags=netwatch.IFA_F_TENTATIVE)]
    # masquerade guest: default route via eth0 (ifindex 2): its IPv4 address
    assert netwatch.pick_route_address([R(AF_INET, 0, 2)], addrs) == "10.0.2.2"
    # IPv4 default preferred over IPv6; lowest metric among IPv4
    assert netwatch.pick_route_address(
        [R(AF_INET6, 0, 2), R(AF_INET, 0, 3, priority=200), R(AF_INET, 0, 2, priority=100)], addrs
    ) == "10.0.2.2"
    # prefsrc wins when it is local
    assert netwatch.pick_route_address([R(AF_INET, 0, 2, prefsrc="192.168.5.9")], addrs) == (
        "192.168.5.9")
    # IPv6-only default route: global address, never link-local
    assert netwatch.pick_route_address([R(AF_INET6, 0, 2)], addrs) == "fd10:0:2::2"
    # no default route, or only non-default routes
    assert netwatch.pick_route_address([R(AF_INET, 24, 2)], addrs) is None
    assert netwatch.pick_route_address([], addrs) is None
