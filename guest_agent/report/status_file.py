"""The agent's status file and the ``status`` command's rendering of it.

The daemon rewrites ``status_file`` (default
``/run/imex-guest-agent/status.json``) after every apply and every change of
IMEX's state, with the safe writer (temp + rename), so ``status`` and any
monitoring never read a torn file. Unchanged content is not rewritten.
``format_table`` is pure; ``show`` is the CLI's side.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from guest_agent.files.safewrite import FileWriteError, write_file
from imex_shared.imex_domain import SELF_CELL, letter, matrix_lines
from imex_shared.model import is_decimal

SCHEMA = 1


class StatusError(RuntimeError):
    """The status file is missing or unreadable."""


@dataclass
class Status:
    ensemble: str
    namespace: str
    domain_id: str
    mode: str
    agent_version: str
    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)
    updated_at: float = 0.0
    own_index: int | None = None
    own_slot: str | None = None
    own_slot_mode: str = "auto"
    own_slot_how: str | None = None
    own_slot_note: str | None = None
    own_ip: str | None = None
    source: str | None = None
    generation_applied: int | None = None
    members: list[dict[str, Any]] = field(default_factory=list)
    nodes_config_sha256: str | None = None
    hosts_sha256: str | None = None
    imex_control: str = "systemd"
    imex_state: str = "UNKNOWN"
    imex_pid: int | None = None
    signals: int = 0
    restarts: int = 0
    starts: int = 0
    reasserts: int = 0
    applies: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    #: authEncryption: the certificate's state (guest_agent/tls/keeper.py ``TlsStatus``)
    tls: dict[str, Any] | None = None
    #: the registry as the reporter sees it: url, transport, the pinned registry CA, the
    #: server certificate last seen, the host agent's version and what the guest makes
    #: of it (report_io.py); None before the first report
    registry: dict[str, Any] | None = None
    #: from ``nvidia-imex-ctl -N -j``: the domain status IMEX printed and our own row
    #: (peer index -> link state); None when the last pass had no valid answer.
    imex_domain_status: str | None = None
    imex_row: dict[str, str] | None = None
    fabric: dict[str, Any] | None = None
    clique: str | None = None
    #: deprecated beside imex_channels (this release): channel 0 among them
    imex_channel0: bool | None = None
    #: the configured IMEX channels whose device nodes exist and are correct
    imex_channels: list[int] = field(default_factory=list)
    #: the channel keeper's last word: "present: 0 of 0", "waiting: ...", errors
    imex_channels_note: str | None = None
    #: the last preflight run (guest_agent/preflight): [{"name", "result", "message"}]
    preflight: list[dict[str, str]] = field(default_factory=list)
    preflight_at: float | None = None
    #: malformed ctl / nvidia-smi output dropped so far
    domain_errors: int = 0
    domain_at: float | None = None
    schema: int = SCHEMA

    def to_json(self) -> dict[str, Any]:
        """The fields as a dict whose values are shared, not copied: every field holds
        JSON data already, and ``asdict``'s deep copy was most of a write's CPU."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def encode(status: Status) -> bytes:
    """Stable bytes (sorted keys, one line) of ``status``.

    Not indented: ``json`` encodes an indented document in pure Python, five times the
    CPU of its C encoder, and the file is rewritten up to three times per change.
    ``imex-guest-agent status`` prints it as a table, and ``jq .`` indents it."""
    return (json.dumps(status.to_json(), sort_keys=True) + "\n").encode()


def write_status(path: str, status: Status) -> bool:
    """Atomically write ``status``; True when the file changed.

    Not fsynced: the file is runtime state under ``/run`` (a tmpfs), rewritten after
    every change and worth nothing after a reboot; readers still never see it torn."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
    try:
        return write_file(path, encode(status), durable=False)
    except FileWriteError as exc:
        raise StatusError(str(exc)) from exc


def load_status(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise StatusError(f"{path}: no status file (is the agent running?)") from exc
    except OSError as exc:
        raise StatusError(f"{path}: cannot read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise StatusError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise StatusError(f"{path}: not a status object")
    return data


def _age(ts: object, now: float) -> str:
    if not isinstance(ts, int | float) or not ts:
        return "-"
    return f"{max(0.0, now - float(ts)):.0f}s ago"


def format_table(data: Mapping[str, Any], now: float | None = None) -> str:
    """Human rendering of a status object (pure)."""
    now = time.time() if now is None else now
    own = data.get("own_index")
    rows = [
        ("ensemble", f"{data.get('namespace')}/{data.get('ensemble')} "
         f"(domain {data.get('domain_id')}, mode {data.get('mode')})"),
        ("own slot", f"{data.get('own_slot') or '-'} (index {own if own is not None else '?'})"),
        ("own ip", f"{data.get('own_ip') or '-'} (own_slot={data.get('own_slot_mode')}, "
         f"{data.get('own_slot_how') or 'unresolved'})"),
    ]
    if data.get("own_slot_note"):
        rows.append(("own note", str(data["own_slot_note"])))
    rows += [
        ("source", f"{data.get('source') or '-'}" + (
            f", generation {data['generation_applied']}"
            if data.get("generation_applied") is not None else "")),
        ("imex", f"{data.get('imex_state')} via {data.get('imex_control')} "
         f"(pid {data.get('imex_pid') or '-'})"),
        ("signals", str(data.get("signals", 0))),
        ("restarts", f"{data.get('restarts', 0)} (starts {data.get('starts', 0)})"),
        ("re-asserts", str(data.get("reasserts", 0))),
        ("registry", _registry(data.get("registry"))),
        ("updated", _age(data.get("updated_at"), now)),
        ("last error", f"{data.get('last_error') or '-'}"
         + (f" ({_age(data.get('last_error_at'), now)})" if data.get("last_error") else "")),
    ]
    rows += _domain_rows(data, now)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += _own_row(data, own)
    members = data.get("members") or []
    lines.append("")
    lines.append(f"{'idx':>3}  {'slot':<24}  ip")
    for m in members:
        if not isinstance(m, dict):
            continue
        mark = " *" if m.get("index") == own else ""
        lines.append(f"{m.get('index')!s:>3}  {m.get('slot')!s:<24}  {m.get('ip')}{mark}")
    if not members:
        lines.append("  (no members known)")
    return "\n".join(lines) + "\n"


def _registry(doc: object) -> str:
    if not isinstance(doc, dict):
        return "-"
    host = doc.get("host") if isinstance(doc.get("host"), dict) else {}
    cert = doc.get("server_cert") if isinstance(doc.get("server_cert"), dict) else {}
    parts = [str(doc.get("transport") or "?")]
    if doc.get("ca_sha256"):
        parts.append(f"CA {str(doc['ca_sha256'])[:16]}")
    if cert:
        parts.append(f"cert {str(cert.get('sha256'))[:16]} until {cert.get('not_after')}")
    if host:
        parts.append(f"host {host.get('version') or 'before 0.2'} ({host.get('skew')})")
    if doc.get("refused_fields"):
        parts.append(f"fields refused: {', '.join(map(str, doc['refused_fields']))}")
    return ", ".join(parts)


def _domain_rows(data: Mapping[str, Any], now: float) -> list[tuple[str, str]]:
    clique = data.get("clique")
    channels = data.get("imex_channels")
    note = data.get("imex_channels_note")
    view = data.get("imex_domain_status")
    checks = [c for c in data.get("preflight") or () if isinstance(c, dict)]
    bad = [f"{c.get('name')} {c.get('result')}" for c in checks
           if c.get("result") in ("FAIL", "WARN")]
    return [
        ("clique", str(clique) if clique else "none (no NVLink fabric reported by nvidia-smi)"),
        ("channels", (", ".join(map(str, channels)) if isinstance(channels, list) and channels
                      else "none") + (f" ({note})" if note else "")),
        ("preflight", "-" if not checks else
         (f"{len(checks)} checks, " + (", ".join(bad) if bad else "all PASS"))
         + f" ({_age(data.get('preflight_at'), now)})"),
        ("imex view", f"{view or '-'} (nvidia-imex-ctl -N -j, {_age(data.get('domain_at'), now)})"
         + (f", {data['domain_errors']} dropped" if data.get("domain_errors") else "")),
    ]


def _own_row(data: Mapping[str, Any], own: object) -> list[str]:
    """This member's row of the link matrix, in the registry's ``?format=matrix`` layout."""
    row = data.get("imex_row")
    if not isinstance(row, dict) or not isinstance(own, int):
        return []
    peers = sorted({int(k) for k in row if is_decimal(str(k))} | {own})
    cells = [SELF_CELL if p == own else letter(row.get(str(p))) for p in peers]
    return ["", *matrix_lines(peers, [(own, cells)])]


def _label(value: object) -> str:
    text = str(value)
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(data: Mapping[str, Any]) -> str:
    """The status as Prometheus text (node_exporter's textfile collector; pure).

    ``imex_build_info{version}`` is the running daemon's release (the status file's
    ``agent_version``), the same gauge the host agent serves; the others are the
    status's counters and states."""
    ens = f'namespace="{_label(data.get("namespace"))}",ensemble="{_label(data.get("ensemble"))}"'
    running = 1 if data.get("agent_running", True) else 0
    rows = [
        ("imex_build_info", "gauge", "1, labelled with the imex-ensemble release this agent "
         "runs", f'{{version="{_label(data.get("agent_version"))}"}}', 1),
        ("imex_guest_agent_running", "gauge", "1 while the pid in the status file runs",
         f"{{{ens}}}", running),
        ("imex_guest_imex_ready", "gauge", "1 while IMEX says READY", f"{{{ens}}}",
         1 if data.get("imex_state") == "READY" else 0),
        ("imex_guest_generation_applied", "gauge", "the membership generation applied",
         f"{{{ens}}}", data.get("generation_applied") or 0),
        ("imex_guest_imex_signals_total", "counter", "SIGUSR1 sent to IMEX", f"{{{ens}}}",
         data.get("signals") or 0),
        ("imex_guest_imex_restarts_total", "counter", "IMEX restarts by the agent",
         f"{{{ens}}}", data.get("restarts") or 0),
        ("imex_guest_reasserts_total", "counter", "managed files restored after another "
         "writer", f"{{{ens}}}", data.get("reasserts") or 0),
    ]
    out = []
    for name, kind, doc, labels, value in rows:
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{labels} {value}"]
    return "\n".join(out) + "\n"
