"""IMEX's TLS keys in ``config.cfg`` (authEncryption): one source for the generator and the agent.

Standard library only (the generator runs anywhere; ``cryptography`` is for the daemon).
One certificate is both IMEX's server and its client certificate, and one CA file
trusts peers both ways. ``IMEX_SECURITY_TARGET_OVERRIDE`` is not set: in names mode
IMEX dials the slot name, which is exactly the certificate's CN and its one DNS SAN,
so the name it checks already matches (ips mode, where it would dial addresses, is
refused with authEncryption).

``merge_imex_config`` replaces those keys' lines in an existing config (first
occurrence, in place; further duplicates dropped) and appends missing ones, keeping
every other byte; ``ensure_imex_config`` writes the result with the safe writer
only when it differs (IMEX reads the file only at start, so this matters before its
first start, which waits for the certificate).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Final

from guest_agent.files.safewrite import read_bytes, write_file

KEY_FILE: Final = "imex.key"
CERT_FILE: Final = "imex.crt"
CA_FILE: Final = "ca.crt"
PIN_FILE: Final = "pinned-ca.sha256"
DEFAULT_TLS_DIR: Final = "/etc/imex-guest-agent/tls"


def imex_tls_settings(tls_dir: str = DEFAULT_TLS_DIR) -> list[tuple[str, str]]:
    """(key, value) pairs IMEX needs for mutual TLS from files in ``tls_dir``."""
    d = PurePosixPath(tls_dir)
    key, cert, ca = str(d / KEY_FILE), str(d / CERT_FILE), str(d / CA_FILE)
    return [
        ("IMEX_ENABLE_AUTH_ENCRYPTION", "1"),
        ("IMEX_AUTH_ENCRYPTION_MODE", "SSL_TLS"),
        ("IMEX_AUTH_SOURCE", "FILE"),
        ("IMEX_SERVER_KEY", key),
        ("IMEX_SERVER_CERT", cert),
        ("IMEX_SERVER_CERT_AUTH", ca),
        ("IMEX_CLIENT_KEY", key),
        ("IMEX_CLIENT_CERT", cert),
        ("IMEX_CLIENT_CERT_AUTH", ca),
    ]


def merge_imex_config(text: str, settings: list[tuple[str, str]]) -> str:
    """``text`` with ``settings`` set (pure; see the module docstring)."""
    wanted = dict(settings)
    done: set[str] = set()
    out: list[str] = []
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip() if "=" in line and \
            not line.lstrip().startswith("#") else None
        if key in wanted:
            if key not in done:
                out.append(f"{key}={wanted[key]}")
                done.add(key)
            continue
        out.append(line)
    out += [f"{k}={v}" for k, v in settings if k not in done]
    return "\n".join(out) + "\n"


def ensure_imex_config(path: str, tls_dir: str) -> bool:
    """Make IMEX's config at ``path`` carry the TLS keys; True when it was written."""
    raw = read_bytes(path)
    text = raw.decode("utf-8", "surrogateescape") if raw is not None else ""
    merged = merge_imex_config(text, imex_tls_settings(tls_dir))
    return write_file(path, merged.encode("utf-8", "surrogateescape"))
