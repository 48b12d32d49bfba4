"""ImexEnsemble -> EnsembleSpec, and what the agent does with the Service of its name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from host_agent.crd.imexensemble import API_VERSION, KIND
from host_agent.ensembles.cr_spec import Declaration, parse_ensemble_cr, spec_changed
from host_agent.ensembles.owned_service import (
    controller_of,
    desired_service,
    plan_service,
    service_in_sync,
)
from host_agent.ensembles.service_spec import parse_ensemble_service, service_annotations
from host_agent.kube.selectors import LabelSelector, Requirement
from imex_shared.model import EnsembleId
from tests.host_support.ensembles import CR_UID, imex_ensemble
from tests.host_support.kubevirt import service

TOKEN = "ab" * 32


def owned_by_ensemble(obj: dict[str, Any]) -> bool:
    """The object's controller is an ImexEnsemble (whatever its uid)."""
    ref = controller_of(obj)
    return ref is not None and ref.get("kind") == KIND and \
        str(ref.get("apiVersion", "")).split("/")[0] == API_VERSION.split("/")[0]


def test_defaults_are_the_crds() -> None:
    parsed = parse_ensemble_cr(imex_ensemble())
    assert parsed.reason is None and parsed.spec is not None
    spec = parsed.spec
    assert spec.ens == EnsembleId("rack1", "gb200")
    assert (spec.max_members, spec.port, spec.mode, spec.auth_encryption) == (18, 50000,
                                                                               "names", False)
    assert (spec.network, spec.token_sha256, spec.ca_rotation, spec.member_selector) == (
        None, None, None, None)
    assert (spec.source, spec.owner_uid, spec.uid) == ("cr", CR_UID, None)
    # a server that did not default (or a hand-made object) gives the same spec
    assert parse_ensemble_cr(imex_ensemble(defaults=False)).spec == spec


def test_every_field() -> None:
    parsed = parse_ensemble_cr(imex_ensemble(
        maxMembers=4, port=50001, network="imex-net", mode="ips", tokenSHA256=TOKEN,
        caRotation="2026-12", memberSelector={"matchLabels": {"rack": "a"}}))
    spec = parsed.spec
    assert spec is not None
    assert (spec.max_members, spec.port, spec.network, spec.mode, spec.token_sha256,
            spec.ca_rotation) == (4, 50001, "imex-net", "ips", TOKEN, "2026-12")
    assert spec.member_selector == LabelSelector(match_labels=(("rack", "a"),))


@pytest.mark.parametrize(
    ("fields", "reason", "message"),
    [
        ({"maxMembers": 0}, "InvalidSpec", "spec.maxMembers=0 is not in 1..1000"),
        ({"maxMembers": "18"}, "InvalidSpec", "spec.maxMembers='18' is not an integer"),
        ({"port": True}, "InvalidSpec", "spec.port=True is not an integer"),
        ({"mode": "dns"}, "InvalidSpec", "spec.mode='dns' is not one of names, ips"),
        ({"tokenSHA256": "AB" * 32}, "InvalidSpec",
         "spec.tokenSHA256 is not 64 lowercase hex digits"),
        ({"authEncryption": "yes"}, "InvalidSpec",
         "spec.authEncryption='yes' is not true or false"),
        ({"authEncryption": True, "mode": "ips"}, "InvalidSpec",
         "authEncryption needs mode names: IMEX checks peer certificates against host names, "
         "which mode ips does not write"),
        ({"memberSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
         "InvalidSpec", "spec.memberSelector.matchExpressions[0].operator: 'Near' is not one "
         "of In, NotIn, Exists, DoesNotExist"),
        ({"memberSelector": {"matchLabels": {"imex-ensemble.io/ensemble": "other"}}},
         "SelectorConflict", "spec.memberSelector selects imex-ensemble.io/ensemble in "
         "(other): members of this ensemble are always labelled "
         "imex-ensemble.io/ensemble=gb200, and the VMIs of another ensemble are never taken "
         "from it"),
        ({"memberSelector": {"matchExpressions": [{"key": "imex-ensemble.io/ensemble",
                                                   "operator": "In",
                                                   "values": ["gb200", "gb300"]}]}},
         "SelectorConflict", "spec.memberSelector selects imex-ensemble.io/ensemble in "
         "(gb300)"),
        ({"memberSelector": {"matchExpressions": [{"key": "imex-ensemble.io/ensemble",
                                                   "operator": "NotIn", "values": ["gb200"]}]}},
         "SelectorConflict", "spec.memberSelector can never match"),
        ({"memberSelector": {"matchLabels": {"rack": "a"}, "matchExpressions": [
            {"key": "rack", "operator": "DoesNotExist"}]}},
         "SelectorConflict", "spec.memberSelector can never match: label rack must both exist "
         "and not exist"),
    ],
)
def test_unusable_specs_are_refused_with_a_reason(
    fields: dict[str, Any], reason: str, message: str
) -> None:
    parsed = parse_ensemble_cr(imex_ensemble(**fields))
    assert parsed.spec is None
    assert parsed.reason == reason
    assert parsed.message is not None
    assert parsed.message.startswith("ImexEnsemble rack1/gb200: ")
    assert message in parsed.message


def test_a_name_that_is_not_a_dns_label_is_refused() -> None:
    parsed = parse_ensemble_cr(imex_ensemble("gb200.rack"))
    assert parsed.spec is None and parsed.reason == "InvalidSpec"
    assert parsed.message == ("ImexEnsemble rack1/gb200.rack: ensemble name 'gb200.rack' is "
                              "not a lowercase RFC 1123 label (it names the Service and every "
                              "slot)")


def test_own_label_in_the_selector_is_fine() -> None:
    parsed = parse_ensemble_cr(imex_ensemble(memberSelector={"matchExpressions": [
        {"key": "imex-ensemble.io/ensemble", "operator": "In", "values": ["gb200"]},
        {"key": "tier", "operator": "Exists"}]}))
    assert parsed.spec is not None and parsed.spec.member_selector is not None
    assert parsed.spec.member_selector.match_expressions[1] == Requirement("tier", "Exists")


def cr_spec(**fields: Any) -> Any:
    spec = parse_ensemble_cr(imex_ensemble(**fields)).spec
    assert spec is not None
    return spec


def test_desired_service_byte_for_byte() -> None:
    body = desired_service(cr_spec(maxMembers=4, tokenSHA256=TOKEN, network="imex-net"))
    assert json.dumps(body, sort_keys=True, indent=1) == json.dumps({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "gb200",
            "namespace": "rack1",
            "labels": {"imex-ensemble.io/ensemble": "gb200"},
            "annotations": {
                "imex-ensemble.io/max-members": "4",
                "imex-ensemble.io/port": "50000",
                "imex-ensemble.io/mode": "names",
                "imex-ensemble.io/auth-encryption": "false",
                "imex-ensemble.io/network": "imex-net",
                "imex-ensemble.io/token-sha256": TOKEN,
            },
            "ownerReferences": [{
                "apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
                "name": "gb200", "uid": CR_UID, "controller": True,
                "blockOwnerDeletion": True}],
        },
        "spec": {"clusterIP": "None",
                 "ports": [{"name": "imex", "port": 50000, "protocol": "TCP"}]},
    }, sort_keys=True, indent=1)


def test_the_owned_service_alone_declares_the_same_ensemble() -> None:
    """Orphaned (CR deleted with --cascade=orphan), the Service parses to the same spec."""
    spec = cr_spec(maxMembers=4, port=50123, tokenSHA256=TOKEN, mode="ips", caRotation="r1")
    body = desired_service(spec)
    body["metadata"]["uid"] = "svc-uid"
    again, problems = parse_ensemble_service(body)
    assert problems == [] and again is not None
    for field in ("ens", "max_members", "port", "network", "token_sha256", "mode",
                  "auth_encryption", "ca_rotation"):
        assert getattr(again, field) == getattr(spec, field), field
    assert owned_by_ensemble(body) and not owned_by_ensemble(service())


def with_owner(obj: dict[str, Any], uid: str, kind: str = "ImexEnsemble") -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "imex-ensemble.io/v1alpha1",
                                           "kind": kind, "name": "gb200", "uid": uid,
                                           "controller": True}]
    return obj


@pytest.mark.parametrize(
    ("observed", "action", "fragment"),
    [
        (None, "create", None),
        (with_owner(service(), CR_UID), "own", None),
        (service(), "adopt", None),
        (with_owner(service(), "someone-else"), "conflict",
         "is controlled by ImexEnsemble gb200 (uid someone-else), not by this ImexEnsemble"),
        (service(selector={"app": "x"}), "conflict", "has a selector, so it cannot be adopted"),
        (service(cluster_ip="10.96.0.9"), "conflict", "is not headless (clusterIP '10.96.0.9')"),
        (service(label="gb300"), "foreign",
         "Service rack1/gb200 is labelled imex-ensemble.io/ensemble='gb300', another "
         "ensemble's name; it is left alone"),
    ],
)
def test_plan_service(observed: dict[str, Any] | None, action: str, fragment: str | None) -> None:
    plan = plan_service(cr_spec(), observed)
    assert plan.action == action
    if fragment is None:
        assert plan.message is None
    else:
        assert plan.message is not None and fragment in plan.message


def test_a_service_being_deleted_is_waited_for() -> None:
    svc = with_owner(service(), "old-cr")
    svc["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    plan = plan_service(cr_spec(), svc)
    assert plan.action == "conflict" and plan.message is not None
    assert "is being deleted" in plan.message


def test_service_in_sync_tolerates_what_others_own() -> None:
    desired = desired_service(cr_spec())
    observed = json.loads(json.dumps(desired))
    observed["metadata"]["labels"]["team"] = "x"
    observed["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied"] = "{}"
    observed["metadata"]["ownerReferences"].append({"apiVersion": "v1", "kind": "ConfigMap",
                                                   "name": "c", "uid": "u"})
    observed["spec"]["ports"].insert(0, {"name": "x", "port": 1, "protocol": "UDP",
                                         "targetPort": 1})
    observed["spec"]["ports"][1]["targetPort"] = 50000
    observed["spec"]["type"] = "ClusterIP"
    assert service_in_sync(desired, observed)
    observed["metadata"]["annotations"]["imex-ensemble.io/port"] = "1"
    assert not service_in_sync(desired, observed)
    assert not service_in_sync(desired, None)
    del observed["metadata"]["ownerReferences"][0]
    observed["metadata"]["annotations"]["imex-ensemble.io/port"] = "50000"
    assert not service_in_sync(desired, observed)


def test_status_only_cr_events_change_nothing() -> None:
    a = imex_ensemble(generation=3, resource_version="10")
    b = imex_ensemble(generation=3, resource_version="11", status={"imexReady": 3})
    assert not spec_changed(a, b)
    assert spec_changed(a, imex_ensemble(generation=4))
    assert spec_changed(a, imex_ensemble(uid="recreated", generation=3))
    assert spec_changed(None, a) and spec_changed(a, None)
    deleting = imex_ensemble(generation=3)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert spec_changed(a, deleting)


def test_declaration_key() -> None:
    assert Declaration("rack1", "gb200", CR_UID, 1, None).key == ("rack1", "gb200")


def test_registry_tls_required_both_forms() -> None:
    assert parse_ensemble_cr(imex_ensemble()).spec.registry_tls_required is False  # type: ignore[union-attr]
    spec = parse_ensemble_cr(imex_ensemble(registryTLS="Required")).spec
    assert spec is not None and spec.registry_tls_required
    # the owned Service says so too (a CR deleted with --cascade=orphan keeps it)
    assert service_annotations(spec)["imex-ensemble.io/registry-tls"] == "Required"
    bad = parse_ensemble_cr(imex_ensemble(registryTLS="Always"))
    assert bad.spec is None and "spec.registryTLS='Always'" in str(bad.message)
