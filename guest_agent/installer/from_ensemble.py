"""``cloudinit --from-ensemble FILE``: the ensemble settings of user-data, read from the CR.

So user-data and the ImexEnsemble cannot disagree on ``maxMembers``, ``port``
or ``mode`` (or ``authEncryption``): the generator takes them from the object
``kubectl get imexensemble NAME -o json`` prints, applies the CRD's defaults
to fields the object leaves out, and refuses an explicit flag that says
otherwise. The token given with ``--token``/``--token-file`` must hash to the
CR's ``spec.tokenSHA256``.

Formats: JSON always (``-o json``; ``-`` reads standard input). YAML when
PyYAML is importable (``-o yaml``, or the example's imexensemble.yaml): the
``cloudinit`` extra installs it; the bare package has no dependency, so without
it a YAML file is refused with a message naming the extra.

The CRD's defaults and bounds come from ``imex_shared/ensemble_crd.py``,
generated from the CRD's one source of truth (guest_agent may not import
host_agent); nothing here restates them. Pure but for ``load_document``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from imex_shared.ensemble_crd import API_VERSION, KIND, SPEC_FIELDS
from imex_shared.model import EnsembleId, ModelError

#: flag (argparse dest) -> the spec field it must agree with
FLAG_FIELDS: Final = {
    "max_members": ("--max-members", "maxMembers"),
    "imex_port": ("--imex-port", "port"),
    "mode": ("--mode", "mode"),
}


class FromEnsembleError(ValueError):
    """The file is not a usable ImexEnsemble, or a flag contradicts it; names what."""


@dataclass(frozen=True, slots=True)
class EnsembleSettings:
    """What user-data takes from an ImexEnsemble (CRD defaults applied)."""

    name: str
    namespace: str
    max_members: int
    port: int
    mode: str
    token_sha256: str | None
    auth_encryption: bool
    #: status.caSHA256: the CA fingerprint guests pin (authEncryption), once published
    ca_sha256: str | None
    #: status.registryCASHA256: the registry's TLS CA, once it serves HTTPS (0.2)
    registry_ca_sha256: str | None = None
    #: spec.registryTLS: Required: the token only ever goes over HTTPS
    registry_tls_required: bool = False


def load_document(path: str, stdin: IO[str] | None = None) -> Any:
    """The object in ``path`` (``-``: standard input): JSON, or YAML with PyYAML."""
    where = "standard input" if path == "-" else path
    try:
        text = (stdin or sys.stdin).read() if path == "-" else \
            Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FromEnsembleError(f"--from-ensemble {where}: cannot read: {exc}") from exc
    try:
        return json.loads(text)
    except ValueError as json_error:
        try:
            import yaml  # optional: the guest package does not depend on it
        except ImportError:
            raise FromEnsembleError(
                f"--from-ensemble {where}: not JSON ({json_error}); YAML needs PyYAML, which "
                "is not installed here: pip install 'imex-ensemble[cloudinit]', or use "
                "`kubectl get imexensemble NAME -o json`"
            ) from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise FromEnsembleError(
                f"--from-ensemble {where}: neither JSON nor YAML: {exc}") from exc


def _check(field: str, value: Any) -> Any:
    facts = SPEC_FIELDS[field]
    where = f"spec.{field}"
    kind = facts["kind"]
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise FromEnsembleError(f"{where}={value!r} is not an integer")
        if not facts["minimum"] <= value <= facts["maximum"]:
            raise FromEnsembleError(
                f"{where}={value} is not in {facts['minimum']}..{facts['maximum']}")
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise FromEnsembleError(f"{where}={value!r} is not true or false")
    elif kind == "string":
        if not isinstance(value, str):
            raise FromEnsembleError(f"{where}={value!r} is not a string")
        if "enum" in facts and value not in facts["enum"]:
            raise FromEnsembleError(
                f"{where}={value!r} is not one of {', '.join(facts['enum'])}")
        if "pattern" in facts and not re.match(facts["pattern"], value):
            raise FromEnsembleError(f"{where}={value!r} does not match {facts['pattern']}")
    return value


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _field(spec: Mapping[str, Any], field: str) -> Any:
    """The spec field, or the CRD's default for it (the API server's defaulting)."""
    if field in spec and spec[field] is not None:
        return _check(field, spec[field])
    return SPEC_FIELDS[field].get("default")


def settings_from_object(obj: Any) -> EnsembleSettings:
    """An ImexEnsemble (as ``kubectl get -o json`` prints it) -> its settings."""
    if isinstance(obj, Mapping) and obj.get("kind") == "List":
        items = obj.get("items") or []
        if len(items) != 1:
            raise FromEnsembleError(
                f"the file is a List of {len(items)} objects; give one ImexEnsemble "
                "(`kubectl get imexensemble NAME -o json`)")
        obj = items[0]
    if not isinstance(obj, Mapping):
        raise FromEnsembleError("the file does not hold an object")
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
        raise FromEnsembleError(
            f"the file holds {obj.get('apiVersion')!r} {obj.get('kind')!r}, not an "
            f"{API_VERSION} {KIND}")
    meta = _mapping(obj.get("metadata"))
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        raise FromEnsembleError(
            "metadata.namespace is missing (kubectl prints it; a hand-written file needs it)")
    try:
        EnsembleId(namespace, name if isinstance(name, str) else "")
    except ModelError as exc:
        raise FromEnsembleError(f"metadata: {exc}") from exc
    spec = _mapping(obj.get("spec"))
    status = _mapping(obj.get("status"))
    auth = bool(_field(spec, "authEncryption"))
    mode = str(_field(spec, "mode"))
    if auth and mode == "ips":
        raise FromEnsembleError("spec.authEncryption needs spec.mode names")
    ca = status.get("caSHA256")
    registry_ca = status.get("registryCASHA256")
    return EnsembleSettings(
        registry_ca_sha256=registry_ca if isinstance(registry_ca, str) and registry_ca
        else None,
        registry_tls_required=_field(spec, "registryTLS") == "Required",
        name=str(name),
        namespace=namespace,
        max_members=int(_field(spec, "maxMembers")),
        port=int(_field(spec, "port")),
        mode=mode,
        token_sha256=_field(spec, "tokenSHA256"),
        auth_encryption=auth,
        ca_sha256=ca if isinstance(ca, str) and ca else None,
    )


def token_matches(token: str, sha256_hex: str) -> bool:
    return hashlib.sha256(token.encode()).hexdigest() == sha256_hex


def apply_to_flags(
    settings: EnsembleSettings, flags: dict[str, Any], token: str | None, source: str
) -> tuple[dict[str, Any], list[str]]:
    """The flags with the CR's settings filled in, and notes for the user.

    ``flags`` maps argparse dests to the values given (None: not given). A given
    value that differs from the CR's is refused, naming both; the token must hash
    to ``spec.tokenSHA256``.
    """
    out = dict(flags)
    notes: list[str] = []
    want: dict[str, tuple[str, str, object]] = {
        "ensemble": ("--ensemble", "metadata.name", settings.name),
            "namespace": ("--namespace", "metadata.namespace", settings.namespace)}
    for dest, (flag, field) in FLAG_FIELDS.items():
        want[dest] = (flag, f"spec.{field}", getattr(settings, "port" if dest == "imex_port"
                                                     else dest))
    if "auth_encryption" in flags:
        want["auth_encryption"] = ("--auth-encryption", "spec.authEncryption",
                                   settings.auth_encryption)
    elif settings.auth_encryption:
        raise FromEnsembleError(
            f"{source} has spec.authEncryption true, and this generator cannot configure "
            "IMEX authentication yet")
    if "ca_sha256" in flags and settings.ca_sha256 is not None:
        want["ca_sha256"] = ("--ca-sha256", "status.caSHA256", settings.ca_sha256)
    url = flags.get("registry_url")
    https = isinstance(url, str) and url.startswith("https://")
    if settings.registry_tls_required and url is not None and not https:
        raise FromEnsembleError(
            f"{source} has spec.registryTLS Required: its token is refused over plain HTTP, "
            f"so --registry-url must be https:// (the registry's HTTPS port), not {url}")
    if "registry_ca_sha256" in flags and settings.registry_ca_sha256 is not None:
        if https:
            want["registry_ca_sha256"] = ("--registry-ca-sha256", "status.registryCASHA256",
                                          settings.registry_ca_sha256)
        elif url is not None:
            notes.append(f"{source}'s registry serves HTTPS (status.registryCASHA256): give "
                         "an https:// --registry-url so the token never crosses the network "
                         "in clear")
    for dest, (flag, field, value) in want.items():
        given = flags.get(dest)
        if dest == "auth_encryption" and given is False:
            given = None  # a store_true flag not given
        if given is not None and given != value:
            raise FromEnsembleError(
                f"{flag} {given!r} conflicts with {field} {value!r} in {source}: drop the "
                "flag (the ImexEnsemble decides) or change the ImexEnsemble")
        out[dest] = value
    if settings.token_sha256 is not None:
        if token is None:
            notes.append(f"{source} has spec.tokenSHA256 but no --token/--token-file was "
                         "given: the registry will refuse this guest's status reports")
        elif not token_matches(token, settings.token_sha256):
            raise FromEnsembleError(
                f"the token's sha256 is {hashlib.sha256(token.encode()).hexdigest()[:12]}..., "
                f"but spec.tokenSHA256 in {source} is {settings.token_sha256[:12]}...: the "
                "registry would refuse every report (hash the token without its newline)")
    elif token is not None:
        notes.append(f"{source} has no spec.tokenSHA256: set it to "
                     f"{hashlib.sha256(token.encode()).hexdigest()} so the registry accepts "
                     "this guest's reports")
    if settings.auth_encryption and settings.ca_sha256 is None and \
            flags.get("ca_sha256") is None:
        notes.append(f"{source} has no status.caSHA256 yet (the host agent publishes it once "
                     "the CA exists): give --ca-sha256, or fetch the ImexEnsemble again")
    return out, notes
