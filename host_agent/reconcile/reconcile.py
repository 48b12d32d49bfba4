"""The reconciler's decisions that need no API: which ensemble an object belongs to, the
caches it reads, and the rule that keeps authEncryption fixed on a live ensemble (pure).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from host_agent.ensembles.service_spec import ENSEMBLE_LABEL
from host_agent.ensembles.slices import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    SERVICE_NAME_LABEL,
)
from host_agent.kube.cache import Store
from host_agent.kube.objects import Key, Obj, object_key
from host_agent.state.snapshot import EnsembleSpec


def _labels(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    labels = meta.get("labels") if isinstance(meta, (dict, Mapping)) else None
    return labels if isinstance(labels, (dict, Mapping)) else {}


def vmi_ensemble(obj: Obj) -> Key | None:
    """The (namespace, service) a VMI says it belongs to."""
    value = _labels(obj).get(ENSEMBLE_LABEL)
    if not isinstance(value, str) or not value:
        return None
    return (object_key(obj)[0], value)


def slice_ensemble(obj: Obj) -> Key | None:
    """The (namespace, service) one of our EndpointSlices belongs to."""
    value = _labels(obj).get(SERVICE_NAME_LABEL)
    if not isinstance(value, str) or not value:
        return None
    return (object_key(obj)[0], value)


def keep_auth_encryption(previous: EnsembleSpec | None, spec: EnsembleSpec,
                         problems: list[str]) -> tuple[EnsembleSpec, list[str]]:
    """authEncryption is immutable: IMEX reads its config only at start, so flipping a
    live ensemble would partition it. A change keeps the old value, with a problem."""
    if previous is None or previous.auth_encryption == spec.auth_encryption:
        return spec, problems
    return dataclasses.replace(spec, auth_encryption=previous.auth_encryption), [
        *problems,
        f"{spec.ens.key}: authEncryption cannot change on a live ensemble (IMEX reads its "
        f"config only at start); keeping {str(previous.auth_encryption).lower()}; recreate "
        "the ensemble to change it",
    ]


def new_stores() -> tuple[Store, Store, Store]:
    """(vmis indexed by ensemble, services, slices)."""
    return Store("vmi", vmi_ensemble), Store("service"), Store("endpointslice")


def managed_slice_labels() -> dict[str, str]:
    """The label selector of the slice informer: only slices we manage."""
    return {MANAGED_BY_LABEL: MANAGED_BY}


@dataclass(frozen=True, slots=True)
class MemberChange:
    """One slot whose published address changed between two snapshots."""

    slot: int
    vmi: str | None
    old_ip: str | None
    new_ip: str | None

    def text(self) -> str:
        who = f"slot {self.slot}" + (f" ({self.vmi})" if self.vmi else "")
        if self.old_ip is None:
            return f"{who} joined at {self.new_ip}"
        if self.new_ip is None:
            return f"{who} left (was at {self.old_ip})"
        return f"{who} moved from {self.old_ip} to {self.new_ip}"


def member_changes(before: Mapping[int, tuple[str | None, str]],
                   after: Mapping[int, tuple[str | None, str]]) -> list[MemberChange]:
    """Slot by slot, what changed between two published member maps (slot -> (vmi, ip))."""
    out = []
    for slot in sorted(set(before) | set(after)):
        old, new = before.get(slot), after.get(slot)
        if old is not None and new is not None and old[1] == new[1]:
            continue
        vmi = (new or old or (None, ""))[0]
        out.append(MemberChange(slot, vmi, old[1] if old else None, new[1] if new else None))
    return out
