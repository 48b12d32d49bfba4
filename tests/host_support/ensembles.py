"""ImexEnsemble fixtures for the host agent's tests, as the apiserver returns them.

``imex_ensemble(...)`` builds the object with the CRD's defaults filled in (the
apiserver defaults on every read), taken from the CRD's one source of truth.
"""

from __future__ import annotations

from typing import Any

from host_agent.crd.imexensemble import API_VERSION, KIND
from imex_shared.ensemble_crd import SPEC_FIELDS

CR_UID = "0c0ffee0-0000-4000-8000-0000000000cr"


def imex_ensemble(
    name: str = "gb200",
    *,
    namespace: str = "rack1",
    uid: str = CR_UID,
    generation: int = 1,
    defaults: bool = True,
    status: dict[str, Any] | None = None,
    resource_version: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if defaults:
        body = {k: v["default"] for k, v in SPEC_FIELDS.items() if "default" in v}
    body.update(spec)
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid,
                            "generation": generation}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    obj: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
                           "spec": body}
    if status is not None:
        obj["status"] = status
    return obj


def status_vs_registry(status: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """Where an ImexEnsemble's status and the registry's JSON of it disagree (empty: never).

    The two faces of one snapshot: the generation, domain id, problems, and per member
    slot, IP, VMI, node, phase, ready, clique, the guest's IMEX state (GuestSilent once
    the registry marks the report stale) and the generation it applied.
    """
    out: list[str] = []

    def same(what: str, a: Any, b: Any) -> None:
        if a != b:
            out.append(f"{what}: status {a!r} != registry {b!r}")

    same("generation", status.get("membershipGeneration"), doc.get("generation"))
    same("domain id", status.get("domainID"), doc.get("domain_id"))
    same("problems", status.get("problems"), doc.get("problems"))
    same("members published", status.get("membersPublished"), len(doc.get("members") or ()))
    same("summary", status.get("publishedSummary"),
         f"{len(doc.get('members') or ())}/{doc.get('max_members')}")
    reg = {m["index"]: m for m in doc.get("members") or ()}
    st = {m["index"]: m for m in status.get("members") or ()}
    same("member indexes", sorted(st), sorted(reg))
    for i in sorted(set(st) & set(reg)):
        m, r = st[i], reg[i]
        guest = r.get("guest") or {}
        want_state = "GuestSilent" if guest.get("stale") else (guest.get("imex_state") or "")
        for what, a, b in (("slot", m.get("slot"), r["slot"]), ("ip", m.get("ip"), r["ip"]),
                           ("vmi", m.get("vmi"), r["vmi"]), ("node", m.get("node"), r["node"]),
                           ("phase", m.get("phase"), r["phase"]),
                           ("ready", m.get("ready"), r["ready"]),
                           ("clique", m.get("clique"), r.get("clique")),
                           ("imexState", m.get("imexState"), want_state),
                           ("generationApplied", m.get("generationApplied"),
                            guest.get("generation_applied"))):
            same(f"member {i} {what}", a, b)
    ready = sum(1 for r in reg.values()
                if not (r.get("guest") or {}).get("stale")
                and (r.get("guest") or {}).get("imex_state") == "READY")
    same("imexReady", status.get("imexReady"), ready)
    return out
