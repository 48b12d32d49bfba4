"""ImexEnsemble JSON -> ``EnsembleSpec``, and what a reconcile pass concluded (pure).

An ensemble is declared either by an ImexEnsemble (this module) or by a
hand-made Service (service_spec.py). Both parse into one ``EnsembleSpec``; the
reconciler runs one code path after parsing.

Parsing (``parse_ensemble_cr``). The apiserver validated the object against
the CRD (host_agent/crd/imexensemble.py) and filled in its defaults, so a CR seen here is
usually good; the checks below are for what a schema cannot say and for an
old or hand-rolled API server. The defaults are the CRD's own
(``imex_shared.ensemble_crd``), never a second copy. A CR the agent cannot
use is a **refusal** with a reason (``InvalidSpec``, ``SelectorConflict``):
the reconciler keeps the last usable spec, if any, and the status says
Degraded. ``memberSelector`` is always ANDed with
``imex-ensemble.io/ensemble=<name>``, so a selector that asks for another
ensemble's label value can never match and would, read alone, take that
ensemble's VMIs: refused, naming the value.

What to do with the Service of the CR's name is owned_service.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from host_agent.ensembles.owned_service import Action
from host_agent.ensembles.service_spec import ENSEMBLE_LABEL, check_spec
from host_agent.kube.selectors import (
    LabelSelector,
    SelectorError,
    contradiction,
    parse_label_selector,
)
from host_agent.state.snapshot import EnsembleSpec
from imex_shared.ensemble_crd import SPEC_FIELDS
from imex_shared.model import EnsembleId, ModelError

#: Degraded reasons of a CR the agent cannot use (status and Events use them).
INVALID_SPEC: Final = "InvalidSpec"
SELECTOR_CONFLICT: Final = "SelectorConflict"
SERVICE_CONFLICT: Final = "ServiceConflict"


@dataclass(frozen=True, slots=True)
class CrParse:
    """What one ImexEnsemble says: a spec, or the reason (and message) it is refused."""

    spec: EnsembleSpec | None
    reason: str | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class Declaration:
    """What the last pass concluded about one ensemble; its status and Events read it.

    ``kind`` is what declared it: an ImexEnsemble (its status is written, its Events
    regard it) or, for a Service-only ensemble, the Service (Events only; ``uid`` is
    the Service's and ``generation`` 0).
    """

    namespace: str
    name: str
    uid: str
    #: metadata.generation of the CR the pass read (status.observedGeneration).
    generation: int
    #: The spec in force: the CR's, its last usable one, or (conflict) the Service's.
    spec: EnsembleSpec | None
    #: Why the CR is not (wholly) in force, as (reason, message): InvalidSpec,
    #: SelectorConflict, ServiceConflict.
    refusals: tuple[tuple[str, str], ...] = ()
    #: What was found for the Service of its name, and what this pass wrote to it.
    service_action: Action | None = None
    service_wrote: str | None = None
    kind: Literal["ImexEnsemble", "Service"] = "ImexEnsemble"

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


def cr_identity(cr: Mapping[str, Any]) -> tuple[str, int]:
    """(uid, metadata.generation) of an ImexEnsemble ("" and 0 when absent)."""
    meta = _mapping(cr.get("metadata"))
    uid, gen = meta.get("uid"), meta.get("generation")
    return (uid if isinstance(uid, str) else "",
            gen if isinstance(gen, int) and not isinstance(gen, bool) else 0)


def spec_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> bool:
    """Whether a CR event can change what the reconciler does (not a status-only write).

    The apiserver moves metadata.generation on every spec change and never on a status
    write, so our own status writes coming back cost no pass.
    """
    if old is None or new is None:
        return True
    if cr_identity(old) != cr_identity(new):
        return True
    return _mapping(old.get("metadata")).get("deletionTimestamp") != \
        _mapping(new.get("metadata")).get("deletionTimestamp")


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def cr_key(cr: Mapping[str, Any]) -> tuple[str, str]:
    meta = _mapping(cr.get("metadata"))
    ns, name = meta.get("namespace"), meta.get("name")
    return (ns if isinstance(ns, str) else "", name if isinstance(name, str) else "")


def _default(name: str) -> Any:
    return SPEC_FIELDS[name].get("default")


def _int_field(spec: Mapping[str, Any], name: str) -> int:
    value = spec.get(name, _default(name))
    facts = SPEC_FIELDS[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"spec.{name}={value!r} is not an integer")
    if not facts["minimum"] <= value <= facts["maximum"]:
        raise ValueError(f"spec.{name}={value} is not in {facts['minimum']}..{facts['maximum']}")
    return value


def _str_field(spec: Mapping[str, Any], name: str) -> str | None:
    value = spec.get(name, _default(name))
    if value is None:
        return None
    facts = SPEC_FIELDS[name]
    if not isinstance(value, str):
        raise ValueError(f"spec.{name}={value!r} is not a string")
    if "enum" in facts and value not in facts["enum"]:
        raise ValueError(f"spec.{name}={value!r} is not one of {', '.join(facts['enum'])}")
    if "max_length" in facts and len(value) > facts["max_length"]:
        raise ValueError(f"spec.{name} is longer than {facts['max_length']} characters")
    return value


def parse_ensemble_cr(cr: Mapping[str, Any]) -> CrParse:
    """The ensemble an ImexEnsemble declares, or why the agent cannot use it."""
    namespace, name = cr_key(cr)
    what = f"ImexEnsemble {namespace}/{name}"
    meta = _mapping(cr.get("metadata"))
    try:
        ens = EnsembleId(namespace, name)
    except ModelError as exc:
        return CrParse(None, INVALID_SPEC,
                       f"{what}: {exc} (it names the Service and every slot)")
    spec = _mapping(cr.get("spec"))
    try:
        max_members = _int_field(spec, "maxMembers")
        port = _int_field(spec, "port")
        mode = _str_field(spec, "mode") or "names"
        network = _str_field(spec, "network")
        token = _str_field(spec, "tokenSHA256")
        ca_rotation = _str_field(spec, "caRotation")
        auth = spec.get("authEncryption", _default("authEncryption"))
        if not isinstance(auth, bool):
            raise ValueError(f"spec.authEncryption={auth!r} is not true or false")
        registry_tls = spec.get("registryTLS") or "Optional"  # absent: Optional
        if registry_tls not in ("Optional", "Required"):
            raise ValueError(f"spec.registryTLS={registry_tls!r} is not Optional or Required")
    except ValueError as exc:
        return CrParse(None, INVALID_SPEC, f"{what}: {exc}")
    if token is not None and (len(token) != 64 or token.strip("0123456789abcdef")):
        return CrParse(None, INVALID_SPEC, f"{what}: spec.tokenSHA256 is not 64 lowercase hex "
                       "digits")
    clash = check_spec("ips" if mode == "ips" else "names", auth)
    if clash is not None:
        return CrParse(None, INVALID_SPEC, f"{what}: {clash}")
    selector = None
    if spec.get("memberSelector") is not None:
        try:
            selector = parse_label_selector(spec["memberSelector"], "spec.memberSelector")
        except SelectorError as exc:
            return CrParse(None, INVALID_SPEC, f"{what}: {exc}")
        why = selector_conflict(selector, name)
        if why is not None:
            return CrParse(None, SELECTOR_CONFLICT, f"{what}: spec.memberSelector {why}")
    uid = meta.get("uid")
    return CrParse(EnsembleSpec(
        ens=ens,
        max_members=max_members,
        port=port,
        network=network,
        token_sha256=token,
        mode="ips" if mode == "ips" else "names",
        auth_encryption=auth,
        ca_rotation=ca_rotation,
        member_selector=selector,
        registry_tls_required=registry_tls == "Required",
        source="cr",
        owner_uid=uid if isinstance(uid, str) and uid else None,
    ))


def selector_conflict(selector: LabelSelector, name: str) -> str | None:
    """Why a memberSelector cannot be used for ensemble ``name`` (None: it can)."""
    why = contradiction(selector)
    if why is not None:
        return f"can never match: {why}"
    on_label = [r for r in selector.requirements() if r.key == ENSEMBLE_LABEL]
    others = sorted({v for r in on_label if r.operator == "In" for v in r.values} - {name})
    if others:
        return (f"selects {ENSEMBLE_LABEL} in ({', '.join(others)}): members of this "
                f"ensemble are always labelled {ENSEMBLE_LABEL}={name}, and the VMIs of "
                "another ensemble are never taken from it")
    if not all(r.matches({ENSEMBLE_LABEL: name}) for r in on_label):
        return (f"can never match: it excludes {ENSEMBLE_LABEL}={name}, the label every "
                "member carries")
    return None
