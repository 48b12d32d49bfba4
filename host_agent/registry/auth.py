"""Who may write to the registry: the caller's address and the ensemble's bearer token.

Pure checks, no I/O: the status PUT and every other authenticated guest route
(one code path, so the rules cannot drift apart) call ``authenticate_member``,
which checks in the order the registry contract gives: an ensemble whose spec says
``registryTLS: Required`` refuses any token that came over plain HTTP (403, before the
token is even compared, so a sniffed token is worth nothing there), bearer token (401),
member published (404), caller address is one of the member's VMI addresses
(403; ``X-Forwarded-For`` only from a trusted proxy). Size (413) and the
ensemble's existence (404) come before it; the body schema (422) after it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Any

from host_agent.state.snapshot import EnsembleSnapshot, EnsembleSpec, PublishedMember
from imex_shared.model import EnsembleId, is_sha256_hex

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address



class RegistryError(Exception):
    """A request the registry refuses; ``message`` tells the caller what to do."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 detail: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        #: 422: one entry per offending field (``loc``, ``msg``), as for schema errors
        self.detail = detail





def _unmapped(addr: IPAddress) -> IPAddress:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def parse_addr(text: str, what: str) -> IPAddress:
    raw = text.strip()
    if raw.startswith("[") and "]" in raw:
        raw = raw[1 : raw.index("]")]
    try:
        return _unmapped(ipaddress.ip_address(raw))
    except ValueError as exc:
        raise RegistryError(400, f"{what} {text.strip()!r} is not an IP address") from exc


def caller_address(
    peer: str | None, forwarded_for: list[str], trusted: tuple[IPNetwork, ...]
) -> IPAddress:
    """The caller's address: the direct peer, or, when the peer is a trusted
    proxy, the rightmost ``X-Forwarded-For`` hop that is not a trusted proxy.
    """
    try:
        addr = parse_addr(peer or "", "peer address")
    except RegistryError as exc:
        raise RegistryError(
            403,
            f"cannot tell the caller's IP address (peer {peer!r}); reports must come from "
            "the member's own address, directly or through a trusted proxy",
        ) from exc
    hops = [h for header in forwarded_for for h in header.split(",") if h.strip()]
    if not hops or not any(addr in net for net in trusted):
        return addr
    for pos in range(len(hops) - 1, -1, -1):
        addr = parse_addr(hops[pos], "X-Forwarded-For entry")
        if not any(addr in net for net in trusted):
            return addr
    return addr


def check_token(spec: EnsembleSpec, authorization: str | None) -> str | None:
    """None when the bearer token matches ``spec.token_sha256``, else the failure reason.

    The comparison of the hex digests is constant-time (``hmac.compare_digest``).
    """
    expected = (spec.token_sha256 or "").strip().lower()
    if not expected:
        return "no_token_configured"
    if not is_sha256_hex(expected):
        return "bad_token_annotation"
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return "missing_token"
    got = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
    if not hmac.compare_digest(got, expected):
        return "wrong_token"
    return None


def token_message(reason: str, ens: EnsembleId) -> str:
    ann = "imex-ensemble.io/token-sha256"
    return {
        "no_token_configured": (
            f"ensemble {ens.key} accepts no reports: its Service has no {ann} annotation "
            f"(set it to the hex sha256 of the guests' token)"
        ),
        "bad_token_annotation": (
            f"ensemble {ens.key} accepts no reports: its Service's {ann} annotation is not "
            f"64 hex digits (set it to the hex sha256 of the guests' token)"
        ),
        "missing_token": (
            "missing bearer token: send 'Authorization: Bearer <token>' with the token "
            f"whose sha256 is the {ann} annotation of Service {ens.key}"
        ),
        "wrong_token": (
            f"wrong token for ensemble {ens.key}: its sha256 does not match the {ann} "
            "annotation (check the guest's token_file)"
        ),
    }[reason]


def validation_message(errors: list[dict[str, Any]] | Any) -> tuple[str, list[dict[str, Any]]]:
    detail = [
        {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in errors
    ]
    text = "; ".join(f"{'.'.join(d['loc']) or 'body'}: {d['msg']}" for d in detail)
    return text or "invalid request", detail


class AuthFailure(RegistryError):
    """A refused guest request; ``reason`` is the bounded metrics label."""

    def __init__(self, status: int, message: str, reason: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.reason = reason


def plain_http_refusal(spec: EnsembleSpec, scheme: str | None) -> AuthFailure | None:
    """The refusal of a token sent over plain HTTP to a ``registryTLS: Required`` ensemble."""
    if scheme != "http" or not spec.registry_tls_required:
        return None
    return AuthFailure(
        403,
        f"ensemble {spec.ens.key} takes its token over HTTPS only (registryTLS: Required) and "
        "this request came over plain HTTP: refused. Use the registry's https:// URL with "
        "registry_ca_sha256 (status.registryCASHA256), and rotate the token: it crossed the "
        "network in clear",
        "plain_http",
    )


def authenticate_member(
    snap: EnsembleSnapshot,
    index: int,
    authorization: str | None,
    peer: str | None,
    forwarded_for: list[str],
    trusted: tuple[IPNetwork, ...],
    scheme: str | None = None,
) -> tuple[PublishedMember, IPAddress]:
    """The published member a guest request is for, and the caller's address.

    Raises ``AuthFailure`` (403 plain HTTP to an ensemble that requires TLS, 401 token,
    403 address) or ``RegistryError`` (404: no such published member), in that order.
    ``scheme``: how the request came (``http``/``https``; None: not known).
    """
    ens = snap.ens
    refused = plain_http_refusal(snap.spec, scheme)
    if refused is not None:
        raise refused
    reason = check_token(snap.spec, authorization)
    if reason is not None:
        raise AuthFailure(401, token_message(reason, ens), reason,
                          headers={"WWW-Authenticate": "Bearer"})
    pub = snap.member(index)
    if pub is None:
        published = ", ".join(str(p.index) for p in snap.members) or "none"
        raise RegistryError(
            404, f"ensemble {ens.key} has no published member {index} (published: {published})"
        )
    caller = caller_address(peer, forwarded_for, trusted)
    allowed = {parse_addr(a, "member address") for a in {pub.member.ip, *pub.addresses}}
    if caller not in allowed:
        raise AuthFailure(
            403,
            f"requests for {ens.key} member {index} must come from one of its VMI's "
            f"addresses ({', '.join(sorted({pub.member.ip, *pub.addresses}))}), not {caller} "
            f"(behind a proxy? start the host agent with --trusted-proxy <the proxy's CIDR>)",
            "wrong_address",
        )
    return pub, caller
